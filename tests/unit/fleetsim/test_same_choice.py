"""The simulated gateway is the live one: built from a config file by the live path and by the fleet
simulation, fed the same snapshots, it picks the same pods for every strategy."""

from __future__ import annotations

import random

import pytest
import yaml

from extproc.config import load
from extproc.fleetsim.fleet import build_replicas
from extproc.fleetsim.gateways import build_gateways, gateway_config
from extproc.fleetsim.loop import Clock
from extproc.openai import Request
from extproc.routing import strategy_names
from extproc.server.gateway import Gateway
from extproc.telemetry.engine_metrics import EngineSample
from extproc.vocabulary import RequestEnd


@pytest.mark.parametrize("strategy", strategy_names())
def test_live_and_simulated_gateways_pick_the_same_pods(tmp_path, scenario, strategy):
    seed = 11
    replicas = build_replicas(scenario)
    sim_config = gateway_config(scenario.model, replicas, seed)
    # The live gateway reads the config file a user would write for the same pods.
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"models": {scenario.model: {"pods": [r.config_entry() for r in replicas]}},
                                    "routing": {"seed": seed}}))
    clock = Clock()
    live = Gateway(load(path, env={}), clock=clock)
    sim = build_gateways(1, sim_config, clock)[0]
    rng = random.Random(5)
    samples: dict = {}
    live.accounting.samples = lambda key, now: samples.get(key)
    sim.samples.latest = samples  # the same scrape for both
    pods = live.pool.all_pods()
    live_profile, sim_profile = live.profile(strategy), sim.gateway.profile(strategy)
    open_: list[tuple[str, str]] = []
    for i in range(300):
        clock.now = i * 0.05
        if i % 20 == 0:  # a scrape: same engine metrics for both
            samples.clear()
            for p in pods:
                samples[p.key] = EngineSample(running=rng.randint(0, 40), waiting=rng.randint(0, 3),
                                              kv_usage=rng.random(), cpu_kv_usage=None)
        if i % 20 == 10:
            live.refresh()
            sim.gateway.refresh()
        request = Request(scenario.model, "/v1/chat/completions", stream=True,
                          prompt_tokens=rng.randint(10, 3000))
        a = live.route(request, live_profile, f"r{i}")
        b = sim.gateway.route(request, sim_profile, f"r{i}")
        assert a is not None and b is not None
        assert a.pod.name == b.pod.name, f"request {i}: live {a.pod.name}, simulated {b.pod.name}"
        open_.append((a.key, b.key))
        if open_ and rng.random() < 0.6:  # an access-log record arrives for both
            ka, kb = open_.pop(rng.randrange(len(open_)))
            tokens = rng.randint(1, 500)
            live.complete(ka, RequestEnd(200, output_tokens=tokens))
            sim.gateway.complete(kb, RequestEnd(200, output_tokens=tokens))
