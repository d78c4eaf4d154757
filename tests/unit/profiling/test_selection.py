"""gen-profile's selection rule on hand-written benchmarks whose answers are computed by hand, and on
AIBrix's shipped A40 benchmark against the profiles AIBrix's own gen_profile.py produced from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from extproc.profiling.records import BenchmarkError, MetricLine, read_benchmark
from extproc.profiling.selection import SLOs, select
from tests.support.shared_data import AIBRIX_DATA

REFERENCE = Path(__file__).parent / "aibrix_reference"


def rate_lines(i: int, o: int, rate: float, tput: float, e2e: float, *, ttft: float = 0.05,
               tpot: float = 0.01, e2e_p99: float | None = None,
               skip: tuple[str, ...] = ()) -> list[MetricLine]:
    def times(mean: float, p99: float | None = None) -> dict[str, float | None]:
        return {"mean": mean, "P50": mean, "P90": mean, "P99": mean if p99 is None else p99}

    lines = [MetricLine(i, o, rate, "TPUT", {"mean": tput}), MetricLine(i, o, rate, "TT", {"mean": tput * o}),
             MetricLine(i, o, rate, "E2E", times(e2e, e2e_p99)), MetricLine(i, o, rate, "TTFT", times(ttft)),
             MetricLine(i, o, rate, "TPOT", times(tpot))]
    return [line for line in lines if line.metric not in skip]


def hand_benchmark() -> list[MetricLine]:
    return [
        # (in 100, out 10): rates 1 and 2 meet E2E < 1; both kept up (TPUT ≥ 0.9 × rate) → rate 2.
        *rate_lines(100, 10, 1, 1.0, 0.5), *rate_lines(100, 10, 2, 1.9, 0.8),
        *rate_lines(100, 10, 4, 3.9, 1.5),
        # (in 200, out 10): both pass, neither kept up (0.85 < 0.9, 1.5 < 1.8) → the lowest passing, rate 1.
        *rate_lines(200, 10, 1, 0.85, 0.6), *rate_lines(200, 10, 2, 1.5, 0.7),
        # (in 100, out 20): nothing passes (E2E 1.0 is not strictly below 1.0) → tputs 0, e2e at rate 1.
        *rate_lines(100, 20, 2, 1.9, 1.2), *rate_lines(100, 20, 1, 1.0, 1.0),
        # (in 200, out 20): rate 1 would win but has no TTFT line, so it passes nothing → rate 2.
        *rate_lines(200, 20, 1, 0.95, 0.5, skip=("TTFT",)), *rate_lines(200, 20, 2, 1.7, 0.9),
    ]


def test_hand_computed_cells_under_an_e2e_slo() -> None:
    grid = select(hand_benchmark(), SLOs(0, {"e2e": 1.0}))
    assert grid.outputs == (10, 20) and grid.inputs == (100, 200)
    assert grid.rates == ((2, 1), (None, 2))
    assert grid.tputs == ((1.9, 0.85), (0.0, 1.7))
    assert grid.e2e == ((0.8, 0.6), (1.0, 0.9))  # (100, 20): mean E2E at its lowest rate, 1
    assert grid.ttft is None  # only recorded when a TTFT SLO is set


def test_tpot_is_recorded_at_the_rate_e2e_was_read_at() -> None:
    lines = [*rate_lines(100, 10, 1, 1.0, 0.5, tpot=0.010), *rate_lines(100, 10, 2, 1.9, 0.8, tpot=0.015),
             *rate_lines(100, 10, 4, 3.9, 1.5, tpot=0.030),   # misses E2E < 1
             *rate_lines(100, 20, 1, 1.0, 1.0, tpot=0.020), *rate_lines(100, 20, 2, 1.9, 1.2, tpot=0.025),
             *rate_lines(200, 10, 1, 1.0, 0.5, skip=("TPOT",)), *rate_lines(200, 20, 1, 1.0, 0.5, tpot=0.02)]
    grid = select(lines, SLOs(0, {"e2e": 1.0}))
    assert grid.rates == ((2, None), (None, 1))
    # (100, 20) serves nothing: its first rate, like e2e; (200, 10) has no TPOT line, so it passes
    # nothing and has no TPOT: 0, without the warning a missing E2E gets (a cell never read)
    assert grid.tpot == ((0.015, 0.0), (0.020, 0.02))
    assert grid.warnings == ()


def test_without_slos_every_complete_rate_passes() -> None:
    grid = select(hand_benchmark(), SLOs())
    # (100, 20): rate 2 kept up (1.9 ≥ 1.8); (200, 20): rate 1 still lacks its TTFT line
    assert grid.rates == ((4, 1), (2, 2))
    assert grid.tputs == ((3.9, 0.85), (1.9, 1.7))


def test_percentile_is_checked_on_that_statistic() -> None:
    lines = [*rate_lines(100, 10, 1, 1.0, 0.5, e2e_p99=3.0), *rate_lines(100, 10, 2, 1.9, 0.6, e2e_p99=0.9)]
    assert select(lines, SLOs(0, {"e2e": 1.0})).rates == ((2,),)
    assert select(lines, SLOs(99, {"e2e": 1.0})).rates == ((2,),)
    assert select(lines, SLOs(99, {"e2e": 0.8})).rates == ((None,),)
    assert select(lines, SLOs(50, {"e2e": 0.55})).rates == ((1,),)


def test_throughput_slos_are_at_least_and_tpat_is_derived() -> None:
    lines = [*rate_lines(100, 10, 1, 1.0, 0.5), *rate_lines(100, 10, 2, 1.9, 1.0)]
    assert select(lines, SLOs(0, {"tput": 1.0})).rates == ((2,),)  # mean ≥ value: 1.0 passes too
    assert select(lines, SLOs(0, {"tput": 1.95})).rates == ((None,),)
    assert select(lines, SLOs(0, {"tt": 19.0})).rates == ((2,),)  # TT = 1.9 × 10
    # TPAT = E2E / (100 + 10): 0.5/110 ≈ 0.0045, 1.0/110 ≈ 0.0091
    assert select(lines, SLOs(0, {"tpat": 0.005})).rates == ((1,),)
    assert select(lines, SLOs(0, {"tpat": 0.01})).rates == ((2,),)


def test_ttft_slo_records_ttft_at_the_chosen_rate() -> None:
    lines = [*rate_lines(100, 10, 1, 1.0, 0.5, ttft=0.02), *rate_lines(100, 10, 2, 1.9, 0.6, ttft=0.2)]
    grid = select(lines, SLOs(0, {"ttft": 0.1}))
    assert grid.rates == ((1,),) and grid.ttft == ((0.02,),)
    none = select(lines, SLOs(0, {"ttft": 0.01}))
    assert none.tputs == ((0.0,),) and none.ttft == ((0.02,),)  # first rate's mean TTFT


def test_null_statistics_pass_nothing_and_a_repeated_line_replaces_the_earlier() -> None:
    nulls = {"mean": None, "P50": None, "P90": None, "P99": None}
    lines = [*rate_lines(100, 10, 1, 1.0, 0.5), *rate_lines(100, 10, 2, 1.9, 0.6),
             MetricLine(100, 10, 2, "E2E", nulls)]  # an --append re-run where every request failed
    assert select(lines, SLOs()).rates == ((1,),)


def test_a_cell_without_e2e_measurements_warns() -> None:
    nulls = {"mean": None, "P50": None, "P90": None, "P99": None}
    lines = [*rate_lines(100, 10, 1, 1.0, 0.5), MetricLine(200, 10, 1, "TPUT", {"mean": 0.0}),
             MetricLine(200, 10, 1, "E2E", nulls)]
    grid = select(lines, SLOs())
    assert grid.tputs == ((1.0, 0.0),) and grid.e2e == ((0.5, 0.0),)
    assert any("input 200, output 10" in w for w in grid.warnings)


def test_a_metric_absent_from_the_whole_file_is_an_error() -> None:
    lines = [line for line in hand_benchmark() if line.metric != "TPOT"]
    with pytest.raises(BenchmarkError, match="no TPOT lines"):
        select(lines, SLOs())


@pytest.mark.parametrize("slos", [{"bogus": 1.0}, {"E2E": 1.0}, {"e2e": 0.0}, {"e2e": -1.0}, {"tput": -1.0}])
def test_bad_slos_are_refused(slos: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SLOs(0, slos)
    with pytest.raises(ValueError, match="percentile"):
        SLOs(95)


def test_slos_in_the_profile_in_aibrix_order() -> None:
    assert SLOs(99, {"tpot": 0.05, "e2e": 2.0}).as_profile() == {"percentile": 99, "e2e": 2.0, "tpot": 0.05}
    assert SLOs(0, {"tput": 0.0}).as_profile() == {"percentile": 0}  # 0 is AIBrix's "not set"


@pytest.mark.parametrize("name, pct, targets", [
    ("noslo", 0, {}),
    ("e2e05", 0, {"e2e": 0.5}),
    ("e2e2ttft001percentile99", 99, {"e2e": 2.0, "ttft": 0.01}),
    ("tpat0001percentile90", 90, {"tpat": 0.001}),
    ("tput8tpot005percentile50", 50, {"tput": 8.0, "tpot": 0.05}),
])
def test_same_profile_as_aibrix_gen_profile(name: str, pct: int, targets: dict[str, float]) -> None:
    """References: AIBrix's gen_profile.py (pandas) run on its shipped A40 benchmark with these SLOs."""
    reference = json.loads((REFERENCE / f"a40_{name}.json").read_text())
    grid = select(read_benchmark(AIBRIX_DATA / "simulator-llama2-7b-a40.jsonl"), SLOs(pct, targets))
    assert [list(grid.outputs), list(grid.inputs)] == reference["indexes"]
    assert [list(row) for row in grid.tputs] == reference["tputs"]
    assert [list(row) for row in grid.e2e] == reference["e2e"]
    assert (None if grid.ttft is None else [list(r) for r in grid.ttft]) == reference.get("ttft")
    assert SLOs(pct, targets).as_profile() == reference["slos"]
    zeros = sum(v == 0 for row in grid.tputs for v in row)
    assert (zeros > 0) == bool(targets)  # each SLO case really excludes some cells


