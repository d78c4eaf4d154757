"""The optimizer's acceptance check: one command per scenario and seed, the loop against the verified
cheapest fixed fleet, and the bar it is held to."""

from __future__ import annotations

import json

import pytest

from extproc.cli import main
from extproc.fleetsim.acceptance import HEADER, Verdict, accept, with_autoscale
from extproc.gpu_profiles import dump_profile
from tests.unit.fleetsim.conftest import small
from tests.unit.fleetsim.test_autoscale import PROFILES


def verdict(**over) -> Verdict:
    base = dict(scenario="s", strategy="slo", seed=0, loop_cost=10.5, cheapest_cost=10.0,
                cheapest={"a": 2, "b": 0}, attainment=0.995, rejected=0, turns={"a": 1, "b": 0},
                fleets_run=7)
    return Verdict(**{**base, **over})


@pytest.mark.parametrize(("over", "passed"), [
    ({}, True),
    ({"loop_cost": 11.01}, False),            # above 1.1x
    ({"attainment": 0.9899}, False),
    ({"rejected": 1}, False),
    ({"turns": {"a": 2, "b": 0}}, False),
    ({"cheapest_cost": None, "cheapest": None}, False),  # no fixed fleet keeps the SLO: nothing to hold to
])
def test_the_bar(over: dict, passed: bool) -> None:
    v = verdict(**over)
    assert v.passed is passed
    assert v.row().count("|") == HEADER.splitlines()[0].count("|")
    assert ("pass" if passed else "**fail**") in v.row()


def test_a_row_held_to_the_fleet_for_every_seed_says_so() -> None:
    assert "(2 a; on every one of seeds 1, 0, 2)" in verdict(yardstick_seeds=(1, 0, 2)).row()
    assert "(2 a) |" in verdict().row()


def test_acceptance_seeds_reach_the_yardstick(monkeypatch: pytest.MonkeyPatch) -> None:
    import extproc.fleetsim.acceptance as acceptance

    seen = []

    def fake(scenario, seed, strategy, jobs, profiles, settings, yardstick_seeds=()):  # noqa: ANN001
        seen.append((seed, tuple(yardstick_seeds)))
        raise ValueError("stop here")

    monkeypatch.setattr(acceptance, "accept", fake)
    main(["fleet-sim", "--scenario", "rag-a40-a100", "--acceptance", "--seed", "1", "--seeds", "0,1,2"])
    main(["fleet-sim", "--scenario", "rag-a40-a100", "--acceptance", "--seed", "1"])
    assert seen == [(1, (0, 1, 2)), (1, ())]


def test_one_scenario_and_seed_end_to_end(tmp_path) -> None:
    sc = small(duration_s=60, warmup_s=20, slo={"tpot_s": 0.05},
               fleet=[{"gpu": "A100", "replicas": 3, "initial": 1, "min_replicas": 1, "cost": 2.0,
                       "name": "fast"},
                      {"gpu": "L20", "replicas": 3, "initial": 1, "min_replicas": 1, "cost": 3.0,
                       "name": "slow"}],
               autoscale={"provision_s": 10, "interval_s": 10, "window_s": 30})
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for name, p in PROFILES.items():
        (profiles / f"{name}.json").write_text(json.dumps(dump_profile(p)))
    v = accept(sc, 0, "least-request", jobs=1, profiles_dir=str(profiles))
    assert v.cheapest is not None and v.cheapest_cost == 2.0 * v.cheapest["fast"] + 3.0 * v.cheapest["slow"]
    assert v.loop_cost > 0 and v.ratio == pytest.approx(v.loop_cost / v.cheapest_cost)
    assert set(v.turns) == {"fast", "slow"} and v.fleets_run >= 1
    both = accept(sc, 0, "least-request", jobs=1, profiles_dir=str(profiles), yardstick_seeds=(0, 1))
    assert both.yardstick_seeds == (0, 1) and both.cheapest_cost is not None
    assert both.cheapest_cost >= v.cheapest_cost  # a fleet that holds on seed 1 too costs no less
    with pytest.raises(ValueError, match="no autoscale"):
        accept(small(), 0)


def test_the_scenarios_it_covers_and_the_command(capsys) -> None:
    names = with_autoscale()
    assert {"slo-optimizer", "rag-a40-a100", "single-4090-h100pcie", "three-4090-h100pcie-h200",
            "dominated-v100-h100pcie"} <= set(names)
    assert "burst" not in names  # no autoscale section
    assert main(["fleet-sim", "--scenario", "burst", "--acceptance"]) == 2
    assert "no autoscale section" in capsys.readouterr().err
