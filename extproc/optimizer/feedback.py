"""The plan corrected by what it produced: how each GPU type kept the SLO under the last plans (pure).

A profile is a benchmark of one replica serving one request shape. Behind the router a replica serves a
mix: a long prompt's prefill stalls the decodes batched with it, and a type with little TPOT slack (an
A10 whose idle step is already 34 ms of a 50 ms target) misses where its profile says it holds. The
gateways record, per deployment and trace window, the time per output token of every request it
completed (`meta_tpot`, a histogram; tracing.window), and the requests the SLO router refused that it
could have served (`meta_rejected`: a refusal is a miss, though no TPOT of it is ever seen). Each
re-plan reads the last `span_s` of them and keeps one factor per deployment on its profile's throughput:

  * attainment below `target` (99 %): the factor shrinks in proportion to the shortfall (by at most a
    fifth a step), so the plan gives that type less of the mix and more replicas of the others;
  * attainment at `recover` (99.5 %) or above: it grows back by a tenth, up to 1; beyond 1 (up to
    `ceiling`, twice the benchmark) only while the type's P99 TPOT is at most `headroom` (0.8) of the
    SLO and the router refused none of the model's requests, by sqrt(that room) a step (a tenth to a
    quarter): the profile undercounts it (a coarse rate grid, gen-profile's "kept up" rule on long
    answers), and its replicas show room the plan can use; while the router refuses any, a factor above
    1 goes back toward it (by a fifth a step; the refusal may be charged to another type, whose factor
    the rule above cuts, but the raise made the fleet short). Never beyond 1 for a profile with
    `concurrency_admitted` (ceiling_of).

It moves only on evidence: `min_requests` in the span, and never in the first `span_s` it watches a
deployment (a fleet just started, or just handed to the optimizer, is not the plan's doing). After a
change that adds replicas (a factor cut, or the deployment's count rising) it waits `settle_s` and reads
only windows that ended since, so it sees the fleet the change produced (the autoscaler and provisioning
take that long), not a fleet in transition. After one that removes replicas (a factor raised) it reads
the windows that ended since the change and no settle: a smaller fleet serves at once, and what it
refuses then is the change's doing (waiting `settle_s` there kept a raised factor through a whole burst
it was refusing); it raises again only `settle_s` after its last move.

The SLO is the profile's: TPOT, TTFT, E2E and TPAT (E2E over prompt + output tokens) each have a
histogram in the traces (`meta_tpot`, `meta_ttft`, `meta_e2e`, `meta_tpat`, as the client saw them),
and a profile naming several is judged on the one its deployment keeps worst, its room on the least of
them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from extproc.gpu_profiles import GpuProfile
from extproc.optimizer.workload import TraceWindow
from extproc.tracing.window import LATENCY_KEYS, tpot_of_bucket

FED_BACK = tuple(LATENCY_KEYS)  # the SLO metrics the traces carry a histogram of: tpot, ttft, e2e, tpat
MAX_STEP_UP = 1.25  # growth per step with room: sqrt(room), between a tenth and a quarter
# The gain: a shortfall s below the 99 % target cuts the type's throughput by gain·s, the step capped at
# a fifth; gain = that cap over a shortfall of 4 points (96 %), the most a fleet that nearly keeps the SLO
# misses by, so smaller misses take proportionally smaller steps.
GAIN = 5.0
# The most a profile without admitted budgets (gen-profile's one-replica rule) may be raised: the ratio
# gen-profile keeps between the largest passing budget and the one kept (BUDGET_MARGIN, 2). A profile
# with `concurrency_admitted` is never raised (ceiling_of).
CEILING = 2.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one deployment's requests saw over the span."""

    completed: int
    within: int  # the latency at most the SLO target
    p99_s: float
    rejected: int = 0  # refused by the SLO router while this deployment could have served them
    metric: str = "tpot"  # which latency: "tpot", "ttft", "e2e" or "tpat"

    @property
    def requests(self) -> int:
        return self.completed + self.rejected

    @property
    def attainment(self) -> float:
        """A refused request missed its SLO as surely as a slow one (meta_rejected)."""
        return self.within / self.requests if self.requests else 1.0