def test_aibrix_a100_benchmark_reads_whole() -> None:
    lines = read_benchmark(AIBRIX_DATA / "simulator-llama2-7b-a100.jsonl")
    assert len(lines) == 1400 and {line.metric for line in lines} == {"TPUT", "TT", "E2E", "TTFT", "TPOT"}
    grid = select(lines, SLOs())
    assert grid.inputs == (128, 256, 512, 1024, 2048) and grid.outputs == (4, 8, 16, 32, 64, 128, 256, 512)
    assert all(v > 0 and not math.isnan(v) for row in grid.tputs for v in row)


def admitted_lines(i: int, o: int, k: int, tput: float, e2e: float, tpot: float = 0.01) -> list[MetricLine]:
    from extproc.profiling.selection import ADMITTED_KEY

    return [MetricLine(x.input_tokens, x.output_tokens, float(k), x.metric, x.stats, {ADMITTED_KEY: k})
            for x in rate_lines(i, o, k, tput, e2e, tpot=tpot)]


def test_admitted_keeps_half_the_largest_budget_that_met_the_slo() -> None:
    from extproc.profiling.selection import admitted

    slos = SLOs(percentile=99, targets={"e2e": 1.0})
    lines = [
        # (100, 10): budgets 2, 4 and 8 pass, 16 misses E2E → at most 8 / 2 = 4: budget 4 at 6.0 req/s.
        *admitted_lines(100, 10, 2, 3.0, 0.6), *admitted_lines(100, 10, 4, 6.0, 0.8),
        *admitted_lines(100, 10, 8, 9.0, 0.9), *admitted_lines(100, 10, 16, 9.5, 1.4),
        # (200, 10): its only run misses → tputs and Little's budget floor(1.5 x 2.0) = 3.
        *admitted_lines(200, 10, 6, 4.0, 1.1),
        # (300, 10): only budget 5 passes → that one (nothing smaller was measured).
        *admitted_lines(300, 10, 5, 2.5, 0.9), *admitted_lines(300, 10, 10, 3.0, 1.2),
    ]
    got = admitted(lines, slos, (10,), (100, 200, 300), ((2.0, 1.5, 1.0),), ((0.9, 2.0, 1.0),))
    assert got.tputs == ((6.0, 1.5, 2.5),)
    assert got.budgets == ((4.0, 3.0, 5.0),)
    # the best of any passing budget beside them: 8 at 9.0 (16 missed), the rate where none passed, 5 at 2.5
    assert got.most == ((9.0, 1.5, 2.5),)
    # another margin (`gen-profile --budget-margin`): 1 keeps the largest that passed, 4 a quarter of it
    largest = admitted(lines, slos, (10,), (100, 200, 300), ((2.0, 1.5, 1.0),), ((0.9, 2.0, 1.0),), 1.0)
    assert largest.budgets == ((8.0, 3.0, 5.0),) and largest.tputs == ((9.0, 1.5, 2.5),)
    quarter = admitted(lines, slos, (10,), (100, 200, 300), ((2.0, 1.5, 1.0),), ((0.9, 2.0, 1.0),), 4.0)
    assert quarter.budgets == ((2.0, 3.0, 5.0),)
    # TPOT where the rate was read: the kept budget's (0.01 on every run here), else the rate run's given
    with_rate = admitted(lines, slos, (10,), (100, 200, 300), ((2.0, 1.5, 1.0),), ((0.9, 2.0, 1.0),),
                         tpot=((0.03, 0.04, 0.05),))
    assert with_rate.tpot == ((0.01, 0.04, 0.01),)


