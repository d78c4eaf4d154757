"""One re-plan, as both the live service (`extproc optimizer`) and the fleet simulation's loop run it:
trace windows -> rates per cell -> the feedback's correction of the profiles -> the MILP, with the
policy's constants (optimizer/policy.py) and each deployment's most replicas (`Deployment.max_replicas`).
`plan_model` is that step for one model's state; the two callers differ only in where the windows come
from (Redis, or the simulation's dict) and what scales the deployments afterwards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

from extproc.gpu_profiles import GpuProfile
from extproc.optimizer.feedback import Feedback, strained
from extproc.optimizer.monitor import ModelState
from extproc.optimizer.policy import HEADROOM, PlanPolicy
from extproc.optimizer.solver import ADD_COST, REMOVE_COST, Demand, Plan, PlanError, as_routed, solve
from extproc.optimizer.workload import Burst, TraceWindow, read_workload


@dataclass(frozen=True, slots=True)
class Replan:
    demands: list[Demand]
    plan: Plan | None
    error: str | None  # no plan, or cells left out of it
    burst: Burst | None = None  # a burst in the newest windows, and whether the plan was made for it
    held: dict[str, int] | None = None  # what the plan asked for when the fleet running was kept (_held)


@dataclass(frozen=True, slots=True)
class PlanSettings:
    headroom: float = HEADROOM  # β of the solver's square-root staffing
    limits: Mapping[str, int] | None = None  # deployment -> most replicas its autoscaler runs
    time_limit: float = 30.0
    add_cost: float = ADD_COST  # of a replica's hourly cost, per replica added / removed
    remove_cost: float = REMOVE_COST

    @classmethod
    def of(cls, policy: PlanPolicy, limits: Mapping[str, int] | None = None) -> PlanSettings:
        """From a resolved policy (`PlanPolicy.resolved`)."""
        assert policy.add_cost is not None, "resolve the policy for its schedule first"
        return cls(policy.headroom, limits, add_cost=policy.add_cost, remove_cost=policy.remove_cost)


def limits_of(state: ModelState) -> dict[str, int]:
    """The most replicas each deployment may run (config, label), keyed as the plan keys them."""
    return {k: d.max_replicas for k, d in state.deployments.items() if d.max_replicas is not None}


def plan_model(state: ModelState, windows: Sequence[TraceWindow], now: float, window_s: float,
               profiles: Sequence[GpuProfile], policy: PlanPolicy) -> Replan:
    """One model's re-plan from its trace windows; blocking (the service runs it in a worker thread).
    Updates the state's feedback; the caller applies the result (`ModelState.apply`)."""
    running = {k: state.reported(k) for k in state.deployments}  # near-ties keep these
    return replan(windows, now, window_s, profiles, running, state.feedback,
                  PlanSettings.of(policy, limits_of(state)), state.grew_at)


def replan(windows: Sequence[TraceWindow], now: float, window_s: float, profiles: Sequence[GpuProfile],
           current: Mapping[str, int], feedback: Feedback | None,
           settings: PlanSettings = PlanSettings(), grew: Mapping[str, float] | None = None) -> Replan:
    """`current`: the replicas each deployment reports now (near-ties keep them); `grew`: when each
    last rose (the feedback waits for that deployment's added replicas to serve)."""
    # a burst the fleet absorbs unstrained is left to the router's margin (read_workload)
    judge = None if feedback is None else partial(strained, profiles=profiles, target=feedback.target)
    windows = list(windows)
    workload = read_workload(windows, now, window_s, judge)
    if feedback is not None:
        feedback.update(windows, now, profiles, grew)
        profiles = feedback.apply(profiles)
    out = plan_demands(workload.demands, profiles, current, settings)
    if feedback is not None and out.plan is not None and _only_adds(out.plan, current):
        span = [w for w in windows if now - feedback.span_s < w.end <= now + 1e-9]
        if span and not strained(span, profiles, feedback.recover):
            out = _held(out, profiles, current, settings)
    return replace(out, burst=workload.burst)


# The share of the headroom a fleet with room keeps while an add is held: the room it has shown stands
# in for the rest, not for all of it (without any, a fleet held at its load met a burst with nothing spare).
HELD_HEADROOM = 0.5


def _only_adds(plan: Plan, current: Mapping[str, int]) -> bool:
    """The plan adds replicas and removes none (held, a swap would keep what it replaces)."""
    moves = [n - current.get(g, 0) for g, n in plan.replicas.items()]
    return any(m > 0 for m in moves) and not any(m < 0 for m in moves)


def _held(out: Replan, profiles: Sequence[GpuProfile], current: Mapping[str, int],
          settings: PlanSettings) -> Replan:
    """The fleet running now in place of a plan that only adds to it, when that fleet has shown room
    (the caller: nothing refused and the feedback's recovery bar, 99.5 % within the SLO, over its span)
    and carries the load with HELD_HEADROOM of the headroom. Else the plan as it is.

    The headroom is square-root staffing on rates read from a 240 s window, and a few long requests
    entering or leaving that window move a type's load by a tenth of a replica. Where the load with
    its headroom sits near a whole replica, re-plans now and then ask for one more, and the autoscaler
    keeps every count it is asked for through its scale-down stabilization (300 s), so each ask bills a
    replica for five minutes. A fleet that keeps 99.5 % of its requests within the SLO has shown part of
    the room the headroom buys; one that falls below it, refuses a request, or cannot carry the load
    gets the plan's adds at once (docs/optimizer.md, "An add the running fleet has room for").

    The load is counted as the router routes it (`as_routed`: each trace bucket spread over the cells
    its token range covers), not whole at its centre as the plan counts it, which one bucket in five
    puts in the larger cell: the plan keeps that margin for a long prefill stalling the decodes batched
    with it, which one-shape profiles do not see; the room the fleet has shown is that stall measured."""
    assert out.plan is not None
    kept = {g: current.get(g, 0) for g in out.plan.replicas}
    try:
        within = solve(profiles, as_routed(profiles, out.demands), settings.time_limit,
                       skip_unservable=True, headroom=settings.headroom * HELD_HEADROOM, limits=kept)
    except PlanError:  # the running fleet cannot carry it
        return out
    # The cells no type serves depend on the shapes alone, not on any count: the plan's say which.
    cost = round(sum(p.cost * kept[p.gpu] for p in profiles), 9)
    plan = replace(within, replicas=kept, cost=cost, unserved=out.plan.unserved, skipped=out.plan.skipped)
    return replace(out, plan=plan, held=dict(out.plan.replicas))


def plan_demands(demands: list[Demand], profiles: Sequence[GpuProfile], current: Mapping[str, int],
                 settings: PlanSettings = PlanSettings()) -> Replan:
    if not demands:
        return Replan([], None, None)
    try:
        plan = solve(profiles, demands, settings.time_limit, skip_unservable=True, current=current,
                     headroom=settings.headroom, limits=settings.limits, add_cost=settings.add_cost,
                     remove_cost=settings.remove_cost)
    except PlanError as e:
        return Replan(demands, None, str(e))
    return Replan(demands, plan, plan.unserved or None)
