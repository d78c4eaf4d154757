"""The load math every capacity-aware strategy shares, written once: the KV penalty, mean-filled
capacities and speeds, load ratios, the imbalance rule, and the lowest-score picker.

load-balance's score (load_balance.py), the imbalance gate (gate.py), prefix-cache's yield to load
(prefix_cache.py) and the strategies that route by a lowest score (power-of-two, session-affinity,
least-latency, throughput) all import it; none of them imports another for these. Pure: no I/O, no
time of its own.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from functools import partial
from operator import attrgetter, is_, truediv

from extproc.routing.ordering import best_first
from extproc.routing.settings import LoadBalanceSettings
from extproc.vocabulary import UNKNOWN_SPREAD, PodView, Speed

INF = math.inf

_capacity = attrgetter("capacity")
_running = attrgetter("running")
_speed = attrgetter("speed")
_is_none = partial(is_, None)


# -- KV ------------------------------------------------------------------------------------------

def kv_penalty(kv_free: float | None, alpha: float) -> float:
    """load-balance's second factor, 1 + α(1 − kvFree)²; unreported (None or NaN) is no penalty."""
    if kv_free is None or kv_free != kv_free:
        return 1.0
    used = 1.0 - kv_free
    return 1.0 + alpha * used * used


def kv_usage(pod: PodView) -> float:
    """Combined GPU + CPU KV-cache usage (the tie-break); unreported parts count as empty."""
    gpu = 0.0 if pod.kv_free is None or pod.kv_free != pod.kv_free else 1.0 - pod.kv_free
    cpu = pod.cpu_kv_usage
    return gpu + (cpu if cpu is not None and cpu == cpu else 0.0)


# -- mean-fill -----------------------------------------------------------------------------------

def mean_fill(values: Sequence[float | None], default: float) -> list[float]:
    """Each None replaced by the mean of the others (`default` when every value is None): a pod with no
    figure competes as an average one."""
    known = [v for v in values if v is not None]
    fill = sum(known) / len(known) if known else default
    return [fill if v is None else v for v in values]


def capacities(pods: Sequence[PodView]) -> list[float]:
    """Each pod's capacity for scoring: a pod with no usable estimate gets the mean of those that have
    one (it competes as an average replica); with no estimate anywhere every pod gets 1.0, so scores
    reduce to load (x KV penalty). The gateway mean-fills already; this covers every other caller."""
    caps = list(map(_capacity, pods))
    # The common case, at C speed: every pod has an estimate (a NaN anywhere makes the sum NaN).
    if None not in caps and 0 < min(caps) and (total := sum(caps)) == total and max(caps) < INF:  # type: ignore
        return caps  # type: ignore[return-value]
    return mean_fill([c if c is not None and 0 < c < INF else None for c in caps], 1.0)


def speeds(pods: Sequence[PodView]) -> list[Speed] | None:
    """Every pod's speed; a pod without one (new since the last refresh) gets the mean of the others'
    (its base as the mean drain rate, as capacities are filled). None when no pod has one yet."""
    found = list(map(_speed, pods))
    if not any(map(_is_none, found)):  # not `None in found`: that calls Speed.__eq__ per pod
        return found  # type: ignore[return-value]
    known = [sp for sp in found if sp is not None]
    if not known:
        return None
    base = len(known) / sum(1.0 / sp.base for sp in known)
    shape = sum(sp.shape for sp in known) / len(known)
    fill = Speed(base, shape, 0.0, 0.0, UNKNOWN_SPREAD)  # unmeasured: tied until measured
    return [fill if sp is None else sp for sp in found]


def engine_slots(max_num_seqs: int, fitted: Sequence[Speed] | None, n: int) -> list[float] | None:
    """Per pod, the requests its engine runs before it queues the next: `max_num_seqs` (the engines'
    --max-num-seqs, from config), or fewer where the speed fit's KV per request says the cache holds
    fewer (`Speed.batch`; 0 while not measured). None: the rule is off (max_num_seqs 0)."""
    if max_num_seqs <= 0:
        return None
    if fitted is None:
        return [float(max_num_seqs)] * n
    return [min(float(max_num_seqs), sp.batch) if sp.batch >= 1.0 else float(max_num_seqs) for sp in fitted]


def has_free_slot(running: Sequence[float], slots: Sequence[float]) -> list[bool]:
    """Per pod: one more request would run at once rather than wait in the engine's queue."""
    return [r + 1.0 <= s for r, s in zip(running, slots)]


# -- load ratios and the imbalance rule ----------------------------------------------------------

def ratios(pods: Sequence[PodView], capacity_aware: bool = True) -> tuple[list[float], float]:
    """running / capacity per pod (map over a builtin: no Python per pod) and the scale (the mean
    capacity) that turns them into requests; raw counts and 1.0 when not capacity-aware."""
    running = list(map(_running, pods))
    if not capacity_aware:
        return running, 1.0
    caps = capacities(pods)
    return list(map(truediv, running, caps)), sum(caps) / len(caps)


def loads(pods: Sequence[PodView], capacity_aware: bool = True) -> list[float]:
    """Each pod's running count, in requests of a mean-capacity pod when `capacity_aware`."""
    values, scale = ratios(pods, capacity_aware)
    return [r * scale for r in values]


def imbalanced(gap: float, load: float, others: float, n: int, factor: float, min_gap: float) -> bool:
    """AIBrix's imbalance rule for one pod among `n`, in requests: its `load` is `gap` above the
    least-loaded pod's, at least `min_gap`, and, with three or more pods, above `factor` x (the mean of
    the others' loads, whose sum is `others`, + 1). Two pods skip the factor test (with factor 2 it
    would never hold)."""
    return gap >= min_gap and (n <= 2 or load > factor * (others / (n - 1) + 1))


def overloaded(pods: Sequence[PodView], settings: LoadBalanceSettings) -> list[bool]:
    """Per pod, the imbalance rule against its capacity-normalised load (the pods a gate that fires
    would exclude, ties with the least loaded aside)."""
    values = loads(pods)
    low, total, n = min(values), sum(values), len(values)
    factor, gap = settings.imbalance_factor, settings.imbalance_min_gap
    return [imbalanced(v - low, v, total - v, n, factor, gap) for v in values]


# -- the picker ----------------------------------------------------------------------------------

class LowestScorePicker:
    """The lowest finite score wins; +Inf pods are passed over unless every pod is +Inf (cluster-wide
    KV pressure must not become an outage). Ties go to the least combined KV usage, then at random."""

    __slots__ = ("_rng",)

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView:
        best = min(scores)
        if best != best or best == INF:  # NaN only from a foreign scorer; treat as unusable
            tied: Sequence[PodView] = pods
        else:
            if scores.count(best) == 1:  # the usual case, without a pass of Python over the pods
                return pods[scores.index(best)]
            tied = [p for p, s in zip(pods, scores) if s == best]
        usage = [kv_usage(p) for p in tied]
        least = min(usage)
        tied = [p for p, u in zip(tied, usage) if u == least]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def order(self, pods: Sequence[PodView], scores: Sequence[float], n: int | None = None) -> list[PodView]:
        """The first `n` pods (all: None) as `pick` ranks them: finite scores ascending (+Inf and NaN
        last), ties by the least KV usage, then at random."""
        return best_first(pods, [s if s == s else INF for s in scores], n, self._rng, kv_usage)
