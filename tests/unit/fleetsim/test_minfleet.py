"""`fleet-sim --find-min-fleet`: the cheapest fixed fleet that keeps the SLO, deterministic, and minimal
(one replica fewer of any type in it misses)."""

from __future__ import annotations

import pytest

from extproc.fleetsim.minfleet import _trial, fewest, find_min_fleet, fixed, markdown, only_deployment
from tests.unit.fleetsim.conftest import small

CHAT = {"name": "chat", "rate": 60, "prompt": {"mean": 400, "sigma": 0.8, "max": 3000},
        "output": {"mean": 120, "sigma": 0.8, "max": 600}}


def scenario():
    """A cheap slow type beside a fast one; neither alone is the cheapest answer."""
    return small(duration_s=30, warmup_s=5, slo={"tpot_s": 0.05}, streams=[CHAT],
                 fleet=[{"gpu": "L20", "replicas": 10, "name": "slow", "cost": 0.8},
                        {"gpu": "A100", "replicas": 4, "name": "fast", "cost": 2.2}])


def test_the_answer_keeps_the_slo_and_one_fewer_of_any_type_does_not() -> None:
    sc = scenario()
    found = find_min_fleet(sc, "load-balance", jobs=2)
    assert found.counts is not None and found.attainment is not None and found.attainment >= 0.99
    fast_alone, cost_alone = found.alone["fast"]
    assert fast_alone is not None and cost_alone == fast_alone * 2.2
    assert found.cost is not None and found.cost <= cost_alone
    again = _trial(sc, "load-balance", 0, found.counts, found.cost)  # an independent run of the answer
    assert again.ok
    for name, n in found.counts.items():
        if n:
            fewer = {**found.counts, name: n - 1}
            assert not _trial(sc, "load-balance", 0, fewer, 0.0).ok, fewer
    # nothing cheaper was seen to pass
    assert all(t.cost >= found.cost for t in found.tested if t.ok)
    assert "**" in markdown(found) and "fast alone" in markdown(found)


def test_deterministic_whatever_the_jobs() -> None:
    sc = scenario()
    one = find_min_fleet(sc, "load-balance", jobs=1)
    two = find_min_fleet(sc, "load-balance", jobs=2)
    assert (one.counts, one.cost, one.alone) == (two.counts, two.cost, two.alone)


def test_fixed_fleet_drops_zero_deployments_and_autoscaling() -> None:
    sc = fixed(scenario(), {"slow": 0, "fast": 3})
    assert [(g.name, g.replicas) for g in sc.groups] == [("fast", 3)] and sc.autoscale is None


def test_strategy_at_a_deployment_searches_that_type_alone() -> None:
    sc, strategy = only_deployment(scenario(), "slo@fast")
    assert strategy == "slo" and [g.name for g in sc.groups] == ["fast"]
    assert only_deployment(scenario(), "slo") == (scenario(), "slo")
    with pytest.raises(ValueError, match="'l20'"):
        find_min_fleet(scenario(), "slo@l20")  # refused before any run


def test_fewest_bisects_a_monotone_predicate() -> None:
    calls: list[int] = []

    def ok(n: int) -> bool:
        calls.append(n)
        return n >= 7

    assert fewest(ok, 40) == 7 and len(calls) <= 7
    assert fewest(lambda n: False, 10) is None