def test_an_admitted_profile_reads_tpot_at_the_budget_it_keeps() -> None:
    """The rate run passed nothing on the long prompt (one request alone already queues behind the
    next's prefill); held one at a time it passes, and its TPOT is the one a routed pod shows."""
    from extproc.profiling.gen_profile import profile_from_lines

    slos = SLOs(percentile=99, targets={"tpot": 0.05})
    rate = [*rate_lines(100, 10, 1, 1.0, 0.3, tpot=0.02), *rate_lines(100, 10, 2, 1.9, 0.4, tpot=0.03),
            *rate_lines(4000, 10, 0.5, 0.5, 2.0, tpot=0.07)]
    held = [*admitted_lines(100, 10, 1, 1.0, 0.3, tpot=0.015),
            *admitted_lines(100, 10, 2, 1.5, 0.35, tpot=0.02),
            *admitted_lines(4000, 10, 1, 0.5, 1.5, tpot=0.012),
            *admitted_lines(4000, 10, 2, 0.6, 2.5, tpot=0.06)]
    profile, grid = profile_from_lines("g", rate, 1.0, slos, 0.0, held)
    assert grid.tpot == ((0.03, 0.07),)            # the rate run's: at its rate, or its first one
    assert profile.concurrency_admitted == ((1.0, 1.0),) and profile.tputs_admitted == ((1.9, 0.5),)
    # (100, 10): the rate run's 1.9 req/s beat the admitted 1.0 at the kept budget: its TPOT stays;
    # (4000, 10): the admitted budget 1 was kept (2 missed): its TPOT, not the failed rate's
    assert profile.tpot == ((0.03, 0.012),)


