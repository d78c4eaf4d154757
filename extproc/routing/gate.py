"""The load-imbalance gate: a hotspot guard ahead of every non-exclusive strategy, made capacity-aware.

AIBrix's rule (`AIBRIX_LOAD_BALANCE_IMBALANCE_FACTOR` 2.0, `..._MIN_GAP` 8): the gate fires when
max − min ≥ min-gap and, with three or more pods, max > factor × (mean of the others + 1); it then keeps
only the least-loaded pods. Two pods skip the factor test (with factor 2 it would never hold).

AIBrix compares raw running counts, which the spec lists as a known limitation: a fast pod that rightly
carries more requests looks like a hotspot and is excluded before any capacity-aware score runs. Ours
compares running × mean capacity / capacity: still in "requests" (so min-gap keeps its meaning and its
default), but a pod twice as fast as the mean counts each request as half.

Pure: a firing is counted in `counts[model]` (RoutingState.imbalance_total), which the gateway exports
as `extproc_load_imbalance_total{model}`.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from operator import attrgetter, truediv

from extproc.openai import Request
from extproc.routing.framework import PodView, capacities
from extproc.routing.settings import LoadBalanceSettings

# Normalised loads are floats: pods within this relative distance of the minimum count as tied.
TIE = 1e-9


def loads(pods: Sequence[PodView], capacity_aware: bool = True) -> list[float]:
    """Each pod's running count, in requests of a mean-capacity pod when `capacity_aware`."""
    ratios, scale = _ratios(pods, capacity_aware)
    return [r * scale for r in ratios]


def _ratios(pods: Sequence[PodView], capacity_aware: bool) -> tuple[list[float], float]:
    """running / capacity per pod (map over a builtin: no Python per pod) and the scale (the mean
    capacity) that turns them into requests; raw counts and 1.0 when not capacity-aware."""
    running = list(map(_running, pods))
    if not capacity_aware:
        return running, 1.0
    caps = capacities(pods)
    return list(map(truediv, running, caps)), sum(caps) / len(caps)


def least_loaded(values: Sequence[float], factor: float, min_gap: float, scale: float = 1.0) -> list[int] | None:
    """Indices of the least-loaded pods when load (values × scale) is severely skewed, else None."""
    n = len(values)
    if n < 2:
        return None
    low, high = min(values), max(values)
    if (high - low) * scale < min_gap:
        return None
    if n > 2 and high * scale <= factor * ((sum(values) - high) * scale / (n - 1) + 1):
        return None
    limit = low + TIE * max(abs(low), 1.0 / scale if scale > 0 else 1.0)
    keep = [i for i, v in enumerate(values) if v <= limit]
    return keep if len(keep) < n else None  # all tied (min-gap 0): nothing to exclude, nothing to count


_running = attrgetter("running")


class ImbalanceGate:
    """A Filter. `capacity_aware=False` is AIBrix's raw-count gate (kept for comparison and tests)."""

    __slots__ = ("settings", "counts", "capacity_aware")

    def __init__(self, settings: LoadBalanceSettings, counts: MutableMapping[str, int],
                 capacity_aware: bool = True) -> None:
        self.settings = settings
        self.counts = counts
        self.capacity_aware = capacity_aware

    def filter(self, request: Request, pods: Sequence[PodView], now: float) -> Sequence[PodView]:
        if len(pods) < 2:
            return pods
        ratios, scale = _ratios(pods, self.capacity_aware)
        keep = least_loaded(ratios, self.settings.imbalance_factor, self.settings.imbalance_min_gap, scale)
        if keep is None:
            return pods
        self.counts[request.model] = self.counts.get(request.model, 0) + 1
        return [pods[i] for i in keep]
