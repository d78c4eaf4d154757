"""Workload files and trace windows → per-cell rates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.optimizer.solver import Demand
from extproc.optimizer.workload import (
    Burst,
    WorkloadError,
    load_workload,
    parse_trace,
    parse_workload,
    read_workload,
    trace_rates,
)
from extproc.tracing import TraceRecorder


def test_workload_file(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"rates": [{"input_tokens": 128, "output_tokens": 64, "rps": 5.0}]}))
    assert load_workload(path) == [Demand(128, 64, 5.0)]


@pytest.mark.parametrize(("data", "where"), [
    ([], "workload"),
    ({"rates": {}}, "workload"),
    ({"rates": [1]}, r"rates\[0\]"),
    ({"rates": [{"input_tokens": 1, "output_tokens": 2}]}, r"rates\[0\]\.rps: missing"),
    ({"rates": [{"input_tokens": 1, "output_tokens": 2, "rps": -1}]}, r"rates\[0\]\.rps"),
    ({"rates": [{"input_tokens": "x", "output_tokens": 2, "rps": 1}]}, r"rates\[0\]\.input_tokens"),
])
def test_bad_workloads(data: object, where: str) -> None:
    with pytest.raises(WorkloadError, match=where):
        parse_workload(data)


def test_bad_workload_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="nope.json"):
        load_workload(tmp_path / "nope.json")


def test_reads_what_the_recorder_writes() -> None:
    r = TraceRecorder()
    for _ in range(3):
        r.arrived("m", 1001.0)
        r.completed("m", 128, 8, 1002.0)
    r.snapshot("m", 2, 1)
    [(key, value)] = r.due(1010.0)
    w = parse_trace(int(key.rsplit("_", 1)[1]), json.loads(value))
    assert (w.end, w.counts, w.precision, w.interval, w.arrived, w.pending, w.queueing) == \
        (1010, {(70, 30): 3}, 10, 10, 3, 2, 1)


def test_reads_aibrix_v2_traces() -> None:
    # from AIBrix's python/aibrix/tests/gpu_optimizer/test_gatewayloadreader.py
    w = parse_trace(20, {"103:46": 1, "79:48": 2, "meta_interval_sec": 10, "meta_precision": 10, "meta_v": 2,
                         "meta_total_reqs": 99})
    assert w.counts == {(103, 46): 1, (79, 48): 2} and w.arrived == 3  # v2 has no arrivals: completions


def test_v1_traces_are_whole_log2() -> None:
    w = parse_trace(20, {"7:3": 4})
    assert w.precision == 1
    assert trace_rates([w], now=20, window_seconds=40) == [Demand(128, 8, 0.4, width=1.0)]


@pytest.mark.parametrize("bad", [{"7-3": 1}, {"7:3": -1}, {"7:3": "many"}, {"meta_v": "x"}, [1]])
def test_bad_traces(bad: object) -> None:
    with pytest.raises(WorkloadError, match="trace 20"):
        parse_trace(20, bad)


def window(end: int, counts: dict[str, int], arrived: int | None = None) -> object:
    data: dict[str, int] = {**counts, "meta_v": 4, "meta_precision": 10, "meta_interval_sec": 10}
    data["meta_total_reqs"] = sum(counts.values()) if arrived is None else arrived
    return parse_trace(end, data)


def test_rate_is_max_of_window_average_and_latest() -> None:
    # 24 windows of 10 s: "70:30" steady at 2/window; "100:60" only in the newest two (a burst)
    ws = [window(1000 + 10 * k, {"70:30": 2}) for k in range(1, 23)]
    ws += [window(1230, {"70:30": 2, "100:60": 30}), window(1240, {"70:30": 2, "100:60": 30})]
    rates = {(round(d.input_tokens), round(d.output_tokens)): d.rps for d in trace_rates(ws, now=1240)}
    assert rates[(128, 8)] == pytest.approx(0.2)  # 48 / 240 s == 2 / 10 s
    assert rates[(1024, 64)] == pytest.approx(3.0)  # the latest 10 s wins at once (30 / 10 s)


def test_one_window_above_the_line_is_not_a_burst() -> None:
    """A burst is two windows in a row above the average's 2 sigmas: one alone is a steady load's noise
    about once in 40 re-plans, and the autoscaler would hold what it asked for 300 s."""
    ws = [window(1000 + 10 * k, {"70:30": 2}) for k in range(1, 24)]
    ws.append(window(1240, {"70:30": 2, "100:60": 30}))
    rates = {(round(d.input_tokens), round(d.output_tokens)): d.rps for d in trace_rates(ws, now=1240)}
    assert rates == {(128, 8): pytest.approx(0.2), (1024, 64): pytest.approx(30 / 240)}  # the average
    ws[-3] = window(1220, {"70:30": 2, "100:60": 30})  # not back to back with the newest: still no burst
    rates = {(round(d.input_tokens), round(d.output_tokens)): d.rps for d in trace_rates(ws, now=1240)}
    assert rates[(1024, 64)] == pytest.approx(60 / 240)


def test_a_steady_load_is_read_as_its_average() -> None:
    """Windows of 100 +- 2 sigma requests: the latest one is noise, not a burst, so the rate is the
    average (AIBrix's max(average, latest) would read this load 10 % high every other re-plan)."""
    counts = [100, 90, 110, 95, 105, 100, 92, 108, 100, 97, 103, 100] * 2
    ws = [window(1000 + 10 * k, {"70:30": n}) for k, n in enumerate(counts[:-1], start=1)]
    ws.append(window(1240, {"70:30": 118}))  # +1.8 sigma over the average
    [d] = trace_rates(ws, now=1241)
    assert d.rps == pytest.approx((sum(counts[:-1]) + 118) / 240)
    ws[-1] = window(1240, {"70:30": 125})  # +2.5 sigma, but the window before was not: noise
    [d] = trace_rates(ws, now=1241)
    assert d.rps == pytest.approx((sum(counts[:-1]) + 125) / 240)
    ws[-2] = window(1230, {"70:30": 125})  # two in a row: a burst, read at once
    [d] = trace_rates(ws, now=1241)
    assert d.rps == pytest.approx(12.5)


def test_decays_slowly_after_a_burst() -> None:
    ws = [window(1000 + 10 * k, {"70:30": 10}) for k in range(1, 25)]
    ws += [window(1250, {"70:30": 10, "100:60": 30}), window(1260, {"70:30": 10, "100:60": 30})]
    rates = {(round(d.input_tokens), round(d.output_tokens)): d.rps for d in trace_rates(ws, now=1300)}
    # the burst is no longer the newest window (none since 1260): only the average, 1070-1260's windows
    assert rates == {(128, 8): pytest.approx(200 / 240), (1024, 64): pytest.approx(60 / 240)}
    assert (1024, 64) not in {(round(d.input_tokens), round(d.output_tokens))
                              for d in trace_rates(ws, now=1260 + 240)}  # out of the window


def test_a_trace_younger_than_the_window_is_averaged_over_what_it_covers() -> None:
    """The model's first minute (or its first requests after a silence longer than the window): its
    rate is what those windows saw, not diluted by time before them, so no burst is needed to read it."""
    ws = [window(1010, {"70:30": 100}), window(1020, {"70:30": 110}), window(1030, {"70:30": 90})]
    [d] = trace_rates(ws, now=1030)
    assert d.rps == pytest.approx(300 / 30)
    [d] = trace_rates(ws, now=1060)  # silence since: counted
    assert d.rps == pytest.approx(300 / 60)


def test_latest_window_scales_by_arrivals_when_completions_lag() -> None:
    ws = [window(1000, {"70:30": 10}, arrived=40), window(1010, {"70:30": 10}, arrived=40)]
    [d] = trace_rates(ws, now=1011)  # overloaded: 40 arrived, 10 finished, two windows in a row
    assert d.rps == pytest.approx(4.0)


def test_windows_from_the_future_are_ignored() -> None:
    assert trace_rates([window(2000, {"70:30": 10})], now=1000) == []


def _steady(n: int = 100, until: int = 1240) -> list:
    """24 windows of 10 s ending at `until`, about `n` requests each (+-1 sigma, deterministic)."""
    wobble = [0, -1, 1, -1, 0, 1]
    return [window(until - 230 + 10 * k, {"70:30": n + wobble[k % 6] * int(n ** 0.5)}) for k in range(24)]


def test_a_burst_the_fleet_absorbs_is_left_to_the_router() -> None:
    """With a judge that sees no strain, a burst is neither read at once nor averaged in: the rate is
    the level before it. A judge that sees strain reads it at once, as without one."""
    ws = _steady()
    level = sum(sum(w.counts.values()) for w in ws[:-3]) / 210  # the 21 windows before the burst
    for w in ws[-3:]:
        w.counts[(70, 30)] = 150  # +5 sigma, three windows
    [calm] = trace_rates(ws, now=1241, strained=lambda newest: False)
    assert calm.rps == pytest.approx(level)
    [pressed] = trace_rates(ws, now=1241, strained=lambda newest: True)
    assert pressed.rps == pytest.approx(15.0)  # the latest window
    [unjudged] = trace_rates(ws, now=1241)
    assert unjudged.rps == pytest.approx(15.0)


def test_the_burst_and_what_the_plan_made_of_it_are_reported() -> None:
    """For the operator (the dashboard, the optimizer's metrics): the burst's rate, the window's average
    it stands above, and whether it was planned for or left to the router."""
    ws = _steady()
    for w in ws[-3:]:
        w.counts[(70, 30)] = 150
    average = sum(sum(w.counts.values()) for w in ws) / 240
    calm = read_workload(ws, now=1241, strained=lambda newest: False).burst
    assert calm == Burst(15.0, pytest.approx(average), planned=False)
    assert read_workload(ws, now=1241, strained=lambda newest: True).burst == Burst(
        15.0, pytest.approx(average), planned=True)
    assert read_workload(ws, now=1241).burst.planned  # no judge: every burst is planned for
    assert read_workload(_steady(), now=1241, strained=lambda newest: False).burst is None


def test_the_judge_sees_the_newest_windows() -> None:
    ws = _steady()
    for w in ws[-2:]:
        w.counts[(70, 30)] = 150
    seen: list[list[int]] = []

    def judge(newest) -> bool:  # noqa: ANN001
        seen.append([w.end for w in newest])
        return False

    trace_rates(ws, now=1241, strained=judge)
    assert seen == [[1240, 1230]]


def test_an_absorbed_burst_leaves_the_average_when_it_is_over() -> None:
    """After the burst (no longer the newest windows), its windows stay out of the average while they
    are fewer than half of the window: the plan does not keep the fleet up for a burst it never needed."""
    ws = _steady()
    for w in ws[10:16]:
        w.counts[(70, 30)] = 160  # 60 s at +6 sigma, a minute and more ago
    rest = [w for k, w in enumerate(ws) if not 10 <= k < 16]
    [d] = trace_rates(ws, now=1241, strained=lambda newest: False)
    assert d.rps == pytest.approx(sum(sum(w.counts.values()) for w in rest) / 180)
    [d] = trace_rates(ws, now=1241)  # without a judge: averaged in
    assert d.rps == pytest.approx(sum(sum(w.counts.values()) for w in ws) / 240)


def test_a_level_change_is_averaged_in_once_it_fills_half_the_window() -> None:
    """Half the windows or more above the old level: the median has moved, so it is the load now."""
    ws = _steady()
    for w in ws[12:]:
        w.counts[(70, 30)] = 160
    [d] = trace_rates(ws, now=1241, strained=lambda newest: False)
    assert d.rps == pytest.approx(sum(sum(w.counts.values()) for w in ws) / 240)


def test_a_burst_as_long_as_half_the_window_is_no_level_while_the_windows_before_show_one() -> None:
    """The windows read before the window (READ_SPAN) count toward the level: a 120 s run above it,
    half the window but a quarter of what is read, stays an excursion while it lasts and once it is
    over, so a burst the fleet absorbed does not scale it up as it ends (`single-4090-h100pcie`'s)."""
    earlier = _steady(until=1000)
    for last in (24, 20):  # the run reaching the newest window, and over 40 s ago
        ws = _steady()
        for w in ws[last - 12:last]:
            w.counts[(70, 30)] = 160
        rest = [w for k, w in enumerate(ws) if not last - 12 <= k < last]
        [d] = trace_rates(earlier + ws, now=1241, strained=lambda newest: False)
        assert d.rps == pytest.approx(sum(sum(w.counts.values()) for w in rest) / 120)
        [d] = trace_rates(ws, now=1241, strained=lambda newest: False)  # the window alone: the level moved
        assert d.rps == pytest.approx(sum(sum(w.counts.values()) for w in ws) / 240)


def test_a_rise_filling_half_of_what_is_read_is_the_level() -> None:
    """A rise that has lasted the whole window is half the windows read: the median has moved, and it
    is averaged in (the strain path reads it at once whenever the fleet falls short before that)."""
    earlier = _steady(until=1000)
    ws = _steady()
    for w in ws:
        w.counts[(70, 30)] = 160
    [d] = trace_rates(earlier + ws, now=1241, strained=lambda newest: False)
    assert d.rps == pytest.approx(160 * 24 / 240)


def test_a_young_trace_keeps_every_window() -> None:
    """Before the trace covers the whole window there is no level to compare with (the model's first
    minutes ramp up): every window counts."""
    ws = _steady()[-6:]
    ws[-1].counts[(70, 30)] = 160
    [d] = trace_rates(ws, now=1241, strained=lambda newest: False)
    assert d.rps == pytest.approx(sum(sum(w.counts.values()) for w in ws) / 60)


def test_a_level_that_moved_down_is_averaged_as_before() -> None:
    """Windows above the median that start the window, and go back as far as the trace is read, are the
    old level of a load that fell, not an excursion: averaged in, so the plan comes down over the window
    as without a judge (leaving them out would drop it at once, on the few windows since, and turn it
    back up on their noise)."""
    earlier = _steady(until=1000)
    ws = _steady()
    for w in [*earlier, *ws[:10]]:
        w.counts[(70, 30)] = 160
    for read in (ws, earlier + ws):  # the window alone, and with the window length before it
        [d] = trace_rates(read, now=1241, strained=lambda newest: False)
        assert d.rps == pytest.approx(sum(sum(w.counts.values()) for w in ws) / 240)


def test_a_burst_whose_start_left_the_window_is_still_an_excursion() -> None:
    """The same windows above the median start the window, but the windows read before it show the
    level the burst rose from: its tail is left out of the average like the rest of it was."""
    earlier = _steady(until=1000)
    ws = _steady()
    for w in [*earlier[-3:], *ws[:6]]:
        w.counts[(70, 30)] = 160  # a 90 s burst, its first 30 s before the window
    rest = ws[6:]
    [d] = trace_rates(earlier + ws, now=1241, strained=lambda newest: False)
    assert d.rps == pytest.approx(sum(sum(w.counts.values()) for w in rest) / 180)
    [d] = trace_rates(ws, now=1241, strained=lambda newest: False)  # not read: it may be a level that fell
    assert d.rps == pytest.approx(sum(sum(w.counts.values()) for w in ws) / 240)
