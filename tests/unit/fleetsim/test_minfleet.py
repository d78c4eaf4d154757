"""`fleet-sim --find-min-fleet`: the cheapest fixed fleet that keeps the SLO, found without assuming that
attainment grows with replicas (checked against brute force where it does not), the same for any --jobs,
and each fleet cheaper than the answer run and seen to miss."""

from __future__ import annotations

import itertools
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from extproc.cli import main
from extproc.fleetsim.minfleet import (
    RunSettings,
    SimulatedFleets,
    _trial,
    cheapest,
    fewest,
    find_min_fleet,
    fixed,
    markdown,
    only_deployment,
)
from tests.unit.fleetsim.conftest import small

CHAT = {"name": "chat", "rate": 60, "prompt": {"mean": 400, "sigma": 0.8, "max": 3000},
        "output": {"mean": 120, "sigma": 0.8, "max": 600}}


class Synthetic:
    """A judge with no simulation: a fleet passes when its capacity clears the demand, except that fleets
    within `band` of the line pass or miss at random (fixed per fleet): attainment not monotone in
    replicas. Module-level, so a process pool can pickle it."""

    def __init__(self, seed: int, speeds: tuple[float, ...], demand: float, band: float) -> None:
        rng = random.Random(seed)
        self.speeds, self.demand, self.band = speeds, demand, band
        self.coin = {c: rng.random() < 0.5 for c in itertools.product(range(8), repeat=len(speeds))}
        self.calls = 0

    def passes(self, counts: tuple[int, ...]) -> bool:
        capacity = sum(n * s for n, s in zip(counts, self.speeds))
        if abs(capacity - self.demand) <= self.band:
            return self.coin[counts]
        return capacity > self.demand

    def __call__(self, counts: dict[str, int]) -> tuple[bool, float | None]:
        self.calls += 1
        ok = self.passes(tuple(counts.values()))
        return ok, 0.995 if ok else 0.9


def brute_force(judge: Synthetic, costs: list[float], caps: list[int]) -> tuple[int, ...] | None:
    fleets = [c for c in itertools.product(*(range(n + 1) for n in caps)) if any(c)]
    ok = [c for c in fleets if judge.passes(c)]
    return min(ok, key=lambda c: (round(sum(n * k for n, k in zip(c, costs)), 9), c)) if ok else None


def test_the_search_is_brute_force_where_attainment_is_not_monotone() -> None:
    rng = random.Random(39)
    not_monotone = 0  # grids where a passing fleet with one replica more misses
    for case in range(200):
        types = rng.choice((2, 3))
        caps = [rng.randint(1, 6) for _ in range(types)]
        costs = [round(rng.uniform(0.5, 3.0), 2) for _ in range(types)]
        speeds = tuple(round(rng.uniform(0.5, 3.0), 2) for _ in range(types))
        judge = Synthetic(case, speeds, demand=rng.uniform(2, 8), band=rng.uniform(0.3, 2.0))
        names = [f"t{k}" for k in range(types)]
        truth = brute_force(judge, costs, caps)
        one = cheapest(judge, names, costs, caps, jobs=1)
        with ThreadPoolExecutor(3) as pool:
            three = cheapest(judge, names, costs, caps, jobs=3, pool=pool)
        assert one[0] == truth == three[0], (case, caps, costs)
        # every fleet before the answer in cost order was judged, and missed
        fleets = sorted((c for c in itertools.product(*(range(n + 1) for n in caps)) if any(c)),
                        key=lambda c: (round(sum(n * k for n, k in zip(c, costs)), 9), c))
        before = fleets if truth is None else fleets[:fleets.index(truth)]
        judged = {tuple(t.counts.values()): t.ok for t in one[2]}
        assert all(judged.get(c) is False for c in before) and one[3] == len(before)
        if truth is not None and any(judge.passes(c) and not judge.passes(tuple(
                n + (j == k) for j, n in enumerate(c))) for c in fleets for k in range(types)
                if all(n + (j == k) <= caps[j] for j, n in enumerate(c))):
            not_monotone += 1
    assert not_monotone > 20  # what a search that trusts monotonicity gets wrong is really here


def test_a_lone_passing_fleet_below_failing_larger_ones_is_found() -> None:
    class Table:
        def __call__(self, counts: dict[str, int]) -> tuple[bool, float | None]:
            c = (counts["a"], counts["b"])
            return c in {(1, 1), (3, 3)}, None

    best, _, tested, cheaper = cheapest(Table(), ["a", "b"], [1.0, 1.5], [3, 3])
    assert best == (1, 1)  # though (2, 1), (1, 2) and everything up to (3, 3) but it miss
    assert cheaper == 3 and {(1, 0), (2, 0), (0, 1)} <= {tuple(t.counts.values()) for t in tested}


def scenario(**over):
    """A cheap slow type beside a fast one; neither alone is the cheapest answer."""
    return small(**{"duration_s": 30, "warmup_s": 5, "slo": {"tpot_s": 0.05}, "streams": [CHAT],
                    "fleet": [{"gpu": "L20", "replicas": 6, "name": "slow", "cost": 0.8},
                              {"gpu": "A100", "replicas": 3, "name": "fast", "cost": 2.2}], **over})


