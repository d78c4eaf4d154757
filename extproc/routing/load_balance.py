"""`load-balance`: capacity-aware routing for fleets of mixed GPU speeds (the spec's central feature).

    score = (running + λ·queued) / capacity × (1 + α·(1 − kvFree)²)        lower is better

Capacity (output tokens/s) only sets the denominator: a busy GPU shows high throughput because it
is busy, so throughput is never read as load. Which capacity, `routing.load_balance.capacity`:

  * `speed` (default): the pod's drain rate at the load it would have with this request,
    capacity(n) = n / tpot(n) with n = running + λ·queued + 1 and tpot(n) from its fitted speed
    (extproc/state/speed.py). The score is then tpot(n) × KV penalty: the time per output token the
    request would get there. It answers at once when load moves, and a pod that got little traffic
    keeps its speed. The `+ 1` replaces the spec's "idle scores 0": an idle pod scores its idle time
    per token, so a slow idle GPU loses to a fast one that is still quicker loaded (README, Routing).
  * `observed`: AIBrix's estimate, the output rate the pod was seen to produce (state/capacity.py),
    which follows the traffic the pod happens to get. The spec's edge cases, below, hold as written.

Edge cases, as the spec lists them (under `speed`, all but the idle rule):
  * no capacity estimate → the mean of the pods that have one (all equal when none has one);
  * KV usage not reported, or NaN → fully free: no penalty and no guardrail;
  * kvFree < kvCritical → +Inf: skipped when load-balance routes alone, a strong penalty when blended;
  * every pod at +Inf → the request still routes, to the pod with the most KV headroom;
  * idle (no load) → 0 whatever the capacity, so idle pods are preferred;
  * ties → least combined GPU + CPU KV usage, then at random.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from operator import attrgetter

from extproc.openai import Request
from extproc.routing.framework import PodView, Profile, RoutingSettings, capacities, register
from extproc.routing.settings import LoadBalanceSettings
from extproc.state.speed import Speed

INF = math.inf


def load_balance_score(load: float, capacity: float, kv_free: float | None, alpha: float,
                       kv_critical: float) -> float:
    """One pod's score. `kv_free` None or NaN means the engine does not report KV usage."""
    if kv_free is None or kv_free != kv_free:  # NaN != NaN
        kv_free = 1.0
    elif kv_free < kv_critical:
        return INF
    if load <= 0:
        return 0.0  # idle: 0 whatever the capacity (and 0/0 never happens)
    used = 1.0 - kv_free
    return load / capacity * (1.0 + alpha * used * used)


class LoadBalanceScorer:
    lower_is_better = True

    __slots__ = ("settings",)

    def __init__(self, settings: LoadBalanceSettings) -> None:
        self.settings = settings

    def score(self, request: Request, pods: Sequence[PodView], now: float) -> list[float]:
        # load_balance_score, inlined and over whole columns: this is most of a decision at 1000 pods
        s = self.settings
        alpha, critical, weight = s.kv_pressure_alpha, s.kv_critical_free, s.queued_weight
        loads: list[float] = list(map(_running, pods))
        if weight > 0:  # `queued` is read only when λ > 0, as the spec says; NaN counts as 0
            loads = [r + weight * q if (q := p.queued) == q else r for r, p in zip(loads, pods)]
        kvs = list(map(_kv_free, pods))
        if s.capacity == "speed" and (speeds := _speeds(pods)) is not None:
            return [INF if k is not None and k < critical  # NaN < x is False: unreported, as below
                    else sp.base * (1.0 + sp.shape * (load + 1.0)) * kv_penalty(k, alpha)
                    for load, sp, k in zip(loads, speeds, kvs)]
        caps = capacities(pods)
        if None not in kvs and (t := sum(kvs)) == t:  # every pod reports a number (no NaN): one pass
            return [INF if k < critical else load / cap * (1.0 + alpha * (1.0 - k) * (1.0 - k))
                    for load, cap, k in zip(loads, caps, kvs)]
        return [load_balance_score(load, cap, k, alpha, critical) for load, cap, k in zip(loads, caps, kvs)]


_running = attrgetter("running")
_kv_free = attrgetter("kv_free")
_speed = attrgetter("speed")


def kv_penalty(kv_free: float | None, alpha: float) -> float:
    """The score's second factor, 1 + α(1 − kvFree)²; unreported (None or NaN) is no penalty."""
    if kv_free is None or kv_free != kv_free:
        return 1.0
    used = 1.0 - kv_free
    return 1.0 + alpha * used * used


def _speeds(pods: Sequence[PodView]) -> list[Speed] | None:
    """Every pod's speed; a pod without one (new since the last refresh) gets the mean of the others'
    (its base as the mean drain rate, as the spec fills capacities). None when no pod has one yet."""
    speeds = list(map(_speed, pods))
    if None not in speeds:
        return speeds  # type: ignore[return-value]
    known = [sp for sp in speeds if sp is not None]
    if not known:
        return None
    base = len(known) / sum(1.0 / sp.base for sp in known)
    shape = sum(sp.shape for sp in known) / len(known)
    fill = Speed(base, shape, 0.0, 0.0)
    return [fill if sp is None else sp for sp in speeds]


def kv_usage(pod: PodView) -> float:
    """Combined GPU + CPU KV-cache usage (the tie-break); unreported parts count as empty."""
    gpu = 0.0 if pod.kv_free is None or pod.kv_free != pod.kv_free else 1.0 - pod.kv_free
    cpu = pod.cpu_kv_usage
    return gpu + (cpu if cpu is not None and cpu == cpu else 0.0)


class LowestScorePicker:
    """Load-balance routing alone: the lowest finite score wins; +Inf pods are passed over unless every
    pod is +Inf (cluster-wide KV pressure must not become an outage). Ties go to the least combined KV
    usage, then at random."""

    __slots__ = ("_rng",)

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView:
        best = min(scores)
        if best != best or best == INF:  # NaN only from a foreign scorer; treat as unusable
            tied: Sequence[PodView] = pods
        else:
            tied = [p for p, s in zip(pods, scores) if s == best]
            if len(tied) == 1:
                return tied[0]
        usage = [kv_usage(p) for p in tied]
        least = min(usage)
        tied = [p for p, u in zip(tied, usage) if u == least]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


@register("load-balance")
def build(settings: RoutingSettings) -> Profile:
    return Profile("load-balance", LowestScorePicker(settings.rng()),
                   scorers=[(LoadBalanceScorer(settings.load_balance), 1.0)])
