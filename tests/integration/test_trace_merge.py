"""Request traces from several gateways merge exactly in a real redis-server (tracing.merge): the
optimizer reads the sum of what every gateway saw, not the last writer's share."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis import asyncio as aioredis

from extproc.optimizer.traces import read_windows
from extproc.optimizer.workload import parse_trace, trace_rates
from extproc.tracing import TraceFlusher, TraceRecorder, trace_key
from extproc.tracing.merge import WindowMerger
from extproc.tracing.window import tpot_bucket
from tests.support.redis_server import RedisServer

MODEL = "m"
END = 1_700_000_010  # the window [END - 10, END)
AT = END - 5.0


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("trace-merge")))
    yield server
    server.stop()


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_server.url)
    await c.flushdb()
    yield c
    await c.aclose()


def gateway_window(arrived: int, shapes: dict[tuple[int, int], int], pending: int,
                   tpot: dict[str, list[float]] | None = None,
                   rejected: list[list[str]] | None = None) -> TraceRecorder:
    """One gateway's recorder after a window of traffic."""
    r = TraceRecorder()
    for _ in range(arrived):
        r.arrived(MODEL, AT)
    for (prompt, output), n in shapes.items():
        for _ in range(n):
            r.completed(MODEL, prompt, output, AT)
    for deployment, tpots in (tpot or {}).items():
        for t in tpots:  # TTFT 10x the TPOT, E2E 100x, TPAT the E2E over 192 tokens: each its own
            r.completed(MODEL, 128, 64, AT, deployment, t, 10 * t, 100 * t)
    for lane in rejected or []:
        r.rejected(MODEL, lane, AT)
    r.snapshot(MODEL, pending=pending, queueing=1)
    return r


async def flush_all(url: str, recorders: list[TraceRecorder], now: float = END + 1.0) -> None:
    """Each gateway with its own connection, all at once."""
    clients = [aioredis.Redis.from_url(url) for _ in recorders]
    try:
        written = await asyncio.gather(*(TraceFlusher(c, r).flush(now) for c, r in zip(clients, recorders)))
        assert written == [1] * len(recorders)
    finally:
        for c in clients:
            await c.aclose()


async def stored(client: aioredis.Redis) -> dict:
    return json.loads(await client.get(trace_key(MODEL, END)))


async def test_three_gateways_windows_add_up(redis_server: RedisServer, client: aioredis.Redis) -> None:
    gateways = [
        gateway_window(7, {(128, 8): 5, (1000, 100): 2}, pending=2, tpot={"ns/a100": [0.020, 0.020]},
                       rejected=[["ns/a100"], ["ns/a100", "ns/l20"]]),
        gateway_window(4, {(128, 8): 3}, pending=0, tpot={"ns/a100": [0.020], "ns/l20": [0.045]},
                       rejected=[["ns/l20"]]),
        gateway_window(9, {(16, 16): 9}, pending=5),
    ]
    await flush_all(redis_server.url, gateways)
    value = await stored(client)
    assert {k: v for k, v in value.items() if not k.startswith("meta_")} == {
        "70:30": 5 + 3, "100:66": 2, "40:40": 9, "70:60": 2 + 2}  # 70:60: the requests with a TPOT
    window = parse_trace(END, value)
    assert window.arrived == 7 + 4 + 9
    assert window.pending == 2 + 0 + 5 and window.queueing == 3
    assert (window.precision, window.interval) == (10, 10) and value["meta_v"] == 4
    a100, l20 = tpot_bucket(0.020), tpot_bucket(0.045)
    assert window.tpot == {"ns/a100": {a100: 3}, "ns/l20": {l20: 1}}
    assert window.ttft == {"ns/a100": {tpot_bucket(0.2): 3}, "ns/l20": {tpot_bucket(0.45): 1}}
    assert window.e2e == {"ns/a100": {tpot_bucket(2.0): 3}, "ns/l20": {tpot_bucket(4.5): 1}}
    assert window.tpat == {"ns/a100": {tpot_bucket(2.0 / 192): 3}, "ns/l20": {tpot_bucket(4.5 / 192): 1}}
    assert window.rejected == {"ns/a100": 2, "ns/l20": 2}  # refusals per deployment, each lane member
    assert len(value["meta_writers"]) == 3
    assert 590 <= await client.ttl(trace_key(MODEL, END)) <= 600


async def test_a_repeated_write_id_is_merged_once(client: aioredis.Redis) -> None:
    [(key, raw)] = gateway_window(3, {(128, 8): 3}, pending=1).due(END + 1.0)
    merger = WindowMerger(client)
    assert await merger.merge(key, raw, 600, "gw-a.1") is True
    assert await merger.merge(key, raw, 600, "gw-a.1") is False  # a retry of a write that landed
    assert await merger.merge(key, raw, 600, "gw-b.1") is True
    value = await stored(client)
    assert value["70:30"] == 6 and value["meta_total_reqs"] == 6
    assert value["meta_writers"] == ["gw-a.1", "gw-b.1"]


async def test_a_window_set_by_aibrix_gateway_keeps_its_counts(client: aioredis.Redis) -> None:
    """An AIBrix gateway SETs its own value: ours adds to it (it would overwrite ours, as it always did)."""
    await client.set(trace_key(MODEL, END), json.dumps({"70:30": 4, "meta_v": 3, "meta_precision": 10,
                                                        "meta_interval_sec": 10, "meta_total_reqs": 4,
                                                        "meta_pending_reqs": 1}))
    [(key, raw)] = gateway_window(2, {(128, 8): 2}, pending=0).due(END + 1.0)
    assert await WindowMerger(client).merge(key, raw, 600, "gw-a.1")
    window = parse_trace(END, await stored(client))
    assert window.counts == {(70, 30): 6} and window.arrived == 6 and window.pending == 1


async def test_a_value_that_is_not_a_window_is_replaced(client: aioredis.Redis) -> None:
    await client.set(trace_key(MODEL, END), "not json")
    [(key, raw)] = gateway_window(2, {(128, 8): 2}, pending=0).due(END + 1.0)
    assert await WindowMerger(client).merge(key, raw, 600, "gw-a.1")
    assert parse_trace(END, await stored(client)).counts == {(70, 30): 2}


async def test_the_optimizer_rates_equal_the_requests_all_gateways_sent(redis_server: RedisServer,
                                                                        client: aioredis.Redis) -> None:
    """Three gateways over six windows: the optimizer's rate is every request sent over its window."""
    sent = 0
    for k in range(6):
        end = END + 10 * k
        recorders = []
        for g in range(3):
            n = 3 + g + k  # each gateway its own share
            r = TraceRecorder()
            for _ in range(n):
                r.arrived(MODEL, end - 5.0)
                r.completed(MODEL, 128, 8, end - 5.0)
            recorders.append(r)
            sent += n
        await flush_all(redis_server.url, recorders, end + 1.0)
    now = END + 10 * 5 + 30.0  # the latest window is no longer "current": the plan reads the average
    windows = await read_windows(client, MODEL, now, 240.0)
    assert sum(w.arrived for w in windows) == sum(w.completed for w in windows) == sent
    [demand] = trace_rates(windows, now, 240.0)
    covered = now - (END - 10)  # the trace is younger than the window: its rate is over what it covers
    assert demand.rps == pytest.approx(sent / covered, rel=1e-12)