@dataclass(slots=True)
class Feedback:
    # span and settle: the policy's derived defaults at a 240 s window, 10 s re-plans and a 60 s start-up
    # (optimizer/policy.py, where the rules are)
    span_s: float = 120.0
    settle_s: float = 90.0
    min_requests: int = 200
    target: float = 0.99
    recover: float = 0.995
    floor: float = 0.2
    ceiling: float = CEILING  # a type with room may plan at up to twice its benchmark
    headroom: float = 0.8  # ... while its P99 TPOT is at most this share of the SLO
    gain: float = GAIN  # factor x (1 - gain x shortfall), at least x0.8: 97 % attainment -> x0.9
    factors: dict[str, float] = field(default_factory=dict)  # deployment -> factor on its throughput
    changed: dict[str, float] = field(default_factory=dict)  # deployment -> when its factor last moved
    # deployment -> the windows it reads end after this: its factor's last move, plus settle_s for a cut
    read_from: dict[str, float] = field(default_factory=dict)
    first_seen: dict[str, float] = field(default_factory=dict)  # deployment -> its first reading
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # the last reading, for the dashboard

    def factor(self, deployment: str) -> float:
        return self.factors.get(deployment, 1.0)

    def update(self, windows: Iterable[TraceWindow], now: float, profiles: Sequence[GpuProfile],
               grew: Mapping[str, float] | None = None) -> None:
        """One re-plan's reading. `now` and window ends are unix seconds; profiles name deployments.
        `grew`: per deployment, when the count the optimizer reports for it last rose; its windows
        before that plus `settle_s` are a deployment in transition (replicas starting), not the plan.
        Only its own: another deployment's added replicas take load off it, they cannot make it miss."""
        windows = list(windows)
        # when the router refused anything in the span, no type shows spare room (below)
        refusing = any(any(w.rejected.values()) for w in windows if now - self.span_s < w.end <= now)
        for p in profiles:
            targets = slo_targets(p)
            if not targets:
                continue
            since = max(now - self.span_s, self.read_from.get(p.gpu, -math.inf),
                        (grew or {}).get(p.gpu, -math.inf) + self.settle_s)
            each = per_slo(windows, p, since, now)
            seen = worst(each)
            self.outcomes[p.gpu] = seen
            first = self.first_seen.setdefault(p.gpu, now)
            if seen.requests < self.min_requests or now - first < self.span_s:
                continue
            old = self.factor(p.gpu)
            if seen.attainment < self.target:
                new = max(self.floor, old * max(0.8, 1.0 - self.gain * (self.target - seen.attainment)))
            elif refusing and old > 1.0:
                new = max(1.0, old * 0.8)  # a raise beyond the benchmark holds only while nothing is refused
            elif seen.attainment >= self.recover and now >= self.raise_after(p.gpu):
                # back to the benchmark; beyond it only while the P99 shows room (> 1: well inside; the
                # profile undercounts). Not while the router refuses any of the model's requests: the
                # fleet is short, and the P99 of what it admitted is the router's doing (it holds each
                # pod's batch at its budget), not spare capacity; the refusal may name another type.
                room = 0.0 if refusing else min(self.headroom * targets[o.metric] / max(o.p99_s, 1e-6)
                                                for o in each)
                step = min(MAX_STEP_UP, math.sqrt(room)) if room >= 1.0 else 1.1
                new = max(old, min(self.ceiling_of(p) if room >= 1.0 else 1.0, old * max(1.1, step)))
            else:
                continue
            if new != old:
                self.factors[p.gpu] = new
                self.changed[p.gpu] = now
                self.read_from[p.gpu] = now + (self.settle_s if new < old else 0.0)

    def raise_after(self, deployment: str) -> float:
        """A raise waits `settle_s` after the factor's last move: the fleet that move made, seen first."""
        return self.changed.get(deployment, -math.inf) + self.settle_s

    def ceiling_of(self, p: GpuProfile) -> float:
        """A profile measured at the budget the SLO router enforces (`concurrency_admitted`) is not raised
        above its benchmark: the room its P99 shows is room the router keeps by admitting no more than it
        can serve, not spare capacity. Raising it up to the rate measured at the largest passing budget
        (`tputs_admitted_max`) was tried on the acceptance rows and left them refusing (docs/optimizer.md,
        "Acceptance"). Only a profile without it may read more."""
        return 1.0 if p.concurrency_admitted is not None else self.ceiling

    def apply(self, profiles: Sequence[GpuProfile]) -> list[GpuProfile]:
        """The profiles with each deployment's factor on what its replicas serve."""
        return [scaled(p, self.factor(p.gpu)) for p in profiles]


