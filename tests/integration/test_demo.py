"""`extproc demo` end to end on short phases: real Envoy, the gateway and three simulated engines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
            assert p["qps"] > 0 and p["output_tokens_per_s"] > 0, (name, pod, p)
            assert 0 < p["utilization"] < 1.5 and p["p99_latency_s"] > 0
    rr = report["strategies"]["round-robin"]["pods"]
    counts = [rr[n]["qps"] for n, _ in POOL]
    assert max(counts) - min(counts) <= 0.2 * max(counts) + 0.4, counts  # round-robin: equal shares
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