def test_the_simulated_answer_keeps_the_slo_every_cheaper_fleet_missed_and_jobs_do_not_matter() -> None:
    sc = scenario()
    found = find_min_fleet(sc, "load-balance", jobs=2)
    assert found.counts is not None and found.attainment is not None and found.attainment >= 0.99
    again = _trial(sc, "load-balance", 0, found.counts, found.cost)  # an independent run of the answer
    assert again.ok and again.attainment == found.attainment
    cheaper = [c for c in itertools.product(range(7), range(4)) if any(c)
               and round(0.8 * c[0] + 2.2 * c[1], 9) < found.cost]
    runs = {tuple(t.counts.values()): t for t in found.tested}
    assert cheaper and all(c in runs and not runs[c].ok for c in cheaper)
    assert found.cheaper >= len(cheaper)
    assert not _trial(sc, "load-balance", 0, dict(zip(("slow", "fast"), max(
        cheaper, key=lambda c: 0.8 * c[0] + 2.2 * c[1]))), 0.0).ok  # the dearest of them, independently
    one = find_min_fleet(sc, "load-balance", jobs=1)
    assert (one.counts, one.cost, one.alone, one.cheaper) == (found.counts, found.cost, found.alone,
                                                              found.cheaper)
    text = markdown(found)
    assert f"all {found.cheaper} fleets" in text and "Floors: none under load" in text


class Scripted(SimulatedFleets):
    """A fleet's run per seed from a table, no simulation: what the seeds' judge makes of them."""

    def __init__(self, table: dict[int, tuple[bool, float | None]], settings: RunSettings) -> None:
        super().__init__(scenario(), "load-balance", settings)
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "asked", [])

    def one(self, counts, seed):  # noqa: ANN001, ANN201
        self.asked.append(seed)
        return self.table[seed]


def test_with_more_seeds_a_fleet_passes_only_on_every_one_and_stops_at_its_first_miss() -> None:
    fleet = {"slow": 2, "fast": 0}
    settings = RunSettings(seed=2, more_seeds=(0, 1, 2))
    assert settings.seeds == (2, 0, 1)
    every = Scripted({2: (True, 0.999), 0: (True, 0.992), 1: (True, 0.995)}, settings)
    assert every(fleet) == (True, 0.992) and every.asked == [2, 0, 1]  # the lowest attainment
    edge = Scripted({2: (True, 0.999), 0: (False, 0.998), 1: (True, 0.995)}, settings)
    assert edge(fleet) == (False, 0.998) and edge.asked == [2, 0]  # held on seed 2 alone: a miss
    cut = Scripted({2: (False, None), 0: (True, 1.0), 1: (True, 1.0)}, settings)
    assert cut(fleet) == (False, None) and cut.asked == [2]


def test_the_fleet_for_every_seed_holds_on_each_and_costs_at_least_each_seeds_own() -> None:
    sc = scenario(duration_s=20)
    alone = [find_min_fleet(sc, "load-balance", jobs=1, settings=RunSettings(seed=s)) for s in (1, 3)]
    assert alone[0].cost is not None and alone[1].cost is not None
    assert alone[0].cost < alone[1].cost  # seed 1's cheapest fleet misses on seed 3's arrivals
    both = find_min_fleet(sc, "load-balance", jobs=2, settings=RunSettings(seed=1, more_seeds=(3,)))
    assert both.seeds == (1, 3) and both.counts is not None and both.cost >= alone[1].cost
    assert all(_trial(sc, "load-balance", s, both.counts, both.cost).ok for s in (1, 3))
    assert "on every one of seeds 1, 3" in markdown(both) and both.as_json()["seeds"] == [1, 3]


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


@pytest.mark.parametrize("args", [["--seeds", "0,1"], ["--seeds", "0,1", "--find-max-rate"],
                                  ["--find-min-fleet", "--seeds", "0,x"],
                                  ["--acceptance", "--seeds", ""]])
def test_seeds_is_refused_outside_the_search_and_when_not_integers(args: list[str],
                                                                   capsys: pytest.CaptureFixture) -> None:
    assert main(["fleet-sim", "--scenario", "rag-a40-a100", *args]) == 2
    assert "--seeds" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--optimizer"], ["--find-max-rate"], ["--profiles", "x"]])
def test_flags_a_fixed_fleet_cannot_use_are_refused(flag: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["fleet-sim", "--scenario", "rag-a40-a100", "--find-min-fleet", *flag]) == 2
    assert flag[0] in capsys.readouterr().err


def test_gateways_token_sharing_and_capacity_reach_every_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    import extproc.fleetsim.minfleet as minfleet

    seen = []

    def fake(scenario, strategy, seed=0, jobs=0, settings=None):
        seen.append(settings)
        raise ValueError("stop here")

    monkeypatch.setattr(minfleet, "find_min_fleet", fake)
    main(["fleet-sim", "--scenario", "rag-a40-a100", "--find-min-fleet", "--gateways", "3",
          "--no-token-sharing", "--capacity", "oracle", "--seed", "2"])
    assert seen == [minfleet.RunSettings(seed=2, gateways=3, share_tokens=False, oracle_capacity=True)]
    main(["fleet-sim", "--scenario", "rag-a40-a100", "--find-min-fleet", "--seeds", "2,0,1"])
    assert seen[-1] == minfleet.RunSettings(seed=2, more_seeds=(0, 1))
    # and each fleet's run is made with them
    calls = []
    real = minfleet.run

    def spy(*args, **kwargs):
        calls.append({k: kwargs[k] for k in ("gateways", "share_tokens", "oracle_capacity")})
        return real(*args, **kwargs)

    monkeypatch.setattr(minfleet, "run", spy)
    settings = minfleet.RunSettings(gateways=2, share_tokens=False, oracle_capacity=True)
    minfleet.SimulatedFleets(scenario(), "load-balance", settings)({"slow": 1, "fast": 1})
    assert calls == [{"gateways": 2, "share_tokens": False, "oracle_capacity": True}]
