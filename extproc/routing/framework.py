"""The scheduling framework, after the Gateway API Inference Extension's plugin roles.

A strategy is a Profile: Filters narrow the candidates, Scorers rate each in [0, 1] (higher is better)
and are blended by weight, a Picker chooses. Adding a strategy is one module that calls `register`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extproc.openai import Request
from extproc.pool.pod import Pod


@dataclass(slots=True)
class PodView:
    """A snapshot of one pod as routing sees it for one decision."""

    pod: Pod
    running: int = 0


@dataclass(slots=True)
class RoutingSettings:
    """Knobs strategies are built from (config file + environment)."""

    seed: int | None = None
    extra: dict[str, float] = field(default_factory=dict)


class Filter(Protocol):
    def filter(self, request: Request, pods: Sequence[PodView], now: float) -> Sequence[PodView]: ...


class Scorer(Protocol):
    def score(self, request: Request, pods: Sequence[PodView], now: float) -> Sequence[float]: ...


class Picker(Protocol):
    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView: ...


class MaxScorePicker:
    """Highest blended score wins; ties are broken at random so equal pods share load."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView:
        best = max(scores)
        winners = [p for p, s in zip(pods, scores) if s == best]
        return winners[0] if len(winners) == 1 else self._rng.choice(winners)


class RandomPicker:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView:
        return self._rng.choice(pods)


@dataclass(slots=True)
class Profile:
    name: str
    picker: Picker
    scorers: list[tuple[Scorer, float]] = field(default_factory=list)
    filters: list[Filter] = field(default_factory=list)

    def pick(self, request: Request, pods: Sequence[PodView], now: float) -> PodView | None:
        for f in self.filters:
            pods = f.filter(request, pods, now)
        if not pods:
            return None
        if len(pods) == 1:
            return pods[0]
        totals = [0.0] * len(pods)
        for scorer, weight in self.scorers:
            for i, s in enumerate(scorer.score(request, pods, now)):
                totals[i] += weight * s
        return self.picker.pick(pods, totals)


Factory = Callable[[RoutingSettings], Profile]
_REGISTRY: dict[str, Factory] = {}


class UnknownStrategy(KeyError):
    pass


def register(name: str) -> Callable[[Factory], Factory]:
    def add(factory: Factory) -> Factory:
        _REGISTRY[name] = factory
        return factory
    return add


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def build(name: str, settings: RoutingSettings | None = None) -> Profile:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UnknownStrategy(name) from None
    return factory(settings or RoutingSettings())
