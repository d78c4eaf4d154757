"""The GPU optimizer in the fleet simulation's loop (`extproc fleet-sim --optimizer`).

The simulated gateways write request traces as live ones do (`TraceHooks` -> `TraceRecorder`, windows
keyed by wall-clock time, here virtual time from EPOCH); a dict stands in for Redis. Every `interval_s`
the optimizer's own code re-plans from them: `window_ends` + `parse_trace` (what `read_windows` reads),
then `planning.plan_model` (rates, the feedback's correction, the MILP, each deployment's most replicas,
the policy's constants) exactly as the live service runs it, `ModelState.apply`/`reported` (overrides
none, no load: min_replicas). A PodAutoscaler then scales
each deployment to ceil(metric / targetValue) with the
metric in hundredths of a replica and targetValue 100, within [0, the replicas it may run] (the spec
requires each PodAutoscaler's minReplicas to be 0: `min_replicas` is the optimizer's floor with no load,
not the autoscaler's), down only to the highest count of the last `stabilization_s` (the HPA's
scale-down stabilization), and not at all within 10 % of where it is (the HPA's tolerance).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from extproc.fleetsim.fleet import Replica
from extproc.fleetsim.scenario import Autoscale, Group
from extproc.gpu_profiles import GpuProfile
from extproc.optimizer.deployments import Deployment
from extproc.optimizer.monitor import ModelState
from extproc.optimizer.planning import plan_model
from extproc.optimizer.service import REPLICA_UNITS
from extproc.optimizer.traces import window_ends
from extproc.optimizer.workload import READ_SPAN, parse_trace
from extproc.server.traces import TraceHooks
from extproc.slo.fleet_factors import encode, factors_key
from extproc.tracing.window import TraceRecorder, trace_key

EPOCH = 1_700_000_000.0  # virtual time 0 as unix time (trace keys carry window ends in unix seconds)
TARGET_VALUE = REPLICA_UNITS  # the PodAutoscaler's targetValue for vllm:deployment_replicas
TOLERANCE = 0.1  # no scaling within 10 % of the current count (HPA's default tolerance; AIBrix's APA too)


@dataclass(slots=True)
class Timeline:
    """What the optimizer asked for and what ran, per re-plan."""

    times: list[float] = field(default_factory=list)
    desired: dict[str, list[int]] = field(default_factory=dict)   # deployment -> PodAutoscaler target
    billed: dict[str, list[int]] = field(default_factory=dict)    # serving + starting + draining
    cost_per_hour: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    factors: list[dict[str, float]] = field(default_factory=list)  # the feedback's, per re-plan
    rps: list[float] = field(default_factory=list)  # the workload the optimizer read, per re-plan
    refused: list[int] = field(default_factory=list)  # router refusals in the windows read (meta_rejected)
    # (time, cost per hour from then on) at every change of what is billed: a replica asked for (billed
    # while it starts), cancelled, or gone when its last request ended. The mean is its integral: a
    # draining replica costs the seconds it drains, not a whole re-plan interval from the decision.
    bills: list[tuple[float, float]] = field(default_factory=list)


class Optimizer:
    def __init__(self, model: str, groups: Mapping[str, Group], profiles: Mapping[str, GpuProfile],
                 settings: Autoscale, clock: Callable[[], float]) -> None:
        self.model = model
        self.groups = dict(groups)
        self.profiles = [profiles[d] for d in sorted(profiles)]
        self.settings = settings
        self.clock = clock
        self.recorder = TraceRecorder()
        self.redis: dict[str, str] = {}
        self.policy = settings.resolved()
        # the autoscaler's maximum per deployment is the deployment's max_replicas, as the service reads it
        self.state = ModelState(model, deployments={
            d: Deployment("default", d, model, g.min_replicas, g.initial, max_replicas=g.replicas)
            for d, g in self.groups.items()}, feedback=self.policy.feedback())
        self.timeline = Timeline()
        # (time, counts) within the stabilization. The first is the initial fleet, as Kubernetes' HPA
        # seeds it: its controller records the running count as a new autoscaler's first recommendation
        # (recordInitialRecommendation), so the fleet it finds is held through the stabilization window.
        self.asked: list[tuple[float, dict[str, int]]] = [
            (0.0, {d: g.initial if g.initial is not None else g.replicas for d, g in self.groups.items()})]
        self.scaled_to: dict[str, int] = {}

    def hooks(self) -> TraceHooks:
        """One per simulated gateway: they all write into the same windows, as live ones do in Redis."""
        return TraceHooks(self.recorder, lambda: EPOCH + self.clock())

    def tick(self, now: float) -> dict[str, int]:
        """One re-plan at virtual time `now`: the replicas each deployment's PodAutoscaler asks for."""
        wall = EPOCH + now
        for key, value in self.recorder.due(wall):  # the gateways' flush
            self.redis[key] = value
        windows = []
        for end in window_ends(wall, READ_SPAN * self.settings.window_s):  # as the service reads them
            raw = self.redis.get(trace_key(self.model, end))
            if raw is not None:
                windows.append(parse_trace(end, json.loads(raw)))
        result = plan_model(self.state, windows, wall, self.settings.window_s, self.profiles, self.policy)
        # published as the service publishes them; the loop hands them to its gateways (loop.on_replan)
        self.redis[factors_key(self.model)] = encode(self.state.feedback.factors, wall)
        if result.error:
            self.timeline.errors.append(f"{now:.0f}s: {result.error}")
        self.timeline.factors.append({d: self.state.feedback.factor(d) for d in self.groups})
        demands, plan, error = result.demands, result.plan, result.error
        self.timeline.rps.append(sum(d.rps for d in demands))
        self.timeline.refused.append(sum(n for w in windows if w.end > wall - self.settings.window_s
                                         for n in w.rejected.values()))
        self.state.apply(wall, demands, plan, error, result.burst, result.held)
        now_asked = {}
        for d, g in self.groups.items():
            metric = self.state.reported(d) * REPLICA_UNITS
            now_asked[d] = min(g.replicas, math.ceil(metric / TARGET_VALUE))
        self.asked = [(t, a) for t, a in self.asked if t > now - self.settings.stabilization_s]
        self.asked.append((now, now_asked))
        out = {}
        for d, g in self.groups.items():
            want = max(a[d] for _, a in self.asked)
            have = self.scaled_to.get(d, want)
            # within the autoscaler's tolerance of where it is, it stays
            out[d] = have if abs(want - have) <= TOLERANCE * have else want
        self.scaled_to = out
        return out

    def record(self, now: float, desired: Mapping[str, int], billed: Mapping[str, int]) -> None:
        t = self.timeline
        t.times.append(now)
        for d in self.groups:
            t.desired.setdefault(d, []).append(desired.get(d, 0))
            t.billed.setdefault(d, []).append(billed.get(d, 0))
        t.cost_per_hour.append(self.bill(now, billed))

    def bill(self, now: float, billed: Mapping[str, int]) -> float:
        """What is billed from `now` on (replicas per deployment); returns its cost per hour."""
        cost = sum(billed.get(d, 0) * g.cost for d, g in self.groups.items())
        bills = self.timeline.bills
        if bills and bills[-1][0] == now:
            bills[-1] = (now, cost)
        elif not bills or bills[-1][1] != cost:
            bills.append((now, cost))
        return cost


