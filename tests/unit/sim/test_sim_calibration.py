"""The engine model against the published vLLM measurements in data/calibration/ (issue 43's bar).

Reads the committed CSV and replays every row in virtual time with the committed presets; the team reruns
this on rows it holds back, so nothing here knows which rows are held out beyond the CSV's own split."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from extproc.sim import calibration as cal
from extproc.sim.calibrate import add_arguments, run
from extproc.sim.efficiency import BOUNDS, FITTED, GPU_CLASS, efficiency_for
from extproc.sim.gpus import GPUS
from extproc.sim.perf import PerfParams


@pytest.fixture(scope="module")
def rows() -> list[cal.Measurement]:
    return cal.load()


@pytest.fixture(scope="module")
def results(rows: list[cal.Measurement]) -> list[cal.Result]:
    return cal.simulate(rows)


def test_the_set_is_as_wide_as_the_issue_asks(rows: list[cal.Measurement]) -> None:
    assert len(rows) >= 30
    assert len({m.workload.gpu for m in rows}) >= 6
    concurrencies = {m.workload.concurrency for m in rows}
    assert min(concurrencies) == 1 and max(concurrencies) >= 64
    assert {"output_throughput", "ttft", "tpot"} <= {m.figure for m in rows}
    assert all(m.workload.source_url.startswith("https://") for m in rows)
    assert len({m.id for m in rows}) == len(rows)
    # Both sides of the split hold rows, and a run's figures never straddle it.
    assert {m.split for m in rows} == {"fit", "holdout"}
    by_run: dict[str, set[str]] = {}
    for m in rows:
        by_run.setdefault(m.workload.key(), set()).add(m.split)
    assert all(len(s) == 1 for s in by_run.values())


def test_held_out_rows_meet_the_bar(results: list[cal.Result]) -> None:
    checks = [c for c in cal.acceptance(results) if c.name.startswith("held-out")]
    assert any("time per output token" in c.name for c in checks)
    assert any("output throughput" in c.name for c in checks)
    assert any("TTFT" in c.name for c in checks)
    failed = [f"{c.name}: {c.value:.1%} > {c.limit:.0%}" for c in checks if not c.ok]
    assert not failed, failed


# The shared calibration.md points the model does not bring within 10 %, at the error they have now. Why
# the replay's form does not (arithmetic from the sources' own figures, grids): data/calibration/README.md,
# "Shared points outside 10 %". RTX 4090 TTFT: C = 8 and C = 48 need a delay outside the engine that grows
# convexly with the streams (medians: >= 7.8 ms per stream between them, yet <= 32.5 ms in all at C = 8;
# checked by the next test); the replay's is linear and shared by both hosts. A100 C=8 speed-up: reachable
# only with prefill MFU >= 0.8. Listed so they are seen, and bounded so they cannot silently get worse.
KNOWN_GAPS = {
    "musgrave-c8-speedup": 0.15,
    "mr4090-c4-ttft-mean": 0.35,
    "mr4090-c8-ttft-mean": 0.50,
    "mr4090-c16-ttft-mean": 0.20,
    "mr4090-c48-ttft-mean": 0.15,
}


def test_shared_calibration_points(results: list[cal.Result]) -> None:
    shared = [r for r in results if r.measurement.in_shared_calibration]
    assert len(shared) >= 12  # calibration.md's A100 decode and speed-up, RTX 4090 throughput and TTFT
    for r in shared:
        limit = KNOWN_GAPS.get(r.measurement.id, 0.10)
        assert abs(r.error) <= limit, f"{r.measurement.id}: {r.error:+.1%} (limit {limit:.0%})"
    within = [r for r in shared if r.measurement.id not in KNOWN_GAPS]
    assert {r.measurement.figure for r in within} >= {"decode_rate", "output_throughput"}


# The source's p99 TTFT at C = 48 (mushfiqrahman.dev, same table as the CSV's rows; the CSV holds no p99).
RTX4090_C48_P99_TTFT_S = 1.483


def test_the_rtx4090_ttft_gap_is_in_the_sources_own_figures(rows: list[cal.Measurement]) -> None:
    """The arithmetic of data/calibration/README.md, "Shared points outside 10 %", from the CSV and the
    presets' datasheet peaks: no API-server delay a + b x streams in flight (the replay's form) gives
    the RTX 4090 host's median TTFT at both C = 8 and C = 48, whatever the engine's efficiencies."""
    from extproc.sim.gpus import get_gpu
    from extproc.sim.models import get_model

    by_id = {m.id: m for m in rows}
    w8, w48 = by_id["mr4090-c8-ttft-median"].workload, by_id["mr4090-c48-ttft-median"].workload
    gpu, model = get_gpu(w48.gpu), get_model(w48.model)
    # C = 8: half the requests had TTFT <= the median, most sent after the start with 7 others in
    # flight; each needs at least its prefill at the full tensor peak.
    assert w8.num_prompts / 2 > w8.concurrency  # the median is not the start burst's
    prefill_floor = model.flops_per_token * w8.input_tokens / gpu.flops_per_s
    outside_8 = by_id["mr4090-c8-ttft-median"].value / 1000 - prefill_floor  # at most
    # C = 48: half had TTFT >= the median; after the start one arrives per few steps, so the engine holds
    # it for two steps at most, each no longer than the start burst's full-budget steps, which end
    # before the p99.
    budget = cal.vllm_serve_defaults(w48.gpu).max_num_batched_tokens
    assert w48.num_prompts / 2 > w48.concurrency
    burst_steps = w48.concurrency * w48.input_tokens // budget
    req_s = by_id["mr4090-c48-tput"].value / w48.output_tokens
    latency = w48.concurrency / req_s  # Little's law
    per_token = (latency - by_id["mr4090-c48-ttft-mean"].value / 1000) / (w48.output_tokens - 1)
    assert req_s * per_token * w48.input_tokens < budget / 2  # arrivals per step fit the budget
    outside_48 = by_id["mr4090-c48-ttft-median"].value / 1000 - 2 * RTX4090_C48_P99_TTFT_S / burst_steps
    slope = (outside_48 - outside_8) / ((w48.concurrency - 1) - (w8.concurrency - 1))
    intercept = outside_8 - (w8.concurrency - 1) * slope
    assert slope > 0.005 and intercept < 0, (slope, intercept)
    readme = (cal.DEFAULT_CSV.parent / "README.md").read_text(encoding="utf-8")
    assert "Shared points outside 10 %" in readme and "test_the_rtx4090_ttft_gap_is_in_the_sources" in readme


def test_fitted_efficiencies_stay_within_physical_bounds() -> None:
    for gpu in GPUS:
        eff = efficiency_for(gpu)
        for name, (lo, hi) in BOUNDS.items():
            assert lo <= getattr(eff, name) <= hi, (gpu, name)
    # Every measured GPU has its own values; every preset belongs to a class.
    assert set(FITTED) <= set(GPUS) and set(GPUS) <= set(GPU_CLASS)
    # A preset without measurements takes its class's values.
    assert efficiency_for("V100") == efficiency_for("B200") != efficiency_for("T4")


def test_a_step_batches_as_engines_do() -> None:
    from extproc.sim.gpus import get_gpu
    from extproc.sim.models import get_model
    from extproc.sim.perf import PerfModel

    m = PerfModel(get_gpu("H100"), get_model("llama3-8b"))
    one, sixteen = m.decode_step_time(1, 1000), m.decode_step_time(16, 1000)
    # Sixteen sequences cost more than one (KV reads and per-sequence work grow) but far less than 16x.
    assert 1.1 * one < sixteen < 3 * one
    # Longer contexts make a decode step slower: attention reads every cached token.
    assert m.decode_step_time(16, 8000) > 1.5 * sixteen
    # A prefill chunk is compute bound: 2048 tokens cost far more than a decode step.
    assert m.step_time(2048, 1, 2048, 2048 * 2049 / 2) > 10 * one
    # An explicit override still wins over the fitted value.
    slow = PerfModel(get_gpu("H100"), get_model("llama3-8b"), params=PerfParams(mem_efficiency=0.4))
    assert slow.decode_step_time(1, 1000) > 1.5 * one


def test_replay_follows_the_benchmarks_loop() -> None:
    w = cal.Workload("https://example.invalid", "A100-80GB", "llama3-8b", 512, 64, 64, 4, None, 40)
    run_ = cal.replay(w, PerfParams(), cal.Frontend(0.01, 0.0))
    assert len(run_.finished) == 40 and all(s.num_output == 64 for s in run_.finished)
    # No request's first token comes before the frontend has handed it over.
    assert min(s.first_token_time - s.arrival for s in run_.finished) >= 0.01
    # Never more than four in flight: the span is at least 10 rounds of one request's lifetime.
    lifetime = min(s.finish_time - s.arrival for s in run_.finished)
    assert run_.duration >= 10 * lifetime * 0.99


def test_output_lengths_keep_the_published_mean() -> None:
    w = cal.Workload("https://example.invalid", "A40", "llama3.1-8b", 100, 443, 600, 50, None, 5000)
    lengths = w.output_lengths()
    assert max(lengths) == 600 and min(lengths) >= 1
    assert abs(sum(lengths) / len(lengths) - 443) < 10
    fixed = cal.Workload("https://example.invalid", "A40", "llama3.1-8b", 100, 128, 128, 4, None, 8)
    assert fixed.output_lengths() == [128] * 8


def test_a_bad_row_is_refused_naming_line_and_column(tmp_path: Path) -> None:
    text = cal.DEFAULT_CSV.read_text(encoding="utf-8").splitlines()
    header, first = text[0], next(csv.DictReader(io.StringIO("\n".join(text[:2]))))
    bad = tmp_path / "bad.csv"
    for column, value, expect in (("concurrency", "many", "'concurrency' is not a number"),
                                  ("figure", "vibes", "figure 'vibes'"),
                                  ("gpu", "GTX480", "unknown GPU"),
                                  ("value", "", "'value' is empty")):
        row = dict(first, **{column: value})
        buf = io.StringIO()
        csv.DictWriter(buf, fieldnames=header.split(",")).writerow(row)
        bad.write_text(header + "\n" + buf.getvalue(), encoding="utf-8")
        with pytest.raises(cal.CalibrationDataError, match="line 2") as err:
            cal.load(bad)
        assert expect in str(err.value)


def test_the_command_prints_rows_summaries_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--split", "holdout", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] and all(r["split"] == "holdout" for r in out["rows"])
    assert {"by_gpu", "by_figure"} <= set(out["summary"]["holdout"])
    assert all("ok" in c for c in out["acceptance"])
    assert run(parser.parse_args([])) == 0
    text = capsys.readouterr().out
    assert "held-out rows (never fitted)" in text and "acceptance (issue 43)" in text
    assert run(parser.parse_args(["--csv", "/nonexistent.csv"])) == 2
