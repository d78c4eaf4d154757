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
from extproc.optimizer.solver import ADD_COST, REMOVE_COST, Demand, Plan, PlanError, solve
from extproc.optimizer.workload import Burst, TraceWindow, read_workload


@dataclass(frozen=True, slots=True)
class Replan:
    demands: list[Demand]
    plan: Plan | None
    error: str | None  # no plan, or cells left out of it
    burst: Burst | None = None  # a burst in the newest windows, and whether the plan was made for it


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
    workload = read_workload(windows, now, window_s, judge)
    if feedback is not None:
        feedback.update(windows, now, profiles, grew)
        profiles = feedback.apply(profiles)
    return replace(plan_demands(workload.demands, profiles, current, settings), burst=workload.burst)


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