class FleetScaler:
    """Applies each re-plan to the simulated replicas: a replica asked for serves `provision_s` later
    (`schedule(t, index)` wakes `provisioned`); one no longer needed stops taking requests and leaves
    when its last one ends (`drained`), or is cancelled while still starting; a draining one asked for
    again is kept. `reconfigure()` hands the new pod list to the gateways."""

    def __init__(self, optimizer: Optimizer, replicas: list[Replica], spans: dict[int, list[list[float]]],
                 clock: Callable[[], float], schedule: Callable[[float, int], None],
                 reconfigure: Callable[[], None]) -> None:
        self.optimizer = optimizer
        self.replicas = replicas
        self.spans = spans  # replica index -> [start, end) spans it served
        self.clock = clock
        self.schedule = schedule
        self.reconfigure = reconfigure
        self.ready_at: dict[int, float] = {}

    def replan(self, t: float) -> None:
        desired = self.optimizer.tick(t)
        changed = False
        for dep, want in desired.items():
            mine = [r for r in self.replicas if r.deployment == dep]
            serving = [r for r in mine if r.alive and r.ready]
            starting = [r for r in mine if r.starting]
            have = len(serving) + len(starting)
            for r in [r for r in mine if r.alive and not r.ready][:max(0, want - have)]:
                r.ready, changed, have = True, True, have + 1
            for r in [r for r in mine if not r.alive and not r.starting][:max(0, want - have)]:
                r.starting, self.ready_at[r.index] = True, t + self.optimizer.settings.provision_s
                self.schedule(self.ready_at[r.index], r.index)
                have += 1
            for r in [*reversed(starting), *reversed(serving)][:max(0, have - want)]:
                if r.starting:
                    r.starting = False
                else:
                    r.ready, changed = False, True
                    if not r.open:
                        self._stop(r)
        if changed:
            self.reconfigure()
        self.optimizer.record(t, desired, self.billed())

    def billed(self) -> dict[str, int]:
        """Replicas billed per deployment: serving, draining or starting."""
        return {d: sum(1 for r in self.replicas if r.deployment == d and (r.alive or r.starting))
                for d in self.optimizer.groups}

    def provisioned(self, r: Replica) -> None:
        if r.starting and self.ready_at.get(r.index) == self.clock():  # else cancelled or re-started
            r.starting, r.alive, r.ready = False, True, True
            r.scheduled = -1.0  # an idle engine: its next request starts a step (a lost one's is stale)
            self.spans[r.index].append([self.clock(), math.inf])
            self.reconfigure()

    def drained(self, r: Replica) -> None:
        if r.alive and not r.ready and not r.open:
            self._stop(r)
            self.reconfigure()
            self.optimizer.bill(self.clock(), self.billed())

    def _stop(self, r: Replica) -> None:
        r.alive, r.ready = False, True
        self.spans[r.index][-1][1] = self.clock()