def test_budget_ladder_starts_at_littles_budget() -> None:
    from extproc.profiling.selection import budget_ladder

    assert budget_ladder(7.3, 1.2) == [8, 16, 32, 64]  # floor(8.76) = 8, then x2, x4, x8
    assert budget_ladder(0.0, 3.0) == [1, 2, 4, 8]  # no rate passed: one at a time upwards
    assert budget_ladder(0.4, 1.0, (1, 1.5, 2)) == [1, 2]  # rounded, repeats dropped


def test_the_ladder_climbs_while_a_budget_meets_the_slo_and_serves_more() -> None:
    from extproc.profiling.selection import climb_to

    slos = SLOs(percentile=99, targets={"e2e": 1.0})
    at8, at16 = admitted_lines(100, 10, 8, 9.0, 0.9), admitted_lines(100, 10, 16, 12.0, 0.95)
    assert climb_to(at16, at8, slos, 16, 256) == 32  # passed, 12 >= 1.1 x 9
    assert climb_to(at8, None, slos, 8, 256) == 16  # the first rung has nothing below it to compare
    flat = admitted_lines(100, 10, 16, 9.5, 0.95)
    assert climb_to(flat, at8, slos, 16, 256) is None  # 9.5 < 1.1 x 9: more budget only queues
    missed = admitted_lines(100, 10, 16, 12.0, 1.2)
    assert climb_to(missed, at8, slos, 16, 256) is None  # E2E 1.2 misses
    assert climb_to(at16, at8, slos, 16, max_budget=31) is None  # 32 is past the cap
    assert climb_to(at16, at8, slos, 16, max_budget=32) == 32
    no_ttft = [x for x in at16 if x.metric != "TTFT"]
    assert climb_to(no_ttft, at8, slos, 16, 256) is None  # a missing line passes nothing, as in gen-profile
    assert SLOs.of_profile(slos.as_profile()) == slos
