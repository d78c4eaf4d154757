"""Routing state that outlives config reloads: the tie-break RNG, round-robin positions, gate counts.

A reload rebuilds every Profile from new settings; anything a strategy learns or must remember across
decisions lives here instead, so the gateway keeps one RoutingState for its lifetime and hands it to
each new Router. Plain data, no clock, no I/O: the fleet simulation shares the same objects. The gateway
reaches every strategy's learned state through `forget` and `collect`, never by a strategy's name.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

from extproc.pool.pod import PodKey
from extproc.vocabulary import PodView

T = TypeVar("T")


@runtime_checkable
class Forgets(Protocol):
    """Learned state kept per pod: told which pods remain when the pool changes (a departed pod's goes)."""

    def forget(self, live: set[PodKey]) -> None: ...


@dataclass(slots=True, frozen=True)
class Series:
    """One metric a strategy's learned state shows on /metrics: `kind` is "counter" or "gauge";
    `samples` are (label values, value). Plain data: the server turns it into Prometheus families."""

    name: str
    help: str
    kind: str
    labels: tuple[str, ...]
    samples: list[tuple[tuple[str, ...], float]]


@runtime_checkable
class Collects(Protocol):
    """Learned state with metrics, computed when /metrics is scraped. `views(model)`: the model's ready
    pods as routing sees them now."""

    def collect(self, views: Callable[[str], Sequence[PodView]], now: float) -> Iterable[Series]: ...


@dataclass(slots=True)
class RoutingState:
    rng: random.Random = field(default_factory=random.Random)
    round_robin: dict[str, int] = field(default_factory=dict)        # model -> next position
    imbalance_total: dict[str, int] = field(default_factory=dict)    # model -> gate firings
    store: dict[Hashable, object] = field(default_factory=dict)      # other strategies' learned state

    @classmethod
    def seeded(cls, seed: int | None) -> RoutingState:
        return cls(rng=random.Random(seed))

    def slot(self, key: Hashable, factory: Callable[[], T]) -> T:
        """A strategy's own learned state (a prefix table, a predictor), created once, kept across reloads."""
        value = self.store.get(key)
        if value is None:
            value = self.store[key] = factory()
        return value  # type: ignore[return-value]

    def forget(self, live: set[PodKey]) -> None:
        """The pool changed: every learned state kept per pod drops the pods not in `live`."""
        for value in self.store.values():
            if isinstance(value, Forgets):
                value.forget(live)

    def collect(self, views: Callable[[str], Sequence[PodView]], now: float) -> Iterator[Series]:
        """Every learned state's metrics (/metrics)."""
        for value in self.store.values():
            if isinstance(value, Collects):
                yield from value.collect(views, now)
