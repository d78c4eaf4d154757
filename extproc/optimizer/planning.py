"""One re-plan, as both the live service (`extproc optimizer`) and the fleet simulation's loop run it:
trace windows -> rates per cell -> the feedback's correction of the profiles -> the MILP."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.gpu_profiles import GpuProfile
from extproc.optimizer.feedback import Feedback
from extproc.optimizer.solver import Demand, Plan, PlanError, solve
from extproc.optimizer.workload import TraceWindow, trace_rates

HEADROOM = 0.5  # docs/optimizer.md, "Headroom": the figure the fleet simulation's runs support


@dataclass(frozen=True, slots=True)
class Replan:
    demands: list[Demand]
    plan: Plan | None
    error: str | None  # no plan, or cells left out of it


@dataclass(frozen=True, slots=True)
class PlanSettings:
    headroom: float = HEADROOM  # β of the solver's square-root staffing
    limits: Mapping[str, int] | None = None  # deployment -> most replicas its autoscaler runs
    time_limit: float = 30.0


def replan(windows: Sequence[TraceWindow], now: float, window_s: float, profiles: Sequence[GpuProfile],
           current: Mapping[str, int], feedback: Feedback | None,
           settings: PlanSettings = PlanSettings(), fleet_changed: float = float("-inf")) -> Replan:
    """`current`: the replicas each deployment reports now (near-ties keep them); `fleet_changed`: when
    they last changed (the feedback waits for the fleet to settle). Blocking: the service runs it in a
    worker thread."""
    demands = trace_rates(windows, now, window_s)
    if feedback is not None:
        feedback.update(windows, now, profiles, fleet_changed)
        profiles = feedback.apply(profiles)
    return plan_demands(demands, profiles, current, settings)


def plan_demands(demands: list[Demand], profiles: Sequence[GpuProfile], current: Mapping[str, int],
                 settings: PlanSettings = PlanSettings()) -> Replan:
    if not demands:
        return Replan([], None, None)
    try:
        plan = solve(profiles, demands, settings.time_limit, skip_unservable=True, current=current,
                     headroom=settings.headroom, limits=settings.limits)
    except PlanError as e:
        return Replan(demands, None, str(e))
    return Replan(demands, plan, plan.unserved or None)
