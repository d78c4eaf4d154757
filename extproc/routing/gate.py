"""The load-imbalance gate: a hotspot guard ahead of every non-exclusive strategy, made capacity-aware.

AIBrix's rule (`AIBRIX_LOAD_BALANCE_IMBALANCE_FACTOR` 2.0, `..._MIN_GAP` 8): the gate fires when
max − min ≥ min-gap and, with three or more pods, max > factor × (mean of the others + 1); it then keeps
only the least-loaded pods. Two pods skip the factor test (with factor 2 it would never hold).

AIBrix compares raw running counts, which the spec lists as a known limitation: a fast pod that rightly
carries more requests looks like a hotspot and is excluded before any capacity-aware score runs. Ours
compares running × mean capacity / capacity: still in "requests" (so min-gap keeps its meaning and its
default), but a pod twice as fast as the mean counts each request as half.

KV-critical pods (free KV below load-balance's `kvCritical`; unreported or NaN counts as fully free) are
left to the strategy's guardrail, and the gate never works against it:
  * the gate stands aside when every pod it would keep has no free engine slot (load-balance's
    `max_num_seqs` rule, routing/load_balance.py) while another pod has one;
  * the imbalance test compares only the KV-healthy pods, and only they can be kept: an idle pod that is
    out of KV does not make busy healthy pods look like hotspots, nor is it the pod the gate keeps;
  * when the test does not fire, every pod is passed on (critical ones too: load-balance skips them,
    blended they are penalised, and a strategy that ignores KV behaves as it would without the gate);
  * when every pod is critical the gate stands aside: KV headroom, not running count, is then what
    decides (load-balance's "most KV headroom" rule), and a load filter would drop that very pod.

Under `capacity: speed` the firing test is the same, but the pods kept are the KV-healthy ones with the
lowest load-balance score (the time per token the next request would get, × KV penalty): an idle slow GPU (one that misses the SLO even idle,
say) is "least loaded" by count, but sending a hotspot's overflow there is worse than to a loaded fast
pod.

Pure: a firing is counted in `counts[model]` (RoutingState.imbalance_total), which the gateway exports
as `extproc_load_imbalance_total{model}`.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import compress
from operator import add, attrgetter, is_, is_not, mul, truediv

from extproc.openai import Request
from extproc.routing.framework import PodView
from extproc.routing.load_math import capacities, engine_slots, has_free_slot, imbalanced, kv_penalty
from extproc.routing.load_math import speeds as speeds_or_fill  # `speeds` names a local below
from extproc.routing.settings import LoadBalanceSettings
from extproc.routing.snapshot import derived

# Normalised loads are floats: pods within this relative distance of the minimum count as tied.
TIE = 1e-9


def least_loaded(values: Sequence[float], factor: float, min_gap: float, scale: float = 1.0) -> list[int] | None:
    """Indices of the least-loaded pods when load (values × scale) is severely skewed, else None."""
    if len(values) < 2:
        return None
    return _skewed(values, min(values), max(values), factor, min_gap, scale)


def _skewed(values: Sequence[float], low: float, high: float, factor: float, min_gap: float,
            scale: float) -> list[int] | None:
    """least_loaded, given the values' minimum and maximum (the gate has them already)."""
    if not _fires(values, low, high, factor, min_gap, scale):
        return None
    limit = _tie_limit(low, scale)
    return [i for i, v in enumerate(values) if v <= limit]


def _fires(values: Sequence[float], low: float, high: float, factor: float, min_gap: float,
           scale: float) -> bool:
    """Whether load is severely skewed: some pod would be excluded (so not all tied, as with min-gap 0)."""
    if not imbalanced((high - low) * scale, high * scale, (sum(values) - high) * scale, len(values), factor,
                      min_gap):
        return False
    return high > _tie_limit(low, scale)  # the most loaded pod is not tied with the least


def _tie_limit(low: float, scale: float) -> float:
    return low + TIE * max(abs(low), 1.0 / scale if scale > 0 else 1.0)


def kv_healthy(pods: Sequence[PodView], critical: float) -> list[bool] | None:
    """Per pod, free KV at or above `critical` (unreported or NaN: fully free); None when every pod
    is, the common case, decided in one pass without a Python loop over the pods."""
    if _lowest_kv_free(pods) >= critical:  # False for a NaN: the exact check below decides
        return None
    flags = [k is None or not k < critical for k in map(_kv_free, pods)]  # NaN < critical is False
    return None if all(flags) else flags


def _lowest_kv_free(pods: Sequence[PodView]) -> float:
    """The least reported free-KV fraction (1.0 when none is reported). `min` skips a NaN unless the
    first value is one, and then returns NaN, so a NaN never hides a critical pod from the caller."""
    try:
        low = min(map(_kv_free, pods), default=1.0)
    except TypeError:  # a None (not reported) among numbers: compare only the reported values
        return min(filter(_reported, map(_kv_free, pods)), default=1.0)
    return 1.0 if low is None else low