def direction_changes(values: list[int], times: list[float], span_s: float) -> int:
    """The most times a series turned from up to down (or back) within any `span_s` of time."""
    turns: list[float] = []
    last = 0
    for prev, cur, t in zip(values, values[1:], times[1:]):
        step = (cur > prev) - (cur < prev)
        if step and last and step != last:
            turns.append(t)
        last = step or last
    return max((sum(1 for u in turns if t <= u < t + span_s) for t in turns), default=0)


def turns_while_loaded(timeline: Timeline, duration_s: float) -> dict[str, int]:
    """Direction changes of each deployment's asked count in any 5 minutes while the scenario sends
    requests (start-up included, which is the loop's doing). Not after `duration_s`: arrivals have
    stopped, the trace windows hold only the slowest requests' completions, and a plan read from them
    is the drain's, not a load's."""
    loaded = [k for k, t in enumerate(timeline.times) if t < duration_s]
    times = [timeline.times[k] for k in loaded]
    return {d: direction_changes([v[k] for k in loaded], times, 300.0) for d, v in timeline.desired.items()}


def mean_cost(bills: list[tuple[float, float]], start: float, end: float) -> float:
    """The mean cost per hour over [start, end) of a step function ((time, cost from then on), in time
    order); 0 before its first step."""
    if end <= start:
        return 0.0
    total = 0.0
    for (t, cost), (t_next, _) in zip(bills, [*bills[1:], (math.inf, 0.0)]):
        lo, hi = max(t, start), min(t_next, end)
        if hi > lo:
            total += cost * (hi - lo)
    return total / (end - start)


def summary(timeline: Timeline, warmup_s: float, duration_s: float) -> dict[str, object]:
    measured = [k for k, t in enumerate(timeline.times) if warmup_s <= t < duration_s]
    return {
        "cost_per_hour_mean": mean_cost(timeline.bills, warmup_s, duration_s),
        "cost_per_hour_end": timeline.cost_per_hour[-1] if timeline.cost_per_hour else 0.0,
        "replicas_end": {d: v[-1] for d, v in timeline.billed.items() if v},
        "replicas_range": {d: [min(v[k] for k in measured), max(v[k] for k in measured)]
                           if measured else [0, 0] for d, v in timeline.billed.items()},
        "turns_per_5min": turns_while_loaded(timeline, duration_s),
        "plan_errors": timeline.errors[:5],
        "feedback_end": timeline.factors[-1] if timeline.factors else {},
        "series": {"t": timeline.times, "replicas": timeline.billed, "desired": timeline.desired,
                   "cost_per_hour": timeline.cost_per_hour, "rps": timeline.rps, "factors": timeline.factors},
    }
