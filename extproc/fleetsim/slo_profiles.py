"""SLO profiles for the fleet simulation: `extproc benchmark` and `extproc gen-profile` run against the
engine model in virtual time (profiling/virtual.py), as an operator would run them on one replica of each
GPU type.

The same code as the user's path, not a copy of it: the sweep's grid, Poisson schedule, measurement (TPOT
per request, throughput as completions over the cell's whole run) and overload rule, then gen-profile's
selection, then `benchmark --admitted` with its default budget factors and gen-profile's `--admitted`
rule. Only the grid is narrower than the command's default (FLEET_PLAN, the flags `flags()` prints),
to keep a simulation's start in seconds. The optimizer never reads the engine
model itself. Cached per (GPU, model, SLO, engine settings).

`fleet-sim --profiles DIR` replaces these per deployment, for the SLO router and the plan alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from extproc.fleetsim.saturation import build_engine
from extproc.fleetsim.scenario import Scenario
from extproc.gpu_profiles import GpuProfile
from extproc.profiling.plan import LoadPlan
from extproc.profiling.selection import SLOs
from extproc.profiling.virtual import measure_profile
from extproc.slo.state import SloState, learned

# What `extproc benchmark --input-lens 128,512,2048,4096,6144,8192 --output-lens 16,64,256,1024` runs (the
# default rates, requests per cell, seed and budget factors): the shapes the scenarios send, long prompts
# included, fitted to the model's context as the command fits its default grid (8192 -> 7168 on 8K).
FLEET_PLAN = LoadPlan(input_lens=(128, 512, 2048, 4096, 6144, 8192), output_lens=(16, 64, 256, 1024))


def scenario_slos(scenario: Scenario) -> SLOs:
    return SLOs(percentile=99, targets=scenario.slo.targets)


def virtual_profile(scenario: Scenario, gpu: str, deployment: str,
                    plan: LoadPlan | None = None) -> GpuProfile:
    """The GPU type's profile (AIBrix's format) for the scenario's model and SLO, named `deployment`."""
    plan = plan or profile_plan(scenario)
    slos = scenario_slos(scenario)
    margin = scenario.profile_budget_margin
    key = (gpu, scenario.model, tuple(sorted(scenario.engine.items())), tuple(sorted(slos.targets.items())),
           plan, margin)
    if key not in _CACHE:
        fitted = plan.fit(build_engine(scenario, gpu).max_model_len)  # as `extproc benchmark` fits its own
        _CACHE[key] = measure_profile(lambda: build_engine(scenario, gpu), fitted, scenario.model, gpu, 1.0,
                                      slos, budget_margin=margin)
    return replace(_CACHE[key], gpu=deployment)


def profile_plan(scenario: Scenario) -> LoadPlan:
    """FLEET_PLAN with the scenario's `profiling.max_budget` (`--profile-max-budget`): the ladder climbs."""
    return replace(FLEET_PLAN, max_budget=scenario.profile_max_budget)


_CACHE: dict[tuple[object, ...], GpuProfile] = {}


def load_slo_profiles(scenario: Scenario, gateway, replicas,  # noqa: ANN001
                      given: Mapping[str, GpuProfile] | None = None) -> SloState:
    """Give a simulated gateway's SLO state one profile per deployment (GPU type) of the fleet: the
    `given` one (`--profiles`) where there is one, else measured on the engine model."""
    state: SloState = learned(gateway.router.state.store)  # type: ignore[assignment]  (built at config load)
    gpus = {r.deployment: r.gpu for r in replicas}
    given = given or {}
    state.set_profiles(scenario.model, {d: given.get(d) or virtual_profile(scenario, gpu, d)
                                        for d, gpu in gpus.items()})
    return state
