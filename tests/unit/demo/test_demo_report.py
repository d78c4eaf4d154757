"""The demo's figures from hand-built outcomes: p99, failures, cut-off requests, utilization; --burst's
capacity columns and how the demo tells which capacity mode the gateway's gauges show."""

from __future__ import annotations

import pytest

from extproc.config import parse
from extproc.demo.__main__ import CAPACITY, OBSERVED, gateway_config, mode_shown
from extproc.demo.open_loop import Outcome
from extproc.demo.report import PhaseResult, p99, quantile_from_buckets, summarise, table

POOL = [("slow", "L20"), ("fast", "A100-80GB")]
SATURATED = {"L20": 1000.0, "A100-80GB": 2000.0}


def outcome(pod: str, latency: float, status: int = 200, unfinished: bool = False) -> Outcome:
    return Outcome(sent_at=0.0, pod=pod, status=status, latency_s=latency, output_tokens=10,
                   unfinished=unfinished)


def test_p99_is_nearest_rank():
    assert p99([]) is None
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([3.0, 1.0, 2.0]) == 3.0


def test_summary_counts_failures_and_cut_offs_and_divides_by_saturation():
    measured = [outcome("slow", 1.0)] * 10 + [outcome("fast", 0.5)] * 20 + [outcome("", 9.0, status=503)]
    r = summarise("load-balance", "load-balance", measured, POOL, {"slow": 5000.0, "fast": 10000.0},
                  SATURATED, seconds=10.0)
    assert (r.requests, r.failed, r.unfinished, r.p99_is_lower_bound) == (31, 1, 0, False)
    assert r.pods["slow"].qps == 1.0 and r.pods["fast"].qps == 2.0
    assert r.pods["slow"].utilization == pytest.approx(0.5) and r.pods["fast"].utilization == pytest.approx(0.5)
    assert r.pods["fast"].p99_latency_s == 0.5 and r.p99_latency_s == 1.0

    cut = measured + [Outcome(sent_at=0.0, latency_s=30.0, unfinished=True)]
    r = summarise("round-robin", "round-robin", cut, POOL, {}, SATURATED, seconds=10.0)
    assert (r.failed, r.unfinished, r.p99_is_lower_bound, r.p99_latency_s) == (1, 1, True, 30.0)
    assert ">" in table([r])  # a lower bound is shown as one


def burst_result(mode: str, slow_capacity: float) -> PhaseResult:
    r = summarise(f"load-balance ({mode})", "load-balance", [outcome("slow", 1.0), outcome("fast", 0.5)],
                  POOL, {"slow": 100.0, "fast": 100.0}, SATURATED, seconds=1.0)
    r.capacity_mode, r.rate_rps = mode, 50.0
    r.pods["slow"].capacity_start = r.pods["slow"].capacity_end = slow_capacity
    r.pods["fast"].capacity_start, r.pods["fast"].capacity_end = 1500.0, 1900.0
    return r


def test_burst_phases_show_and_export_the_reported_capacity():
    plain = summarise("load-balance", "load-balance", [outcome("slow", 1.0)], POOL, {}, SATURATED, 1.0)
    observed, speed = burst_result("observed", 271.0), burst_result("speed", 987.0)
    text = table([plain, observed, speed], SATURATED)
    assert text.count("cap start") == 2  # the burst blocks only
    block = text[text.index("capacity tok/s"):].splitlines()
    assert block[1].split() == ["saturated", "1000", "2000"]
    assert block[2].split()[-2:] == ["271", "1900"] and block[3].split()[-2:] == ["987", "1900"]
    assert "capacity tok/s" not in table([plain])
    assert "capacity_tokens_per_s" not in plain.as_json()["pods"]["slow"]
    pod = speed.as_json()["pods"]["fast"]
    assert pod["capacity_tokens_per_s"] == {"start": 1500.0, "end": 1900.0}
    assert speed.as_json()["capacity_mode"] == "speed"


def test_burst_phases_show_the_engines_queues_and_ttft():
    observed, speed = burst_result("observed", 271.0), burst_result("speed", 987.0)
    observed.pods["slow"].peak_waiting, observed.pods["fast"].peak_waiting = 9, 2
    speed.pods["slow"].peak_waiting, speed.pods["fast"].peak_waiting = 3, 4
    observed.ttft_p99_s, speed.ttft_p99_s = 0.293, 0.214
    text = table([observed, speed], SATURATED)
    rows = text[text.index("burst: queue"):].splitlines()
    assert rows[1].split()[-3:] == ["9", "2", "293"] and rows[2].split()[-3:] == ["3", "4", "214"]
    assert "TTFT p99 214 ms" in text
    assert speed.as_json()["ttft_p99_s"] == 0.214 and speed.as_json()["pods"]["slow"]["peak_waiting"] == 3


def test_quantile_from_buckets_interpolates_inside_the_bucket():
    assert quantile_from_buckets([], 0.99) is None
    assert quantile_from_buckets([(0.1, 0.0), (float("inf"), 0.0)], 0.99) is None
    # 100 observations: 50 up to 0.1 s, 40 more up to 0.25 s, the last 10 up to 0.5 s
    buckets = [(0.1, 50.0), (0.25, 90.0), (0.5, 100.0), (float("inf"), 100.0)]
    assert quantile_from_buckets(buckets, 0.5) == pytest.approx(0.1)
    assert quantile_from_buckets(buckets, 0.7) == pytest.approx(0.1 + 0.15 * 20 / 40)
    assert quantile_from_buckets(buckets, 0.99) == pytest.approx(0.25 + 0.25 * 9 / 10)
    assert quantile_from_buckets([(1.0, 10.0), (float("inf"), 20.0)], 0.99) == 1.0  # past the last bound


def test_mode_shown_reads_the_capacity_mode_from_the_gauges():
    assert mode_shown({CAPACITY: {"a": 900.0}, OBSERVED: {}}) is None  # nothing to compare yet
    assert mode_shown({CAPACITY: {"a": 300.0, "b": 800.0}, OBSERVED: {"a": 300.0, "b": 800.0}}) == "observed"
    assert mode_shown({CAPACITY: {"a": 1600.0, "b": 800.0}, OBSERVED: {"a": 300.0, "b": 800.0}}) == "speed"


def test_the_burst_config_sets_only_the_capacity_mode():
    ports = {"l20-0": 1, "l20-1": 2, "a100-0": 3}
    assert "routing" not in gateway_config(ports)
    observed = gateway_config(ports, "observed")
    assert observed["routing"] == {"load_balance": {"capacity": "observed"}}
    assert observed["models"] == gateway_config(ports)["models"]
    for mode in ("observed", "speed"):  # what the gateway will read: the mode as written, nothing else
        settings = parse(gateway_config(ports, mode), {}).routing_settings
        assert settings.load_balance.capacity == mode


def test_the_demos_help_prints(capsys) -> None:
    # `extproc demo --help` once crashed in argparse: a bare % in a help string is a format directive
    from extproc.demo.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--burst-factor X the burst's rate" in out and "% of the pool's saturated throughput" in out
