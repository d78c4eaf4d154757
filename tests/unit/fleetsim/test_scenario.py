from __future__ import annotations

import random

import pytest

from extproc.fleetsim.arrivals import generate
from extproc.fleetsim.lengths import LogNormal, Uniform, parse_lengths
from extproc.fleetsim.scenario import builtin_names, load, parse
from tests.unit.fleetsim.conftest import CHAT, small


def test_every_builtin_scenario_loads():
    names = builtin_names()
    assert {"production-results", "worked-example", "input-heavy", "slo-a10-l20", "gpu-loss",
            "burst"} <= set(names)
    for name in names:
        sc = load(name)
        assert sc.total_rate > 0 and sc.groups and sc.warmup_s < sc.duration_s


def test_production_results_pairs_two_gpu_types():
    sc = load("production-results")
    assert len({g.gpu for g in sc.groups}) == 2
    assert sc.total_rate == pytest.approx(200)


@pytest.mark.parametrize("raw, message", [
    ({"fleet": [], "streams": [CHAT]}, "fleet"),
    ({"fleet": [{"gpu": "A100"}], "streams": []}, "streams"),
    ({"fleet": [{"gpu": "NOPE"}], "streams": [CHAT]}, "NOPE"),
    ({"fleet": [{"gpu": "A100"}], "streams": [CHAT], "bogus": 1}, "bogus"),
    ({"fleet": [{"gpu": "A100"}], "streams": [CHAT], "events": [{"kind": "lose-replicas", "at": 1,
                                                                  "gpu": "L20", "fraction": 0.5}]}, "L20"),
    ({"fleet": [{"gpu": "A100"}], "streams": [CHAT], "profiling": {"max_budget": 0}}, "profiling.max_budget"),
    ({"fleet": [{"gpu": "A100"}], "streams": [CHAT], "profiling": {"budget": 8}}, "profiling"),
    ({"fleet": [{"gpu": "A100"}], "streams": [CHAT], "profiling": {"budget_margin": 0.9}},
     "profiling.budget_margin"),
    # a misspelt target is refused, not a run with no SLO
    ({"fleet": [{"gpu": "A100"}], "streams": [CHAT], "slo": {"tpat": 0.001}}, "'tpat'"),
    ({"fleet": [{"gpu": "A100"}], "streams": [CHAT], "slo": {"e2e_s": 0}}, "e2e_s"),
    ({"fleet": [{"gpu": "A100"}], "streams": [CHAT], "slo": {"tpat_s": "fast"}}, "tpat_s"),
])
def test_bad_scenarios_are_refused(raw, message):
    with pytest.raises((ValueError, KeyError), match=message):
        parse(raw)


def test_every_gen_profile_slo_metric_is_a_scenario_target():
    sc = small(slo={"tpot_s": 0.05, "ttft_s": 1.0, "e2e_s": 8.0, "tpat_s": 0.004})
    assert sc.slo.targets == {"tpot": 0.05, "ttft": 1.0, "e2e": 8.0, "tpat": 0.004}
    # 6 s over 2,000 prompt + 16 output tokens: 3 ms a token, within 4 ms; 9 s misses the 8 s E2E
    assert sc.slo.met(0.5, 0.04, 6.0, 6.0 / 2016) and not sc.slo.met(0.5, 0.04, 9.0, 9.0 / 2016)
    assert not small(slo={"tpat_s": 0.002}).slo.met(0.5, 0.04, 6.0, 6.0 / 2016)


def test_lengths_stay_in_bounds_and_centre_on_the_mean():
    rng = random.Random(1)
    d = parse_lengths({"dist": "lognormal", "mean": 250, "sigma": 0.5, "min": 10, "max": 5000}, "x")
    assert isinstance(d, LogNormal)
    xs = [d.sample(rng) for _ in range(20000)]
    assert min(xs) >= 10 and max(xs) <= 5000
    assert sum(xs) / len(xs) == pytest.approx(250, rel=0.03)
    u = parse_lengths({"dist": "uniform", "low": 32, "high": 64}, "x")
    assert isinstance(u, Uniform) and {u.sample(rng) for _ in range(2000)} == set(range(32, 65))


def test_arrivals_are_seeded_and_poisson_rate():
    sc = small(duration_s=200)
    a, b, c = generate(sc, 7), generate(sc, 7), generate(sc, 8)
    assert a == b and a != c
    assert len(a) / 200 == pytest.approx(20, rel=0.1)
    assert all(x.time <= y.time for x, y in zip(a, a[1:]))


def test_a_rate_event_doubles_arrivals_only_inside_its_window():
    sc = small(duration_s=300, events=[{"kind": "rate", "at": 100, "until": 200, "factor": 2.0}])
    a = generate(sc, 3)
    inside = sum(1 for x in a if 100 <= x.time < 200)
    before = sum(1 for x in a if x.time < 100)
    assert inside / before == pytest.approx(2.0, rel=0.15)


def test_gateways_split_arrivals():
    a = generate(small(duration_s=100), 1, gateways=4)
    counts = [sum(1 for x in a if x.gateway == g) for g in range(4)]
    assert min(counts) > 0.2 * len(a)


def test_autoscale_takes_the_optimizers_policy_keys_and_refuses_bad_ones_by_name():
    from extproc.optimizer.config_errors import ConfigError
    from extproc.optimizer.policy import PlanPolicy

    base = {"fleet": [{"gpu": "A100", "replicas": 2}], "streams": [{"rate": 1, "prompt": 100, "output": 10}]}
    sc = parse({**base, "autoscale": {"provision_s": 30, "window_s": 120, "headroom": 0.25,
                                      "feedback_settle_s": 45, "stabilization_s": 100}})
    assert sc.autoscale is not None and sc.autoscale.stabilization_s == 100.0
    resolved = sc.autoscale.resolved()
    assert resolved == PlanPolicy(headroom=0.25, add_cost=0.25, provision_s=30.0, feedback_span_s=60.0,
                                  feedback_settle_s=45.0)
    for bad, key in (({"headrom": 1}, "did you mean headroom"), ({"interval_s": 0}, "autoscale.interval_s"),
                     ({"add_cost": -1}, "autoscale.add_cost"), ({"window_s": 5}, "autoscale.window_s")):
        with pytest.raises(ConfigError, match=key):
            parse({**base, "autoscale": bad})


def test_the_virtual_profiles_ladder_climbs_when_the_scenario_says_so():
    from extproc.fleetsim.slo_profiles import FLEET_PLAN, profile_plan

    plain = parse({"fleet": [{"gpu": "A100"}], "streams": [CHAT]})
    climbing = parse({"fleet": [{"gpu": "A100"}], "streams": [CHAT], "profiling": {"max_budget": 256}})
    assert profile_plan(plain) == FLEET_PLAN and FLEET_PLAN.max_budget is None
    assert profile_plan(climbing).max_budget == 256
    assert plain.profile_budget_margin == 2.0 and climbing.profile_budget_margin == 2.0
    margin = parse({"fleet": [{"gpu": "A100"}], "streams": [CHAT], "profiling": {"budget_margin": 1.5}})
    assert margin.profile_budget_margin == 1.5
