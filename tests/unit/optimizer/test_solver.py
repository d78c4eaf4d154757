"""The MILP: hand-checked plans, and the optimum against brute force on small random instances."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from scipy.optimize import linprog

from extproc.gpu_profiles import GpuProfile
from extproc.optimizer import Demand, PlanError, solve
from extproc.optimizer.solver import as_routed
from tests.unit.optimizer.support import LONG, SHORT, one_cell, profile


def rates(short: float = 0.0, long: float = 0.0) -> list[Demand]:
    return [Demand(*SHORT, short), Demand(*LONG, long)]


def test_cheapest_plan_mixes_two_types() -> None:
    # a is 5x faster on short requests, b 5x faster on long ones, same price. All-a or all-b needs 12
    # replicas; a on short + b on long needs 2 + 2, and nothing can do better than the best tput per cell.
    a, b = profile("a", 1.0, short=10, long=1), profile("b", 1.0, short=2, long=5)
    plan = solve([a, b], rates(short=20, long=10))
    assert plan.replicas == {"a": 2, "b": 2} and plan.cost == 4.0
    short, long = sorted(plan.cells, key=lambda c: c.input_tokens)
    assert short.served == pytest.approx({"a": 20}) and long.served == pytest.approx({"b": 10})
    assert plan.load == pytest.approx({"a": 2.0, "b": 2.0})


def test_dominated_type_scales_to_zero() -> None:
    a, b = profile("a", 1.0, short=10, long=5), profile("b", 3.0, short=12, long=6)
    plan = solve([a, b], rates(short=20, long=5))
    assert plan.replicas == {"a": 3, "b": 0} and plan.cost == 3.0
    assert plan.load["b"] == 0.0


def test_one_cell_split_across_types_is_exact() -> None:
    # 15 req/s; a: 10 req/s for 1.0, b: 5 req/s for 0.6. All a = 2.0, all b = 1.8, one of each = 1.6.
    # A slice-based split (AIBrix's Mélange) cannot reach 1.6 unless a slice lands on exactly 2/3.
    plan = solve([one_cell("a", 1.0, 10), one_cell("b", 0.6, 5)], [Demand(128, 16, 15)])
    assert plan.replicas == {"a": 1, "b": 1} and plan.cost == pytest.approx(1.6)
    [cell] = plan.cells
    assert cell.served["a"] == pytest.approx(10) and cell.served["b"] == pytest.approx(5)


def test_zero_tput_cell_is_never_sent_to_that_type() -> None:
    cheap = profile("cheap", 0.1, short=10, long=0)  # cannot meet the SLO on long requests
    plan = solve([cheap, profile("slow", 1.0, short=1, long=1)], rates(long=3))
    assert plan.replicas == {"cheap": 0, "slow": 3}


def test_unservable_cells_are_named() -> None:
    with pytest.raises(PlanError, match=r"input≈2048 output≈512 tokens at 3 req/s") as e:
        solve([profile("a", 1.0, short=10, long=0)], rates(short=1, long=3))
    assert "128" not in str(e.value)  # the servable cell is not blamed
    # the service plans the rest: one odd request shape must not stop every re-plan
    plan = solve([profile("a", 1.0, short=10, long=0)], rates(short=20, long=3), skip_unservable=True)
    assert plan.replicas == {"a": 2} and plan.rps == pytest.approx(20)
    assert "input≈2048 output≈512 tokens at 3 req/s" in plan.unserved


def test_no_profiles_and_duplicate_names_are_errors() -> None:
    with pytest.raises(PlanError, match="no GPU profiles"):
        solve([], rates(short=1))
    with pytest.raises(PlanError, match="same deployment"):
        solve([one_cell("a", 1, 1), one_cell("a", 2, 2)], rates(short=1))


def test_no_load_is_an_empty_plan() -> None:
    plan = solve([profile("a", 1.0, 1, 1)], rates())
    assert plan.replicas == {"a": 0} and plan.cost == 0.0 and plan.cells == ()


def test_profiles_on_different_grids_match_cell_by_cell_in_log2() -> None:
    # a measures 64..1024 outputs, b 4..256: a 100-token output is a's 128 column and b's 128 column;
    # a 600-token output clamps to b's 256 edge.
    a = GpuProfile(
        "a",
        1.0,
        outputs=(64, 128, 1024),
        inputs=(512,),
        tputs=((9,), (8,), (1,)),
        e2e=None,
        ttft=None,
        slos={},
        created=0,
    )
    b = GpuProfile(
        "b",
        1.0,
        outputs=(4, 16, 128, 256),
        inputs=(256, 1024),
        tputs=((9, 9), (9, 9), (4, 2), (0, 0.5)),
        e2e=None,
        ttft=None,
        slos={},
        created=0,
    )
    plan = solve([a, b], [Demand(700, 100, 8.0)])  # a: (128, 512) → 8/s; b: (128, 1024) → 2/s
    assert plan.replicas == {"a": 1, "b": 0}
    plan = solve([a, b], [Demand(700, 600, 1.0)])  # a: 1024 column (1/s); b: 256 edge, 1024 input (0.5/s)
    assert plan.replicas == {"a": 1, "b": 0}
    plan = solve([a, b], [Demand(300, 600, 0.5)])  # b: 256 input → 0 there: only a can serve it
    assert plan.replicas == {"a": 1, "b": 0}
    cost_b_only = solve([b], [Demand(700, 100, 8.0)])
    assert cost_b_only.replicas == {"b": 4}


def _feasible(n: tuple[int, ...], r: list[float], t: list[list[float]]) -> bool:
    """Is there a split of every cell's rate such that each type's load ≤ n_g? (an LP, no integers)"""
    C, G = len(r), len(n)
    pairs = [(c, g) for c in range(C) for g in range(G) if t[c][g] > 0]
    if not pairs:
        return False
    A_eq = np.zeros((C, len(pairs)))
    A_ub = np.zeros((G, len(pairs)))
    for k, (c, g) in enumerate(pairs):
        A_eq[c, k] = 1.0
        A_ub[g, k] = r[c] / t[c][g]
    res = linprog(
        np.zeros(len(pairs)),
        A_ub=A_ub,
        b_ub=np.array(n, float) + 1e-9,
        A_eq=A_eq,
        b_eq=np.ones(C),
        bounds=(0, 1),
        method="highs",
    )
    return res.status == 0


def _brute_force(costs: list[float], r: list[float], t: list[list[float]]) -> float:
    G = len(costs)
    caps = [math.ceil(sum(r[c] / t[c][g] for c in range(len(r)) if t[c][g] > 0) - 1e-9) for g in range(G)]
    best = math.inf
    for n in itertools.product(*(range(cap + 1) for cap in caps)):
        cost = sum(cg * ng for cg, ng in zip(costs, n))
        if cost < best - 1e-12 and _feasible(n, r, t):
            best = cost
    return best


@pytest.mark.parametrize("seed", range(30))
def test_optimum_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    G, C = rng.randint(2, 3), rng.randint(1, 4)
    outputs = tuple(2 ** (4 + k) for k in range(C))  # one cell per output length
    t = [
        [0.0 if rng.random() < 0.25 else round(rng.uniform(0.5, 8.0), 2) for _ in range(G)] for _ in range(C)
    ]
    for row in t:  # every cell servable by someone
        if not any(row):
            row[rng.randrange(G)] = round(rng.uniform(0.5, 8.0), 2)
    costs = [round(rng.uniform(0.2, 2.0), 2) for _ in range(G)]
    r = [round(rng.uniform(0.2, 6.0), 2) for _ in range(C)]
    profiles = [
        GpuProfile(
            f"g{g}",
            costs[g],
            outputs=outputs,
            inputs=(512,),
            tputs=tuple((t[c][g],) for c in range(C)),
            e2e=None,
            ttft=None,
            slos={},
            created=0,
        )
        for g in range(G)
    ]
    plan = solve(profiles, [Demand(512, outputs[c], r[c]) for c in range(C)])
    assert plan.cost == pytest.approx(_brute_force(costs, r, t), abs=1e-9)
    assert _feasible(tuple(plan.replicas[f"g{g}"] for g in range(G)), r, t)
    for name, load in plan.load.items():
        assert load <= plan.replicas[name] + 1e-6


def test_issue_size_solves_well_under_a_second() -> None:
    from extproc.optimizer.bench import run

    result = run(types=5, cells=40, runs=5, seed=7)
    assert result["max_s"] < 1.0, result


def test_near_ties_keep_the_running_mix() -> None:
    a, b = one_cell("a", 1.00, 1.0), one_cell("b", 1.02, 1.0)   # b 2 % dearer per request
    demand = [Demand(128, 8, 4.0)]
    assert solve([a, b], demand).replicas == {"a": 4, "b": 0}
    # running on b: moving 4 replicas to save 2 % is not worth the churn
    assert solve([a, b], demand, current={"a": 0, "b": 4}).replicas == {"a": 0, "b": 4}
    # growth goes where it is cheapest; a real saving still moves
    grown = solve([a, b], [Demand(128, 8, 6.0)], current={"a": 0, "b": 4})
    assert grown.replicas == {"a": 2, "b": 4}
    far = one_cell("c", 2.0, 1.0)
    assert solve([a, far], demand, current={"a": 0, "c": 4}).replicas == {"a": 4, "c": 0}


def test_a_swap_of_types_that_saves_less_than_adding_costs_is_not_made() -> None:
    # 3 big ($7.50) or 2 big + 2 small ($7.00): from 3 big, swapping saves 7 % an hour but the added
    # replicas bill at once while the removed one runs on through the autoscaler's stabilization, and
    # at the edge of feasibility the next window's noise reverses it (each autoscaler then holds the
    # larger count of both plans: 2 small + 3 big)
    big, small = one_cell("big", 2.5, 10.0), one_cell("small", 1.0, 3.5)
    demand = [Demand(128, 8, 27.0)]
    assert solve([big, small], demand).replicas == {"big": 2, "small": 2}
    assert solve([big, small], demand, current={"big": 3, "small": 0}).replicas == {"big": 3, "small": 0}
    # what the demand needs is added all the same, where it is cheapest; a replica it no longer needs goes
    assert solve([big, small], [Demand(128, 8, 33.0)],
                 current={"big": 3, "small": 0}).replicas == {"big": 3, "small": 1}
    assert solve([big, small], demand, current={"big": 4, "small": 0}).replicas == {"big": 3, "small": 0}


def batched(gpu: str, cost: float, tput: float, e2e: float) -> GpuProfile:
    """One cell whose replica holds floor(tput x e2e) requests at once (the SLO router's budget)."""
    return GpuProfile(gpu=gpu, cost=cost, outputs=(16,), inputs=(128,), tputs=((tput,),), e2e=((e2e,),),
                      ttft=None, slos={}, created=1.0)


@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
def test_headroom_is_square_root_staffing_in_the_slots_a_replica_holds(beta: float) -> None:
    """A shape served one at a time (tput x e2e < 1) keeps beta·sqrt(L) replicas spare; a shape a replica
    batches 25 at once keeps beta·sqrt(L / 25)."""
    demand = [Demand(128, 16, 16.0)]
    whole = solve([batched("a", 1.0, 1.0, 0.5)], demand, headroom=beta)       # L = 16, k = 1
    batch = solve([batched("a", 1.0, 1.0, 25.0)], demand, headroom=beta)      # L = 16, k = 25
    assert whole.replicas["a"] == math.ceil(16 + beta * 4 - 1e-9)
    assert batch.replicas["a"] == math.ceil(16 + beta * 4 / 5 - 1e-9)
    assert solve([batched("a", 1.0, 1.0, 0.5)], demand).replicas["a"] == 16  # no headroom: the load


def test_headroom_can_change_the_mix_toward_the_type_that_pools() -> None:
    """Without headroom the cheaper-per-request type a wins; with it, a's one-at-a-time replicas pay a
    large spare share while b batches, and b wins."""
    a = batched("a", 1.0, 1.0, 0.5)   # $1 per req/s, one at a time
    b = batched("b", 2.1, 2.0, 20.0)  # $1.05 per req/s, 40 at once
    demand = [Demand(128, 16, 8.0)]
    assert solve([a, b], demand).replicas == {"a": 8, "b": 0}
    assert solve([a, b], demand, headroom=1.0).replicas == {"a": 0, "b": 5}  # 4 + sqrt(4/40) -> 5


def test_limits_bound_a_type_and_the_rest_goes_elsewhere() -> None:
    cheap, dear = one_cell("cheap", 1.0, 10.0), one_cell("dear", 3.0, 10.0)
    plan = solve([cheap, dear], [Demand(128, 16, 50.0)], limits={"cheap": 3})
    assert plan.replicas == {"cheap": 3, "dear": 2}
    with pytest.raises(PlanError):
        solve([cheap], [Demand(128, 16, 50.0)], limits={"cheap": 3})  # cannot serve it at all


def _halves() -> GpuProfile:
    """Inputs 128 / 256 tokens (the line between them at 2^7.5 = 181), outputs 16 / 32 (at 2^4.5)."""
    return GpuProfile(gpu="g", cost=1.0, outputs=(16, 32), inputs=(128, 256),
                      tputs=((4.0, 2.0), (2.0, 1.0)), e2e=None, ttft=None, slos={}, created=1.0)


def test_a_trace_bucket_on_a_cell_line_is_counted_as_the_router_routes_it() -> None:
    """Bucket 75 (precision 10) holds 2^7.45-2^7.55 tokens and is centred on the line between the 128 and
    256 cells: mapped by its centre it goes whole to 256 (the tie rule); as routed, half of it lands on
    each side. A bucket inside one cell, and an exact shape (width 0), stay as they are."""
    p = _halves()
    centre = 2 ** 7.5
    on_both_lines = Demand(centre, 2 ** 4.5, 8.0, width=0.1)
    pieces = as_routed([p], [on_both_lines])
    assert sum(d.rps for d in pieces) == pytest.approx(8.0)
    assert sorted((p.cell(d.input_tokens, d.output_tokens), d.rps) for d in pieces) == [
        ((0, 0), pytest.approx(2.0)), ((0, 1), pytest.approx(2.0)),
        ((1, 0), pytest.approx(2.0)), ((1, 1), pytest.approx(2.0))]
    assert p.cell(centre, 2 ** 4.5) == (1, 1)  # whole, by its centre
    # the load: as routed 2/4 + 2/2 + 2/2 + 2/1 = 4.5 replicas; by the centre 8/1 = 8
    assert solve([p], pieces).load["g"] == pytest.approx(4.5)
    assert solve([p], [on_both_lines]).load["g"] == pytest.approx(8.0)
    inside = Demand(2 ** 7.2, 2 ** 4.0, 3.0, width=0.1)
    assert [p.cell(d.input_tokens, d.output_tokens) for d in as_routed([p], [inside])] == [(0, 0)]
    exact = Demand(centre, 2 ** 4.5, 3.0)
    assert as_routed([p], [exact]) == [exact]
