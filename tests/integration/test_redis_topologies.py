"""Gateways sharing counts through a real Redis Cluster (3 masters + 3 replicas) and through a
Sentinel-watched master, each through a master killed and its replica promoted: sync recovers."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from extproc import redis_connect
from extproc.gpu_profiles import ProfileStore, profile_key
from extproc.pool.pod import Pod
from extproc.profiling.output import parse_redis_url, store_redis
from extproc.sharing.redis_sync import RedisState
from extproc.sharing.sync_core import running_key
from tests.support.redis_topologies import LocalCluster, LocalSentinel

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                                 reason="redis-server / redis-cli not installed")]

LLAMA = Pod("llama", "a100-0", "127.0.0.1:9", namespace="team")
MISTRAL = Pod("mistral", "l20-0", "127.0.0.1:10", namespace="team")  # another model: another slot


async def eventually(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


class Fleet:
    def __init__(self) -> None:
        self.states: list[RedisState] = []
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, where: redis_connect.RedisTarget, name: str) -> RedisState:
        state = RedisState(where, name, registry=CollectorRegistry())
        state.track([LLAMA, MISTRAL])
        self.states.append(state)
        self.tasks.append(asyncio.create_task(state.run()))
        return state

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for state in self.states:
            await state.close()


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = Fleet()
    yield f
    await f.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path)
    yield c
    c.stop()


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[LocalSentinel]:
    s = LocalSentinel(tmp_path)
    yield s
    s.stop()


def shared(a: RedisState, b: RedisState, pod: Pod, n: int) -> bool:
    return a.up and b.up and a.running(pod.key) == n and b.running(pod.key) == n


async def test_gateways_share_counts_through_a_cluster_and_survive_a_master_failover(cluster, fleet):
    where = redis_connect.target(None, "cluster", cluster.nodes)
    a, b = fleet.start(where, "gw-a"), fleet.start(where, "gw-b")
    a.add_running(LLAMA, 2)
    b.add_running(LLAMA, 1)
    b.add_running(MISTRAL, 4)
    await eventually(lambda: shared(a, b, LLAMA, 3) and shared(a, b, MISTRAL, 4), 10, "counts shared")
    now = time.time()
    evidence = [now, *(v for _ in range(4) for v in (now, 50.0, 400.0, 1.0, 4e3, 8.0, 0.02, 3.0))]
    a.share_speed(LLAMA.key, evidence)
    await eventually(lambda: LLAMA.key in b.peer_speed(), 10, "speed sums through the cluster")
    # The master holding llama's keys dies; its replica takes over its slots.
    master = cluster.master_of(running_key("llama"))
    cluster.kill(master)
    def promoted() -> bool:
        return cluster.healthy() and cluster.master_of(running_key("llama")) not in (master, None)

    await eventually(promoted, 30, "replica promoted")
    a.add_running(LLAMA, 1)
    b.add_running(MISTRAL, -1)
    await eventually(lambda: shared(a, b, LLAMA, 4) and shared(a, b, MISTRAL, 3), 15,
                     "counts shared again after the failover")


async def test_gateways_follow_the_master_sentinel_promotes(sentinel, fleet):
    where = redis_connect.target(None, "sentinel", sentinel.nodes, sentinel.master_name)
    a, b = fleet.start(where, "gw-a"), fleet.start(where, "gw-b")
    a.add_running(LLAMA, 2)
    b.add_running(LLAMA, 1)
    await eventually(lambda: shared(a, b, LLAMA, 3), 10, "counts shared")
    sentinel.kill(sentinel.master_port)
    await eventually(lambda: sentinel.master() == sentinel.replica_port, 30, "sentinel promotes the replica")
    a.add_running(LLAMA, 1)
    await eventually(lambda: shared(a, b, LLAMA, 4), 15, "counts shared again through the new master")


async def test_gen_profile_writes_and_the_gateway_reads_profiles_on_a_cluster(cluster, monkeypatch):
    """Profiles of several models (keys on several shards): gen-profile's output through the cluster
    variables, AIBrix's own keys, and the SLO refresh's reader (one pipeline of GETs, no MGET)."""
    monkeypatch.setenv("EXTPROC_REDIS_MODE", "cluster")
    monkeypatch.setenv("EXTPROC_REDIS_NODES", ",".join(cluster.nodes))
    models = [f"model-{i}" for i in range(6)]
    for i, model in enumerate(models):
        profile = {"gpu": "a100", "cost": 1.0, "tputs": [[float(i + 1)]], "indexes": [[8], [128]],
                   "e2e": [[1.0]], "slos": {"e2e": 10}, "created": 1.0}
        await asyncio.to_thread(store_redis, parse_redis_url(f"redis://unused:1/0?model={model}"), "a100",
                                profile)
    client = redis_connect.open_async(redis_connect.target(None, "cluster", cluster.nodes), timeout=2)
    try:
        slots = {await client.cluster_keyslot(profile_key(m, "a100")) for m in models}
        assert len(slots) > 1  # the keys do lie on several slots
        store = ProfileStore()
        assert await store.refresh_redis(client, {m: {"a100"} for m in models}) == len(models)
    finally:
        await client.aclose()
    for i, model in enumerate(models):
        found = store.profile_for(model, "default", "a100")
        assert found is not None and found.tputs[0][0] == float(i + 1)


async def budgets_hold(stores: list, where: redis_connect.RedisTarget, tag: str) -> None:
    """Two gateways' limit stores on `where`: budgets of several models (keys on several shards of a
    cluster) admit exactly what they hold when raced, and an output charge keeps both dimensions."""
    from extproc.ratelimit.redis_store import RedisStore
    from extproc.ratelimit.settings import Limits

    limits = Limits(requests=20, tokens=100_000)
    buckets = [f"model-{i}:key:{tag}" for i in range(4)]
    answers = await asyncio.gather(*(stores[i % 2].take(buckets[i % 4], limits, 10, None)
                                     for i in range(4 * 40)))
    assert all(isinstance(a, tuple) for a in answers)
    for i, bucket in enumerate(buckets):
        admitted = sum(verdict.admitted for j, (_, verdict) in enumerate(answers) if j % 4 == i)
        assert limits.requests <= admitted <= limits.requests + 1, (bucket, admitted)
    stores[1].charge(buckets[0], limits.tokens, 500)
    client = redis_connect.open_async(where, timeout=2)
    bucket = RedisStore.key(buckets[0])
    try:
        deadline = time.monotonic() + 10
        while float(await client.hget(bucket, "t")) > limits.tokens - 20 * 10 - 300:
            assert time.monotonic() < deadline, "the charge never landed"
            await asyncio.sleep(0.05)
        held = await client.hgetall(bucket)
        assert int(held[b"rl"]) == limits.requests and float(held[b"r"]) < 2  # requests still spent
        assert await client.pttl(bucket) > 50_000  # it lives until the requests budget is full
    finally:
        await client.aclose()


async def test_rate_limit_budgets_hold_on_a_cluster(cluster):
    from extproc.ratelimit.redis_store import RedisStore

    where = redis_connect.target(None, "cluster", cluster.nodes)
    client = redis_connect.open_async(where, timeout=2)
    stores = [RedisStore(where, timeout=2.0) for _ in range(2)]
    try:
        slots = {await client.cluster_keyslot(RedisStore.key(f"model-{i}:key:c")) for i in range(4)}
        assert len(slots) > 1  # the budgets lie on several shards
        for store in stores:
            await store.start()
        await budgets_hold(stores, where, "c")
    finally:
        await client.aclose()
        for store in stores:
            await store.close()


async def test_rate_limit_budgets_hold_through_a_sentinel_failover(sentinel):
    from extproc.ratelimit.redis_store import RedisStore
    from extproc.ratelimit.settings import Limits

    where = redis_connect.target(None, "sentinel", sentinel.nodes, sentinel.master_name)
    stores = [RedisStore(where, timeout=2.0) for _ in range(2)]
    try:
        for store in stores:
            await store.start()
        await budgets_hold(stores, where, "before")
        sentinel.kill(sentinel.master_port)
        await eventually(lambda: sentinel.master() == sentinel.replica_port, 30,
                         "sentinel promotes the replica")
        deadline = time.monotonic() + 15
        for store in stores:  # the same stores find the new master (after their back-off)
            while not isinstance(await store.take("probe:key:p", Limits(requests=1000), 0, None), tuple):
                assert time.monotonic() < deadline, "limits never came back after the failover"
                await asyncio.sleep(0.1)
        await budgets_hold(stores, where, "after")
    finally:
        for store in stores:
            await store.close()
