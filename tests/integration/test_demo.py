"""`extproc demo` end to end on short phases: real Envoy, the gateway and three simulated engines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.demo.plan import POOL, STRATEGIES


def test_demo_runs_and_reports_every_pod_for_every_strategy(tmp_path: Path):
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    proc = subprocess.run([sys.executable, "-m", "extproc", "demo", "--phases", "2,5,10", "--load", "0.3",
                           "--strategies", "round-robin,load-balance", "--json", str(out), "--png", str(png)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "utilization" in proc.stdout and "p99 latency s" in proc.stdout
    report = json.loads(out.read_text())
    assert list(report["strategies"]) == ["round-robin", "load-balance"]
    for name, result in report["strategies"].items():
        assert result["header"] == STRATEGIES[name]
        assert result["requests"] > 10 and result["failed"] == 0, result
        assert set(result["pods"]) == {n for n, _ in POOL}
        for pod, gpu in POOL:
            p = result["pods"][pod]
            assert p["gpu"] == gpu
            assert 0 <= p["utilization"] < 1.5, (name, pod, p)
            if p["qps"] > 0:
                assert p["output_tokens_per_s"] > 0 and p["p99_latency_s"] > 0, (name, pod, p)
    rr = report["strategies"]["round-robin"]["pods"]
    counts = [rr[n]["qps"] for n, _ in POOL]
    assert min(counts) > 0, counts
    assert max(counts) - min(counts) <= 0.2 * max(counts) + 0.4, counts  # round-robin: equal shares
    # load-balance at 30 % load: the A100, quicker per token even loaded than an idle L20, takes the
    # most (under capacity: speed often all of it; equal utilization is not load-balance's aim)
    lb = report["strategies"]["load-balance"]["pods"]
    assert lb["a100-0"]["qps"] > max(lb["l20-0"]["qps"], lb["l20-1"]["qps"]), lb
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_burst_runs_least_request_and_both_capacity_modes_on_the_same_arrivals(tmp_path: Path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "extproc", "demo", "--quick", "--burst", "--phases",
                           "2,4,5", "--strategies", "load-balance", "--json", str(out),
                           "--png", str(tmp_path / "d.png")], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "capacity tok/s" in proc.stdout and "cap start" in proc.stdout
    report = json.loads(out.read_text())
    baseline = report["strategies"]["least-request (burst)"]
    observed = report["strategies"]["load-balance (observed)"]
    speed = report["strategies"]["load-balance (speed)"]
    assert list(report["strategies"]) == ["load-balance", "least-request (burst)", "load-balance (observed)",
                                          "load-balance (speed)"]
    assert (observed["capacity_mode"], speed["capacity_mode"]) == ("observed", "speed")
    assert baseline["rate_rps"] == observed["rate_rps"] == speed["rate_rps"] == report["burst"]["rate_rps"] \
        > report["rate_rps"]
    # the same seeded arrivals in every window
    assert baseline["requests"] == observed["requests"] == speed["requests"] > 10
    assert baseline["header"] == STRATEGIES["least-request"]
    for result in (baseline, observed, speed):
        assert result["failed"] == 0 and result["ttft_p99_s"] > 0, result  # the engines' histograms
        for pod, _ in POOL:
            cap = result["pods"][pod]["capacity_tokens_per_s"]
            assert cap["start"] > 0 and cap["end"] > 0, (pod, cap)
            assert result["pods"][pod]["peak_waiting"] >= 0
    for result in (observed, speed):
        assert result["header"] == STRATEGIES["load-balance"], result
    for pod, gpu in POOL:
        seen, fitted = observed["pods"][pod], speed["pods"][pod]
        # capacity: observed -> the capacity gauge is the observed rate itself
        assert seen["capacity_tokens_per_s"]["end"] == pytest.approx(seen["observed_tokens_per_s_end"])
        # capacity: speed -> the fitted saturated figure: above what a pod short of saturation was seen to
        # produce, and near the engine model's saturated throughput
        end = fitted["capacity_tokens_per_s"]["end"]
        assert end > fitted["observed_tokens_per_s_end"], (pod, fitted)
        assert 0.5 < end / report["saturated_tokens_per_s"][gpu] < 2, (pod, end)
