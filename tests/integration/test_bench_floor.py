"""`extproc bench floor`: a trivial ext_proc server in its own process, measured per stream; and the
process-tree CPU the overhead bench charges to `serve --workers`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from extproc.perf.floor import run
from extproc.perf.stats import cpu_seconds, tree_cpu_seconds


def test_each_server_answers_every_stream_and_its_cpu_is_counted(tmp_path: Path):
    runs = run(("aio", "sync"), (0.0,), concurrency=4, duration=0.5, rounds=1, threads=4, log_dir=tmp_path)
    for key in ("aio@0", "sync@0"):
        (result,) = runs[key]
        assert result["errors"] == 0
        assert result["streams_per_s"] > 10
        assert 1 < result["server_us_per_stream"] < 1e6  # measured, not zero and not NaN


def test_a_process_trees_cpu_includes_its_childrens():
    # the parent only waits; its child burns CPU for a while
    child = "sum(i * i for i in range(20_000_000))"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"])
    try:
        deadline, tree, own = time.monotonic() + 30, 0.0, 0.0
        while time.monotonic() < deadline and parent.poll() is None and tree < 0.5:
            tree, own = max(tree, tree_cpu_seconds(parent.pid)), cpu_seconds(parent.pid)
            time.sleep(0.02)  # poll interval
        assert tree >= 0.5 > own
    finally:
        parent.wait(timeout=60)  # the child's work is bounded: both end by themselves
