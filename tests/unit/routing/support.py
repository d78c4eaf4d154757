"""Hand-built PodView snapshots for routing tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from extproc.openai import Request
from extproc.pool import Pod
from extproc.routing import PodView, Profile, RoutingSettings, framework

REQ = Request(model="m", path="/v1/chat/completions")


def view(name: str, running: int = 0, *, queued: float = 0.0, kv_free: float | None = None,
         cpu: float | None = None, capacity: float | None = None, model: str = "m") -> PodView:
    return PodView(Pod(model, name, f"10.0.0.{abs(hash(name)) % 250 + 1}:8000"), running=running, queued=queued,
                   kv_free=kv_free, cpu_kv_usage=cpu, capacity=capacity)


def names(pods) -> list[str]:
    return [p.pod.name for p in pods]


@contextmanager
def registered(name: str, factory: Callable[[RoutingSettings], Profile]) -> Iterator[None]:
    """A strategy registered (or replaced) for one test only."""
    before = framework._REGISTRY.get(name)
    framework.register(name)(factory)
    try:
        yield
    finally:
        if before is None:
            del framework._REGISTRY[name]
        else:
            framework._REGISTRY[name] = before


class FixedScorer:
    """Scores pods from a name -> score table; unknown pods are unscored (NaN)."""

    def __init__(self, table: dict[str, float], lower_is_better: bool = False) -> None:
        self.table = table
        self.lower_is_better = lower_is_better

    def score(self, request, pods, now):
        return [self.table.get(p.pod.name, float("nan")) for p in pods]
