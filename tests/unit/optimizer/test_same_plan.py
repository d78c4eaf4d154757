"""The live service (`extproc optimizer`) plans exactly as the fleet simulation's loop does: fed the same
trace windows and profiles, re-plan after re-plan, they reach the same plan and the same feedback factors,
with each deployment's most replicas (the config's max_replicas, the scenario's replicas) bounding both."""

from __future__ import annotations

import json

import pytest

from extproc.fleetsim.autoscale import EPOCH, Optimizer
from extproc.fleetsim.scenario import Autoscale, Group
from extproc.gpu_profiles import ProfileStore, dump_profile, parse_profile
from extproc.optimizer.deployments import Deployment, StaticDeploymentSource
from extproc.optimizer.policy import PlanPolicy
from extproc.optimizer.service import OptimizerService, ServiceSettings
from extproc.tracing import TraceRecorder
from tests.unit.optimizer.test_service import MemoryRedis

MODEL = "m"
SLO = 0.05


def flat(name: str, tput: float, cost: float):
    """A pod of `name` serves `tput` req/s of every shape within a 50 ms TPOT."""
    return parse_profile({"gpu": name, "cost": cost, "tputs": [[tput] * 2] * 2,
                          "indexes": [[16, 1024], [128, 4096]], "e2e": [[1.0] * 2] * 2,
                          "slos": {"percentile": 99, "tpot": SLO}, "created": 1.0})


PROFILES = {"cheap": flat("cheap", 5.0, 1.0), "dear": flat("dear", 5.0, 1.6)}
CAPS = {"cheap": 4, "dear": 20}  # the cheaper type is capped: the rest of the load goes to the dearer


def windows(t: int) -> list[tuple[str, str]]:
    """The gateways' trace window ending at virtual time t: 30 req/s, 60 after 300 s, 90 for the 50 s
    after 340 s (a burst); the cheap type's requests miss the SLO one in ten from 200 s to 450 s (so the
    feedback moves its factor, and the burst strains the fleet). From 580 s the burst's start has left
    the 240 s window: only the windows read before it tell its tail from a level that fell."""
    rec = TraceRecorder()
    rate = 90 if 340 < t <= 390 else 60 if t > 300 else 30
    for k in range(rate * 10):
        dep = "cheap" if k % 2 else "dear"
        slow = dep == "cheap" and 200 < t <= 450 and k % 10 == 1
        rec.arrived(MODEL, EPOCH + t - 5)
        rec.completed(MODEL, 200, 50, EPOCH + t - 5, dep, 2 * SLO if slow else SLO / 2)
    return rec.due(EPOCH + t)


@pytest.mark.parametrize("policy", [PlanPolicy(), PlanPolicy(headroom=1.0, add_cost=0.5, feedback_gain=8.0)])
async def test_the_service_and_the_loop_plan_the_same(policy: PlanPolicy) -> None:
    auto = Autoscale(provision_s=policy.provision_s, interval_s=10, window_s=240, policy=policy)
    groups = {d: Group("A100", CAPS[d], d, initial=2, min_replicas=1, cost=PROFILES[d].cost) for d in CAPS}
    loop = Optimizer(MODEL, groups, PROFILES, auto, lambda: 0.0)

    redis = MemoryRedis()
    store = ProfileStore()
    for d, p in PROFILES.items():
        redis.data[f"aibrix:profile_{MODEL}_{d}"] = json.dumps(dump_profile(p))
    source = StaticDeploymentSource([Deployment("default", d, MODEL, min_replicas=1, replicas=2,
                                                max_replicas=CAPS[d]) for d in CAPS])
    service = OptimizerService(source, store, redis, ServiceSettings(interval=10, window_seconds=240,
                                                                     policy=policy), clock=lambda: EPOCH)
    plans, cheap_factors = [], []
    for t in range(10, 610, 10):
        for key, value in windows(t):
            loop.redis[key] = value
            redis.data[key] = value
        loop.tick(float(t))
        await service.tick(EPOCH + t)
        state = service.fleet.models[MODEL]
        theirs = {k.split("/")[1]: n for k, n in state.plan.replicas.items()} if state.plan else None
        ours = dict(loop.state.plan.replicas) if loop.state.plan else None
        assert theirs == ours, t
        assert {k.split("/")[1]: f for k, f in state.feedback.factors.items()} == loop.state.feedback.factors
        plans.append(ours)
        cheap_factors.append(loop.state.feedback.factor("cheap"))
    # what makes the comparison worth something: the cap bound the plan, and the feedback moved
    assert any(p and p["cheap"] == CAPS["cheap"] and p["dear"] > 0 for p in plans)
    assert min(cheap_factors) < 1.0
    assert len({tuple(sorted(p.items())) for p in plans if p}) >= 3


async def test_without_its_cap_the_service_would_plan_another_fleet() -> None:
    """The cap is what the service used to lack: the same traces plan more of the cheap type without it."""
    redis = MemoryRedis()
    for d, p in PROFILES.items():
        redis.data[f"aibrix:profile_{MODEL}_{d}"] = json.dumps(dump_profile(p))
    for key, value in windows(400):
        redis.data[key] = value
    counts = {}
    for cap in (CAPS["cheap"], None):
        source = StaticDeploymentSource([Deployment("default", "cheap", MODEL, max_replicas=cap),
                                         Deployment("default", "dear", MODEL)])
        service = OptimizerService(source, ProfileStore(), redis, ServiceSettings(), clock=lambda: EPOCH)
        await service.tick(EPOCH + 400)
        counts[cap] = service.fleet.models[MODEL].plan.replicas["default/cheap"]
    assert counts[CAPS["cheap"]] == CAPS["cheap"] < counts[None]