_kv_free = attrgetter("kv_free")
_speed = attrgetter("speed")
_reported = partial(is_not, None)
_is_none = partial(is_, None)


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
        # Capacities, KV health and speeds are derived once per snapshot (routing/snapshot.py):
        # per request the gate reads only the running counts.
        c = derived(pods, self, self._columns)
        running = [p.running for p in pods]
        if c.speed is not None:  # which pods are least loaded does not matter: only whether it fires
            if not self._fires(running, c):
                return pods
            keep = _quickest(running, c)
        elif (keep := self._cool(running, c)) is None:  # type: ignore[assignment]
            return pods
        if c.slots is not None and _only_full(keep, running, c.slots):
            return pods  # it would keep only pods whose engines queue while others have a free slot
        self.counts[request.model] = self.counts.get(request.model, 0) + 1
        return [pods[i] for i in keep]

    def _columns(self, pods: Sequence[PodView]) -> _Columns:
        s = self.settings
        caps = capacities(pods) if self.capacity_aware else None
        healthy = kv_healthy(pods, s.kv_critical_free)
        speed = None
        if s.capacity == "speed" and self.capacity_aware:
            speeds = list(map(_speed, pods))
            if not any(map(_is_none, speeds)):  # unchanged while some pod has no fitted speed yet
                alpha, index = s.kv_pressure_alpha, range(len(pods))
                if healthy is not None:  # _quickest compares the KV-healthy pods only
                    index = list(compress(index, healthy))
                # Speed.tpot(r + 1) x KV penalty = b·p·(1 + k) + b·p·k·r: per request two maps over
                # builtins (_quickest), no Python per pod
                bp = [speeds[i].base * kv_penalty(pods[i].kv_free, alpha) for i in index]
                shape = [speeds[i].shape for i in index]
                speed = (list(index), [x * (1.0 + k) for x, k in zip(bp, shape)],
                         [x * k for x, k in zip(bp, shape)])
        fitted = speeds_or_fill(pods) if s.capacity == "speed" else None
        slots = engine_slots(s.max_num_seqs, fitted, len(pods))
        return _Columns(caps, sum(caps) / len(caps) if caps is not None else 1.0, healthy, speed, slots)

    def _cool(self, running: list[int], c: _Columns) -> list[int] | None:
        """Indices of the pods to keep when the gate fires, else None (keep every pod)."""
        s = self.settings
        ratios, scale = _normalised(running, c), c.scale
        low, high = min(ratios), max(ratios)
        if (high - low) * scale < s.imbalance_min_gap:
            return None  # the usual answer, before any KV check: no subset of the pods spreads wider
        healthy = c.healthy
        if healthy is None:  # every pod KV-healthy
            return _skewed(ratios, low, high, s.imbalance_factor, s.imbalance_min_gap, scale)
        if not any(healthy):
            return None  # all KV-critical: the strategy's "most KV headroom" rule decides, not load
        # Compared, and kept, among the healthy pods only (still in requests of the fleet's mean pod).
        subset = list(compress(ratios, healthy))
        return _among(healthy, least_loaded(subset, s.imbalance_factor, s.imbalance_min_gap, scale))

    def _fires(self, running: list[int], c: _Columns) -> bool:
        """`_cool(...) is not None`, without listing the pods it would keep."""
        s = self.settings
        ratios, scale = _normalised(running, c), c.scale
        low, high = min(ratios), max(ratios)
        if (high - low) * scale < s.imbalance_min_gap:
            return False
        if c.healthy is not None:
            if not any(c.healthy):
                return False
            ratios = list(compress(ratios, c.healthy))
            if len(ratios) < 2:
                return False
            low, high = min(ratios), max(ratios)
        return _fires(ratios, low, high, s.imbalance_factor, s.imbalance_min_gap, scale)


@dataclass(slots=True, frozen=True)
class _Columns:
    """What the gate reads besides running counts, per pod: fixed for one snapshot of the views."""

    caps: list[float] | None          # capacities (None: raw counts, not capacity-aware)
    scale: float                      # the mean capacity: running / capacity × scale is in requests
    healthy: list[bool] | None        # kv_healthy (None: every pod)
    # capacity: speed, every pod fitted: the KV-healthy pods' indices, and the score's intercept and
    # slope in running requests (see _columns)
    speed: tuple[list[int], list[float], list[float]] | None
    slots: list[float] | None = None  # engine_slots (None: load-balance's queue rule is off)


def _normalised(running: list[int], c: _Columns) -> list[float]:
    return running if c.caps is None else list(map(truediv, running, c.caps))  # type: ignore[return-value]


def _quickest(running: list[int], c: _Columns) -> list[int]:
    """When the gate fires under `capacity: speed`: the KV-healthy pods with the lowest load-balance
    score (time per token the next request would get × KV penalty), instead of the least loaded by
    count. Those include idle slow GPUs, and an idle GPU slower than a loaded fast one is no relief for
    a hotspot. Not used while some pod has no fitted speed yet (then `c.speed` is None)."""
    index, intercept, slope = c.speed  # type: ignore[misc]
    if c.healthy is not None:
        running = list(compress(running, c.healthy))
    # Speed.tpot(running + 1) x KV penalty, as load-balance scores (to rounding)
    score = list(map(add, intercept, map(mul, slope, running)))
    best = min(score)
    if score.count(best) == 1:
        return [index[score.index(best)]]
    return [i for i, t in zip(index, score) if t == best]


def _only_full(keep: list[int], running: list[int], slots: list[float]) -> bool:
    """The kept pods all lack a free slot while some pod has one (the kept few are looked at first:
    this runs on every decision the gate takes)."""
    if any(running[i] + 1.0 <= slots[i] for i in keep):
        return False
    return any(has_free_slot(running, slots))


def _among(mask: list[bool], keep: list[int] | None) -> list[int] | None:
    """Indices into the masked-in subset mapped back to indices into the whole list."""
    if keep is None:
        return None
    index = list(compress(range(len(mask)), mask))
    return [index[i] for i in keep]
