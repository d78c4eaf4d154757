"""`extproc bench sync` against a real redis-server, small: every view the bench holds against the
truth (counts, tokens, speed sums) is exact, and the speed sums were checked for every gateway and pod."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from extproc.perf import sync
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]


@pytest.mark.parametrize("collector", ["on", "frozen"])
def test_every_view_matches_the_truth(tmp_path: Path, collector: str) -> None:
    server = RedisServer(tmp_path)
    try:
        run = asyncio.run(sync.run_one(server.url, 3, 60, models=2, turns=20, warmup=2,
                                       collector=collector))
    finally:
        server.stop()
    summary = run.summary()
    assert summary["collector"] == collector
    assert summary["speed_sums_checked"] == 3 * 60
    assert (summary["wrong_views"], summary["wrong_token_counts"], summary["wrong_speed_sums"]) == (0, 0, 0)
    assert summary["timeouts"] == summary["failures"] == 0


def test_the_speed_read_as_bytes_gives_the_views_text_gave() -> None:
    """`extproc.perf.speed_read` raises when the two reads differ: small, it must run through."""
    from extproc.perf import speed_read

    assert speed_read.main(["--pods", "40", "--models", "2", "--rounds", "2"]) == 0


def test_gateways_side_by_side_each_count_every_token(tmp_path: Path) -> None:
    """`--processes`: a process per gateway, concurrently; every gateway counted every token the fleet
    completed on every pod, once, and each one's turns were measured."""
    from extproc.perf.sync_procs import run_processes
    from extproc.redis_connect import RedisTarget

    server = RedisServer(tmp_path)
    try:
        summary = run_processes(RedisTarget(server.url), 3, 60, models=2, turns=20, warmup=2,
                                progress=lambda line: None)
    finally:
        server.stop()
    assert summary["wrong_token_counts"] == 0
    assert summary["timeouts"] == summary["failures"] == 0
    assert summary["sync_cpu_ms_mean"] > 0 and summary["redis_commands_per_s"] > 0


def test_the_bench_reads_a_clusters_masters(tmp_path: Path) -> None:
    """`--redis-cluster`: the gateways share through a 3-master cluster; every view is exact and
    Redis's CPU is given for each master."""
    from extproc import redis_connect
    from tests.support.redis_topologies import LocalCluster

    cluster = LocalCluster(tmp_path, replicas=False)
    try:
        target = redis_connect.target(None, "cluster", cluster.nodes)
        summary = asyncio.run(sync.run_one(target, 2, 40, models=3, turns=20, warmup=2)).summary()
    finally:
        cluster.stop()
    assert (summary["wrong_views"], summary["wrong_token_counts"], summary["wrong_speed_sums"]) == (0, 0, 0)
    assert summary["speed_sums_checked"] == 2 * 40
    assert len(summary["redis_cores_per_shard"]) == 3
    assert summary["redis_cores"] == pytest.approx(sum(summary["redis_cores_per_shard"]), abs=0.01)
