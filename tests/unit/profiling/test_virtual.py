"""The benchmark's sweep on the engine model in virtual time (profiling/virtual.py): the virtual loop, the
overload rule, errors as the simulator's server answers them, and prompts of their own per cell."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from extproc.profiling.plan import DEFAULT_INPUT_LENS, LoadPlan
from extproc.profiling.sweep import prompt_rng
from extproc.profiling.virtual import benchmark, run_virtual
from extproc.profiling.workload import Cell
from extproc.sim.fleet import ReplicaSpec


def engine(gpu: str = "A100-80GB"):  # type: ignore[no-untyped-def]
    return ReplicaSpec(gpu=gpu, model="llama2-7b").build_engine()


def test_the_virtual_loop_sleeps_without_waiting() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.wait_for(asyncio.sleep(3600), timeout=7200)
        return start, loop.time()

    start, end = run_virtual(main())
    assert end - start == pytest.approx(3600)

    async def stuck() -> None:
        await asyncio.get_running_loop().create_future()  # nothing will ever set it

    with pytest.raises(RuntimeError, match="nothing that will ever happen"):
        run_virtual(stuck())


def by_metric(lines, rate: float) -> dict:  # type: ignore[no-untyped-def]
    return {line.metric: line for line in lines if line.request_rate == rate}


def test_virtual_lines_are_the_benchmarks_statistics() -> None:
    # one request at a time (a slow rate): TPOT pools the gaps between tokens, each one decode step;
    # TPUT counts completions over the whole run, first send to last completion
    plan = LoadPlan(input_lens=(128,), output_lens=(32,), rates=(0.05,), num_prompts=5)
    lines = by_metric(benchmark(engine(), plan, "m"), 0.05)
    assert set(lines) == {"TPUT", "TT", "E2E", "TTFT", "TPOT"}
    tpot, e2e, ttft = lines["TPOT"].stats, lines["E2E"].stats, lines["TTFT"].stats
    assert 0 < tpot["P50"] == pytest.approx(tpot["P99"], rel=0.01)  # alone: every gap one step
    assert e2e["mean"] == pytest.approx(ttft["mean"] + 31 * tpot["mean"], rel=0.01)
    assert lines["TT"].stats["mean"] == pytest.approx(32 * lines["TPUT"].stats["mean"])
    assert lines["TPUT"].extra["samples"] == 5 and lines["TPUT"].extra["failed"] == 0


def test_an_overloaded_cell_is_cut_off_and_higher_rates_skipped() -> None:
    plan = LoadPlan(input_lens=(2048,), output_lens=(256,), rates=(0.25, 64.0, 128.0), num_prompts=60,
                    max_backlog=20)
    lines = benchmark(engine("V100"), plan, "m")
    assert sorted({line.request_rate for line in lines}) == [0.25, 64.0]  # 128 skipped after 64 overloaded
    cut = by_metric(lines, 64.0)["TPUT"].extra
    assert "max backlog 20" in cut["overloaded"] and cut["unfinished"] > 0
    assert "overloaded" not in by_metric(lines, 0.25)["TPUT"].extra


def test_a_shape_past_the_context_fails_as_the_simulators_server_answers() -> None:
    plan = LoadPlan(input_lens=(8192,), output_lens=(64,), rates=(1.0,), num_prompts=3)
    lines = by_metric(benchmark(engine(), plan, "m"), 1.0)  # llama2-7b: a 4K context
    assert lines["TPUT"].stats["mean"] == 0 and lines["TPUT"].extra["failed"] == 3
    assert lines["E2E"].stats["mean"] is None  # nothing measured: gen-profile passes nothing here


def test_every_cell_and_run_draws_prompts_of_its_own() -> None:
    # one seed for every cell would resend the last cell's prompts, and prefix caching would skip them
    plan = LoadPlan()
    draws = {(run, rate): prompt_rng(plan, Cell(128, 16, rate), run).random()
             for run in ("rate", "admitted") for rate in (1.0, 2.0)}
    assert len(set(draws.values())) == 4
    assert prompt_rng(plan, Cell(128, 16, 1.0), "rate").random() == draws[("rate", 1.0)]


def test_the_default_grid_reaches_8k_prompts() -> None:
    assert max(DEFAULT_INPUT_LENS) == 8192 and 6144 in DEFAULT_INPUT_LENS


def test_an_admitted_cell_is_cut_off_by_a_request_that_hangs_not_by_its_length() -> None:
    from extproc.gpu_profiles import parse_profile

    # one request at a time (Little's budget 1), 256 tokens: each ~3 s, 10 of them ~30 s in all
    profile = parse_profile({"gpu": "a100", "cost": 1.0, "tputs": [[0.3]], "indexes": [[256], [128]],
                             "e2e": [[3.0]], "slos": {"percentile": 99, "tpot": 0.05}, "created": 1.0})
    plan = LoadPlan(num_prompts=10, drain_timeout=10.0, admitted=profile, budget_factors=(1,), max_budget=1)
    [tput] = [line for line in benchmark(engine(), plan, "m") if line.metric == "TPUT"]
    assert "overloaded" not in tput.extra and tput.extra["failed"] == 0 and tput.extra["unfinished"] == 0
    assert 10 / tput.stats["mean"] > 10.0  # longer than the timeout in all
    [cut] = [line for line in benchmark(engine(), replace(plan, drain_timeout=1.0), "m")
             if line.metric == "TPUT"]
    assert "still running 1s" in cut.extra["overloaded"] and cut.extra["unfinished"] > 0


def test_an_admitted_budget_reads_what_the_replica_serves_while_it_holds_it() -> None:
    from extproc.gpu_profiles import parse_profile

    # Little's budget 1, run at x8: 8 requests in flight, 24 in all. Held, a replica serves k / e2e
    # (Little's law); over the whole run, with the stagger's ramp and the drain, about N / (N + k) = 0.75
    # of that.
    profile = parse_profile({"gpu": "a100", "cost": 1.0, "tputs": [[0.3]], "indexes": [[256], [128]],
                             "e2e": [[3.0]], "slos": {"percentile": 99, "tpot": 0.05}, "created": 1.0})
    plan = LoadPlan(num_prompts=24, admitted=profile, budget_factors=(8,), max_budget=8)
    lines = {line.metric: line for line in benchmark(engine(), plan, "m")}
    assert lines["TPUT"].request_rate == 8
    assert lines["TPUT"].stats["mean"] == pytest.approx(8 / lines["E2E"].stats["mean"], rel=0.1)


def test_the_grid_fits_the_models_context() -> None:
    plan = LoadPlan(input_lens=(128, 4096, 6144, 8192), output_lens=(16, 1024))
    assert plan.fit(8192).input_lens == (128, 4096, 6144, 7168)  # 8192 + any answer does not fit 8K
    assert plan.fit(32768) is plan and LoadPlan().fit(8192).input_lens[-1] == 8192 - 4096


def admitted_budgets(slos: dict[str, float], rate_tput: float = 2.0,
                     **plan: object) -> list[tuple[int, float, float, int]]:
    """(budget, TPUT, P99 TPOT, requests sent) of each admitted run of one 512-in / 64-out cell on an
    A100, in run order; `rate_tput`: what the rate run's profile read for the cell (0: no rate met the
    SLO)."""
    from extproc.gpu_profiles import parse_profile

    profile = parse_profile({"gpu": "a100", "cost": 1.0, "tputs": [[rate_tput]], "indexes": [[64], [512]],
                             "e2e": [[1.0]], "slos": slos, "created": 1.0})
    lines = benchmark(engine(), LoadPlan(num_prompts=20, admitted=profile, **plan), "m")  # type: ignore[arg-type]
    tpot = {x.request_rate: x.stats["P99"] for x in lines if x.metric == "TPOT"}
    return [(int(x.request_rate), x.stats["mean"], tpot[x.request_rate], x.extra["samples"])
            for x in lines if x.metric == "TPUT"]


def test_an_admitted_ladder_climbs_past_its_factors_until_a_budget_misses_or_stops_serving_more() -> None:
    runs = admitted_budgets({"percentile": 99, "tpot": 0.05}, budget_factors=(1, 2), max_budget=256)
    budgets = [k for k, *_ in runs]
    assert budgets[:2] == [2, 4] and len(budgets) > 3, runs  # Little's budget 2, x2, then climbed
    assert all(b == 2 * a for a, b in zip(budgets, budgets[1:]))
    # every rung climbed from met the SLO and served at least 10 % more than the one below it
    for (_, below, _, _), (_, t, p99, _) in zip(runs[1:-1], runs[2:-1]):
        assert p99 < 0.05 and t >= 1.1 * below
    k, t, p99, _ = runs[-1]
    assert p99 >= 0.05 or t < 1.1 * runs[-2][1] or 2 * k > 256, runs  # why it stopped
    # at least three requests per client, so a large budget's run is not all its ramp
    assert [n for *_, n in runs] == [max(20, 3 * k) for k in budgets]


def test_a_ladder_whose_top_budget_misses_does_not_climb() -> None:
    runs = admitted_budgets({"percentile": 99, "tpot": 0.001}, budget_factors=(1, 2), max_budget=256)
    assert [k for k, *_ in runs] == [2, 4]


def test_without_a_largest_budget_a_measured_cell_climbs_only_from_far_inside_its_slo() -> None:
    """Little's budget came from a rate run (capped by the rate grid and the "kept up" rule): the ladder
    climbs past its factors while a rung's P99 is at most half the target (CLIMB_ROOM) and it served
    more, each climbed budget sending 3 requests per client; its own rungs send num_prompts."""
    runs = admitted_budgets({"percentile": 99, "tpot": 0.05}, budget_factors=(1, 2))
    budgets = [k for k, *_ in runs]
    assert budgets[:2] == [2, 4] and len(budgets) > 2, runs
    for (_, below, _, _), (_, t, p99, _) in zip(runs[:-1], runs[1:-1]):  # each rung climbed from
        assert p99 <= 0.025 and t >= 1.1 * below, runs
    from extproc.profiling.plan import UNMEASURED_CAP

    (_, before, _, _), (k, t, p99, _) = runs[-2:]
    assert p99 > 0.025 or t < 1.1 * before or 2 * k > UNMEASURED_CAP, runs  # why it stopped
    assert [n for *_, n in runs] == [20, 20] + [max(20, 3 * k) for k in budgets[2:]]


def test_a_measured_cell_near_its_slo_keeps_its_factors() -> None:
    runs = admitted_budgets({"percentile": 99, "tpot": 0.018}, budget_factors=(1, 2))
    assert [(k, n) for k, _, _, n in runs] == [(2, 20), (4, 20)]
    assert 0.009 < runs[-1][2] < 0.018, runs  # why: x2 met the SLO, its P99 over half the target


def test_a_cell_no_rate_served_within_the_slo_climbs_without_a_largest_budget() -> None:
    """Its Little's budget (1) is a placeholder, not a measurement: the ladder searches from it, up to
    UNMEASURED_CAP, and stops where a budget misses or serves no more."""
    from extproc.profiling.plan import UNMEASURED_CAP

    runs = admitted_budgets({"percentile": 99, "tpot": 0.05}, rate_tput=0.0, budget_factors=(1, 2))
    budgets = [k for k, *_ in runs]
    assert budgets[:2] == [1, 2] and len(budgets) > 3 and budgets[-1] <= UNMEASURED_CAP, runs
    k, t, p99, _ = runs[-1]
    assert p99 >= 0.05 or t < 1.1 * runs[-2][1] or 2 * k > UNMEASURED_CAP, runs
    assert [n for *_, n in runs] == [max(20, 3 * k) for k in budgets]


def test_the_ladder_stops_at_the_largest_budget() -> None:
    runs = admitted_budgets({"percentile": 99, "tpot": 0.05}, budget_factors=(1, 2), max_budget=8)
    assert [k for k, *_ in runs] == [2, 4, 8]


def test_the_profiles_budget_margin_chooses_the_budget_it_keeps() -> None:
    from extproc.profiling.selection import SLOs
    from extproc.profiling.virtual import measure_profile

    plan = LoadPlan(input_lens=(512,), output_lens=(64,), rates=(2.0, 8.0), num_prompts=20)
    slos = SLOs(percentile=99, targets={"tpot": 0.05})
    half, whole = (measure_profile(engine, plan, "m", "a100", 1.0, slos, budget_margin=m) for m in (2.0, 1.0))
    assert (half.budget_margin, whole.budget_margin) == (2.0, 1.0)
    # margin 1 keeps the largest budget that met the SLO, 2 at most half of it
    assert whole.budget(0, 0) >= 2 * half.budget(0, 0) and whole.served[0][0] > half.served[0][0]