def scaled(p: GpuProfile, factor: float) -> GpuProfile:
    if factor == 1.0:
        return p
    return replace(p, tputs_admitted=tuple(tuple(t * factor for t in row) for row in p.served))


def _named(trace_name: str, deployment: str) -> bool:
    """Traces name a pod's deployment (`l20`); the service keys deployments `namespace/name`."""
    return trace_name == deployment or deployment.endswith("/" + trace_name)


def slo_targets(p: GpuProfile) -> dict[str, float]:
    """The profile's SLO targets (seconds) the traces can judge: metric -> target."""
    return {m: p.slos[m] for m in FED_BACK if p.slos.get(m)}


def per_slo(windows: Sequence[TraceWindow], p: GpuProfile, since: float, now: float) -> list[Outcome]:
    """The deployment's outcome against each SLO of its profile the traces can judge."""
    return [outcome(windows, p.gpu, since, now, slo, m) for m, slo in slo_targets(p).items()]


def worst(seen: Sequence[Outcome]) -> Outcome:
    """Of one deployment's outcomes, one per SLO metric, the one it keeps least (the first on a tie)."""
    return min(seen, key=lambda o: o.attainment)


def outcome(windows: Iterable[TraceWindow], deployment: str, since: float, now: float,
            slo_s: float, metric: str = "tpot") -> Outcome:
    hist: dict[int, int] = {}
    rejected = 0
    for w in windows:
        if not since < w.end <= now:
            continue
        for name, h in w.latency(metric).items():
            if _named(name, deployment):
                for b, n in h.items():
                    hist[b] = hist.get(b, 0) + n
        rejected += sum(n for name, n in w.rejected.items() if _named(name, deployment))
    total = sum(hist.values())
    within = sum(n for b, n in hist.items() if tpot_of_bucket(b) <= slo_s)
    return Outcome(total, within, _p99(hist, total), rejected, metric)


def strained(windows: Sequence[TraceWindow], profiles: Sequence[GpuProfile], target: float) -> bool:
    """Whether these windows show the fleet short: the SLO router refused a request, or fewer than
    `target` of the completed requests kept their deployment's SLO (the latency it keeps worst). True
    when that cannot be read (no profile states an SLO the traces record, or the windows carry no
    latencies of those deployments, as an AIBrix gateway's do): then a burst is planned for
    (workload.read_workload)."""
    if not windows or any(any(w.rejected.values()) for w in windows):
        return True
    since, now = min(w.end for w in windows) - 1, max(w.end for w in windows)
    seen = [worst(each) for p in profiles if (each := per_slo(windows, p, since, now))]
    completed = sum(o.completed for o in seen)
    return completed == 0 or sum(o.within for o in seen) < target * completed


def _p99(hist: Mapping[int, int], total: int) -> float:
    if not total:
        return 0.0
    rank = math.ceil(0.99 * total)
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return tpot_of_bucket(b)
    return tpot_of_bucket(max(hist))
