"""The demo's figures from hand-built outcomes: p99, failures, cut-off requests, utilization."""

from __future__ import annotations

import pytest

from extproc.demo.load import Outcome
from extproc.demo.report import p99, summarise, table

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
