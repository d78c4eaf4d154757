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
  * ties → least combined GPU + CPU KV usage, then at random; under `speed`, idle pods whose scores
    are closer than the estimates' spreads (TIE_Z standard errors) tie too (`tie_within_spread`).

One rule the formula does not carry (`queue_last`): a pod whose engine would queue the request (its
in-flight count at `max_num_seqs`, or at the batch its KV cache holds, from the speed fit's KV per
request) scores worse than every pod with a free slot. The score prices a queued request's wait per
output token like a slower batch, so past saturation it filled the fast type to the engine's limit
and queued there while the slow type had free slots (docs/fleet-simulation.md, issue 43's burst).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import add, attrgetter, gt, le

from extproc.openai import Request
from extproc.routing.framework import BuildContext, PodView, Profile, register
from extproc.routing.load_math import (
    INF,
    LowestScorePicker,
    capacities,
    engine_slots,
    kv_penalty,
    speeds,
)
from extproc.routing.settings import LoadBalanceSettings
from extproc.routing.snapshot import derived

# Scores within this many standard errors of the best (the speed estimates' spreads, combined) tie.
TIE_Z = 2.0


def load_balance_score(load: float, capacity: float, kv_free: float | None, alpha: float,
                       kv_critical: float) -> float:
    """One pod's score. `kv_free` None or NaN means the engine does not report KV usage."""
    if kv_free is None or kv_free != kv_free:  # NaN != NaN
        kv_free = 1.0
    elif kv_free < kv_critical:
        return INF
    if load <= 0:
        return 0.0  # idle: 0 whatever the capacity (and 0/0 never happens)
    return load / capacity * kv_penalty(kv_free, alpha)


class LoadBalanceScorer:
    lower_is_better = True

    __slots__ = ("settings",)

    def __init__(self, settings: LoadBalanceSettings) -> None:
        self.settings = settings

    def score(self, request: Request, pods: Sequence[PodView], now: float) -> list[float]:
        # load_balance_score over whole columns: everything but the running counts is derived once
        # per snapshot (routing/snapshot.py), so a request costs one pass of arithmetic per pod.
        c = derived(pods, self, self._columns)
        loads: list[float] = [p.running for p in pods]
        running = loads
        if c.queued is not None:  # `queued` is read only when λ > 0, as the spec says
            loads = [r + q for r, q in zip(loads, c.queued)]
        if c.speed is not None:
            base, shape, penalty = c.speed
            if c.folded:  # a KV-critical pod's base is +Inf and its shape 0: +Inf whatever its load
                scores = [b * (1.0 + k * (load + 1.0)) * p
                          for b, k, p, load in zip(base, shape, penalty, loads)]
            else:
                scores = [INF if x else b * (1.0 + k * (load + 1.0)) * p
                          for x, b, k, p, load in zip(c.critical, base, shape, penalty, loads)]
            scores = tie_within_spread(scores, loads, c.spread, c.widest)
        elif c.reported:  # every pod reports a number: idle needs no case of its own (0 / cap = 0)
            scores = [INF if x else load / cap * p
                      for x, load, cap, p in zip(c.critical, loads, c.caps, c.penalty)]
        else:
            scores = [INF if x else 0.0 if load <= 0 else load / cap * p
                      for x, load, cap, p in zip(c.critical, loads, c.caps, c.penalty)]
        if c.slots is not None and max(running) + 1 > c.fewest:  # some pod may be full: one more pass
            return queue_last(scores, running, c.slots)
        return scores

    def _columns(self, pods: Sequence[PodView]) -> _Columns:
        s = self.settings
        alpha, critical, weight = s.kv_pressure_alpha, s.kv_critical_free, s.queued_weight
        # λ·queued per pod; NaN counts as 0 (r + 0.0 is r, as a float: the same score)
        queued = [weight * q if (q := p.queued) == q else 0.0 for p in pods] if weight > 0 else None
        kvs = list(map(_kv_free, pods))
        flags = [k is not None and k < critical for k in kvs]  # NaN < x is False: unreported
        fitted = speeds(pods) if s.capacity == "speed" else None
        slots = engine_slots(s.max_num_seqs, fitted, len(pods))
        fewest = min(slots) if slots is not None else INF
        if fitted is not None:
            penalty = [1.0 if x else kv_penalty(k, alpha) for x, k in zip(flags, kvs)]
            base = [INF if x else sp.base for x, sp in zip(flags, fitted)]
            shape = [0.0 if x else sp.shape for x, sp in zip(flags, fitted)]
            # the fold holds while every load is finite (INF x (1 + 0 x inf) would be NaN)
            folded = queued is None or all(map(math.isfinite, queued))
            spread = [(TIE_Z * sp.spread) ** 2 for sp in fitted]
            return _Columns(queued, flags, (base, shape, penalty), folded, spread=spread, widest=max(spread),
                            slots=slots, fewest=fewest)
        reported = None not in kvs and (t := sum(kvs)) == t  # type: ignore[operator]  # no None, no NaN
        penalty = [kv_penalty(k, alpha) for k in kvs]  # unreported: fully free, no penalty
        return _Columns(queued, flags, None, True, capacities(pods), penalty, reported,
                        slots=slots, fewest=fewest)


@dataclass(slots=True, frozen=True)
class _Columns:
    """What the score reads besides running counts, per pod: fixed for one snapshot of the views."""

    queued: list[float] | None        # λ·queued (None: λ = 0, not read)
    critical: list[bool]              # free KV below kvCritical: +Inf
    speed: tuple[list[float], list[float], list[float]] | None  # base, shape, KV penalty (capacity: speed)
    folded: bool = True               # speed columns carry +Inf for critical pods (see score)
    caps: list[float] = field(default_factory=list)     # capacity: observed (or no speed fitted yet)
    penalty: list[float] = field(default_factory=list)
    reported: bool = False            # every pod reports its KV usage
    spread: list[float] = field(default_factory=list)  # (TIE_Z × each speed's spread)², log scale
    widest: float = 0.0                                # the largest of them
    slots: list[float] | None = None  # requests each pod's engine runs at once (None: rule off)
    fewest: float = INF               # the smallest of them


_kv_free = attrgetter("kv_free")


def queue_last(scores: list[float], running: Sequence[float], slots: Sequence[float]) -> list[float]:
    """Scores with every pod that has no free slot (`running + 1 > slots`) moved above the worst
    finite score of the pods that have one, in their own order. With no finite pod with a free slot,
    or none full, the scores stand: every pod queued is still routed to the best of them.

    Maps over builtins: at 1,000 pods with some full, 107 µs against 143-213 µs for a per-pod Python
    loop (docs/benchmarks.md, "load-balance's queue rule")."""
    over = list(map(gt, map(add, running, repeat(1.0)), slots))
    if not any(over):
        return scores
    full = list(compress(range(len(scores)), over))
    out = scores.copy()
    for i in full:
        out[i] = -INF
    ceiling = max(filter(INF.__gt__, out), default=-INF)
    if ceiling == -INF:  # no pod with a free slot has a finite score
        return scores
    for i in full:
        out[i] = ceiling + scores[i]
    return out


def tie_within_spread(scores: list[float], loads: Sequence[float], variance: Sequence[float],
                      widest: float) -> list[float]:
    """Idle pods whose scores the estimates cannot tell from the best get the best one's score (the
    spec's tie rule then decides: least KV usage, then at random): two pods whose speeds are known from
    a few requests each share the traffic that re-measures them, instead of the one measured faster by
    chance taking all of it; and an idle pod no worse by what is estimated beats a busy one.

    Only idle pods are lifted: a loaded pod's score also holds exact counts that move with every
    decision, and it is being re-measured anyway. Tying loaded pods handed requests to the stale KV
    tie-break (fleet simulation, burst: TTFT p99 290 ms against 208 without, a 20-deep queue).
    `variance`: per pod (TIE_Z × its spread)², `widest` the largest; scores are compared on a log
    scale."""
    best = min(scores)
    if not 0.0 < best < INF or widest == 0.0:
        return scores
    at = scores.index(best)
    mine = variance[at]
    limit = best * math.exp(math.sqrt(mine + widest))  # no pod above this can tie: one cheap pass
    # the few pods at or below the limit, found by maps over builtins (no Python per pod)
    close = compress(range(len(scores)), map(le, scores, repeat(limit)))
    near = [i for i in close if loads[i] == 0 and scores[i] != best]
    if not near:
        return scores
    # Beside a busy best, the idle ones go just below it: no worse by what is estimated, better by
    # what is counted (the KV tie-break could still pick the busy pod: its usage is a scrape old).
    lifted = best if loads[at] == 0 else math.nextafter(best, 0.0)
    out = list(scores)
    for i in near:
        if math.log(scores[i] / best) <= math.sqrt(mine + variance[i]):
            out[i] = lifted
    return out


@register("load-balance")
def build(ctx: BuildContext) -> Profile:
    return Profile("load-balance", LowestScorePicker(ctx.rng),
                   scorers=[(LoadBalanceScorer(ctx.settings.load_balance), 1.0)])
