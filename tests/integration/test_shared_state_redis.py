"""RedisState against a real redis-server: two "gateways" in one event loop share running counts
and tokens, in AIBrix's layout; liveness, Redis dying and returning, and a password-protected Redis."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import shutil
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from extproc.environment import redis_url_from_env
from extproc.localstack import Proc, free_port
from extproc.pool.pod import Pod
from extproc.sharing import speed_sums
from extproc.sharing.redis_sync import RedisState

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]

POD = Pod("llama", "a100-0", "127.0.0.1:9", namespace="team")
ONLY_A = Pod("llama", "l20-0", "127.0.0.1:10", namespace="team")
AIBRIX_ROW_FIELDS = {"gateway_instance_id", "pod_uid", "pod_name", "namespace", "node_name",
                     "requests_running", "seq", "update_time"}
PASSWORD = "s3cr3t-Pa55"


class RedisProc:
    def __init__(self, log_dir: Path, port: int, *extra: str) -> None:
        self.port = port
        self.extra = extra
        self.log_dir = log_dir
        self.proc: Proc | None = None

    def start(self) -> None:
        self.proc = Proc(f"redis-{self.port}-{time.monotonic_ns()}",
                         ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", *self.extra], self.log_dir)
        self.proc.wait_ready(self._accepts, timeout=15)

    def _accepts(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
            return reply.startswith(b"+PONG") or b"NOAUTH" in reply

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProc]:
    server = RedisProc(tmp_path, free_port())
    server.start()
    yield server
    server.stop()


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float, what: str) -> float:
    """Poll until `check` holds; returns the seconds it took."""
    start = time.monotonic()
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


class Gateways:
    """RedisStates with their sync loops running in this event loop."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.states: list[RedisState] = []
        self.registries: dict[str, CollectorRegistry] = {}

    def start(self, url: str, name: str, **kw: object) -> RedisState:
        registry = CollectorRegistry()
        state = RedisState(url, name, registry=registry, **kw)
        self.registries[state.field] = registry
        state.track([POD, ONLY_A])
        self.states.append(state)
        self.tasks[state.field] = asyncio.create_task(state.run())
        return state

    async def silence(self, state: RedisState) -> None:
        """Stop a gateway's loop without a goodbye, as a crash would."""
        task = self.tasks.pop(state.field)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for state in self.states:
            await state.close()


@pytest.fixture
async def gateways() -> AsyncIterator[Gateways]:
    gws = Gateways()
    yield gws
    await gws.close()


@pytest.fixture
async def raw(redis_server: RedisProc) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


async def test_two_gateways_see_the_same_running_count(redis_server, gateways, raw):
    a = gateways.start(redis_server.url, "gw-a")
    b = gateways.start(redis_server.url, "gw-b")
    for _ in range(3):
        a.add_running(POD, 1)
    b.add_running(POD, 1)
    await eventually(lambda: a.running(POD.key) == 4 and b.running(POD.key) == 4, 5, "both see 4")
    assert (a.local_running(POD.key), b.local_running(POD.key)) == (3, 1)
    assert a.up and b.up
    # A pod only gateway A routes to is still seen by B.
    a.add_running(ONLY_A, 2)
    await eventually(lambda: b.running(ONLY_A.key) == 2, 5, "B sees A's pod")
    assert b.local_running(ONLY_A.key) == 0
    # Requests ending at A reach B too.
    a.add_running(POD, -3)
    await eventually(lambda: b.running(POD.key) == 1, 5, "B sees A's requests end")


async def test_tokens_counted_at_one_gateway_reach_the_other_once(redis_server, gateways):
    a = gateways.start(redis_server.url, "gw-a")
    b = gateways.start(redis_server.url, "gw-b")
    await eventually(lambda: a.up and b.up, 5, "both up")
    a.add_tokens(ONLY_A, 300)
    total_b: dict = {}
    total_a: dict = {}

    def collected() -> bool:
        for state, total in ((a, total_a), (b, total_b)):
            for key, n in state.take_token_deltas().items():
                total[key] = total.get(key, 0) + n
        return total_b.get(ONLY_A.key) == 300 and total_a.get(ONLY_A.key) == 300

    await eventually(collected, 5, "300 tokens at both")
    a.add_tokens(ONLY_A, 50)
    b.add_tokens(ONLY_A, 7)
    await eventually(lambda: not collected() and total_b.get(ONLY_A.key) == 357 == total_a.get(ONLY_A.key),
                     5, "357 tokens at both")
    await asyncio.sleep(1.3)  # past a heartbeat (token totals are read once one): nothing counted twice
    collected()
    assert total_a == total_b == {ONLY_A.key: 357}


async def test_layout_totals_per_model_and_a_ledger_per_gateway(redis_server, gateways, raw):
    a = gateways.start(redis_server.url, "gw-a")
    b = gateways.start(redis_server.url, "gw-b")
    a.add_running(POD, 2)
    b.add_running(POD, 1)
    a.add_tokens(POD, 11)
    await eventually(lambda: a.running(POD.key) == 3 and b.running(POD.key) == 3, 5, "synced")
    assert re.fullmatch(r"gw-a:\d{19}", a.field)
    # One number per busy pod, whatever the number of gateways; idle pods have no field.
    assert await raw.hgetall("extproc:running:{llama}") == {"team/a100-0": "3"}
    assert 590 <= await raw.ttl("extproc:running:{llama}") <= 600
    await eventually(lambda: raw.hgetall("extproc:tokens:{llama}"), 5, "tokens written")
    assert await raw.hgetall("extproc:tokens:{llama}") == {"team/a100-0": "11"}
    assert await raw.hgetall(f"extproc:ledger:{{llama}}:{a.field}") == {"~": "1", "r:team/a100-0": "2",
                                                                       "t:team/a100-0": "11"}
    assert await raw.hgetall(f"extproc:ledger:{{llama}}:{b.field}") == {"~": "1", "r:team/a100-0": "1"}
    beats = dict(await raw.zrange("extproc:gateways", 0, -1, withscores=True))
    assert set(beats) == {a.field, b.field}
    assert all(abs(score - time.time()) < 5 for score in beats.values())  # Unix seconds
    assert await raw.keys("aibrix:*") == []  # AIBrix's rows only when asked for (redis.aibrix_rows)
    # Leaving: its share and heartbeat go at once; the token total stays for the others to read.
    await a.close()
    assert await raw.hgetall("extproc:running:{llama}") == {"team/a100-0": "1"}
    assert await raw.hgetall("extproc:tokens:{llama}") == {"team/a100-0": "11"}
    assert await raw.zscore("extproc:gateways", a.field) is None
    await eventually(lambda: b.running(POD.key) == 1, 5, "B stops counting A")


async def test_aibrix_rows_when_asked_for_and_never_read_back(redis_server, gateways, raw):
    a = gateways.start(redis_server.url, "gw-a", aibrix_snapshots=True)
    b = gateways.start(redis_server.url, "gw-b", aibrix_snapshots=True)
    a.add_running(POD, 2)
    await eventually(lambda: b.running(POD.key) == 2, 5, "synced")
    # What AIBrix's own gateway writes and reads: a hash per gateway and pod, 500 ms expiry.
    row = await raw.hgetall(f"aibrix:pod:{a.field}:team:a100-0")
    assert AIBRIX_ROW_FIELDS <= row.keys()
    assert (row["gateway_instance_id"], row["namespace"], row["pod_name"], row["requests_running"]) == (
        a.field, "team", "a100-0", "2")
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}", row["update_time"])
    assert 0 < await raw.pttl(f"aibrix:pod:{a.field}:team:a100-0") <= 500
    # Still there a second later (rewritten before it expires), counted once (the totals hold it).
    await asyncio.sleep(1.2)  # past two 500 ms expiries and a rescan of the rows
    assert await raw.exists(f"aibrix:pod:{a.field}:team:a100-0") == 1
    assert b.running(POD.key) == 2 and b._aibrix_keys == []
    await a.close()
    assert await raw.exists(f"aibrix:pod:{a.field}:team:a100-0") == 0


async def test_an_aibrix_gateways_snapshot_is_counted(redis_server, gateways, raw):
    a = gateways.start(redis_server.url, "gw-a", aibrix_snapshots=True)
    a.add_running(POD, 1)

    async def aibrix_gateway_writes() -> bool:  # what pkg/cache/cache_gateway_snapshot.go does
        key = "aibrix:pod:aibrix-gateway-plugins-5d8f:team:a100-0"
        await raw.hset(key, mapping={"gateway_instance_id": "aibrix-gateway-plugins-5d8f", "pod_uid": "u",
                                     "pod_name": "a100-0", "namespace": "team", "node_name": "n",
                                     "requests_running": "5", "seq": "9", "update_time": "12:00:00.000"})
        await raw.pexpire(key, 500)
        return a.running(POD.key) == 6

    await eventually(aibrix_gateway_writes, 5, "AIBrix gateway's 5 counted")


async def test_a_silent_gateway_drops_out_after_the_liveness_window(redis_server, gateways):
    a = gateways.start(redis_server.url, "gw-a")
    b = gateways.start(redis_server.url, "gw-b")
    b.add_running(POD, 4)
    await eventually(lambda: a.running(POD.key) == 4, 5, "A sees B")
    await gateways.silence(b)  # crashed: no close(), its share stays in Redis until reaped
    took = await eventually(lambda: a.running(POD.key) == 0, 6, "B left out of the sum")
    assert 1.5 < took < 4.5, took  # about the 3 s liveness window after B's last heartbeat


async def test_a_gateway_reaped_while_paused_counts_again_when_it_resumes(redis_server, gateways, raw):
    a = gateways.start(redis_server.url, "gw-a")
    b = gateways.start(redis_server.url, "gw-b")
    a.add_running(POD, 1)
    b.add_running(POD, 4)
    await eventually(lambda: a.running(POD.key) == 5, 5, "A sees B")
    await gateways.silence(b)  # paused past the liveness window: A takes its 4 out of the total
    await eventually(lambda: a.running(POD.key) == 1, 6, "B reaped")
    assert await raw.hgetall("extproc:running:{llama}") == {"team/a100-0": "1"}
    assert not await raw.sismember("extproc:members:{llama}", b.field)
    gateways.tasks[b.field] = asyncio.create_task(b.run())  # B resumes, its counts unchanged
    await eventually(lambda: a.running(POD.key) == 5, 5, "B's 4 written again and seen by A")
    assert await raw.hgetall("extproc:running:{llama}") == {"team/a100-0": "5"}


async def test_a_redis_too_slow_for_a_turn_is_counted_logged_and_survived(redis_server, gateways, caplog):
    caplog.set_level(logging.INFO, logger="extproc.sharing.redis_sync")
    a = gateways.start(redis_server.url, "gw-a", op_timeout=0.2)
    b = gateways.start(redis_server.url, "gw-b", op_timeout=0.2)
    a.add_running(POD, 2)
    await eventually(lambda: b.running(POD.key) == 2, 5, "synced")
    redis_server.proc.popen.send_signal(signal.SIGSTOP)  # Redis stalls: connections open, no answer
    try:
        failures = lambda: gateways.registries[b.field].get_sample_value(  # noqa: E731
            "extproc_redis_sync_failures_total", {"reason": "timeout"}) or 0
        await eventually(lambda: failures() >= 1 and not b.up, 3, "a timed-out turn")
        assert b.running(POD.key) == 0  # its own counts only
        assert any("did not answer a sync turn within 0.2s (redis.timeout_seconds)" in r.getMessage()
                   for r in caplog.records)
    finally:
        redis_server.proc.popen.send_signal(signal.SIGCONT)
    await eventually(lambda: a.up and b.up and b.running(POD.key) == 2, 10, "sharing resumes")
    assert gateways.registries[b.field].get_sample_value("extproc_redis_sync_seconds") < 0.2


async def test_redis_outage_falls_back_locally_and_sharing_resumes(redis_server, gateways, caplog):
    caplog.set_level(logging.INFO, logger="extproc.sharing.redis_sync")
    a = gateways.start(redis_server.url, "gw-a")
    b = gateways.start(redis_server.url, "gw-b")
    a.add_running(POD, 2)
    b.add_running(POD, 1)
    await eventually(lambda: a.running(POD.key) == 3 == b.running(POD.key), 5, "synced")

    redis_server.stop()
    took = await eventually(lambda: not a.up and not b.up, 2, "both notice")
    assert took < 1.0
    assert a.running(POD.key) == 2 and b.running(POD.key) == 1  # local views
    assert gateways.registries[a.field].get_sample_value("extproc_redis_up") == 0
    # The request path never waits on Redis: thousands of updates and reads take no time.
    start = time.perf_counter()
    for _ in range(5000):
        a.add_running(POD, 1)
        a.running(POD.key)
        a.add_running(POD, -1)
    assert time.perf_counter() - start < 0.5
    a.add_running(POD, 3)   # changes made during the outage must reach B afterwards
    a.add_tokens(POD, 40)
    assert a.take_token_deltas() == {POD.key: 40}  # counted locally while down ...
    await asyncio.sleep(0.5)  # let several failing ticks pass: the outage is logged once
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 2  # one per gateway

    redis_server.start()  # same port, empty: everything must be re-published
    await eventually(lambda: a.up and b.up, 10, "sharing resumes")
    await eventually(lambda: a.running(POD.key) == 6 == b.running(POD.key), 5, "counts converge")
    await asyncio.sleep(0.3)
    assert a.take_token_deltas() == {}  # ... and not again when the shared counter catches up
    deltas: dict = {}

    def b_got_40() -> bool:
        for key, n in b.take_token_deltas().items():
            deltas[key] = deltas.get(key, 0) + n
        return deltas.get(POD.key) == 40

    await eventually(b_got_40, 5, "B sees A's outage tokens")
    assert gateways.registries[a.field].get_sample_value("extproc_redis_up") == 1
    assert any("reachable" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


async def test_password_through_aibrix_variables_never_logged(tmp_path, gateways, caplog):
    caplog.set_level(logging.DEBUG)
    server = RedisProc(tmp_path, free_port(), "--requirepass", PASSWORD)
    server.start()
    try:
        env = {"REDIS_HOST": "127.0.0.1", "REDIS_PORT": str(server.port), "REDIS_PASSWORD": PASSWORD}
        url = redis_url_from_env(env, None)
        assert url is not None
        a = gateways.start(url, "gw-a")
        a.add_running(POD, 1)
        await eventually(lambda: a.up, 5, "authenticated")
        wrong = redis_url_from_env({**env, "REDIS_PASSWORD": PASSWORD + "x"}, None)
        assert wrong is not None
        bad = gateways.start(wrong, "gw-bad")
        await asyncio.sleep(0.5)  # several refused ticks
        assert not bad.up and bad.running(POD.key) == 0
        assert a.running(POD.key) == 1
        refused = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(refused) == 1
        assert caplog.records, "expected some logging"
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "***" in logged
        assert PASSWORD not in logged and PASSWORD not in caplog.text
    finally:
        await gateways.close()
        server.stop()


def speed_evidence(t: float, w: float) -> list[float]:
    """An `export` vector: measured, then four groups (t, w, x, y, xx, xy, yy, n)."""
    return [t, *(v for _ in range(4) for v in (t, w, 8 * w, 0.02 * w, 64 * w, 0.16 * w, 0.0004 * w, 3.0))]


async def test_speed_evidence_is_summed_in_redis_and_a_crashed_gateways_share_leaves(redis_server, gateways,
                                                                                     raw):
    a = gateways.start(redis_server.url, "gw-a")
    b = gateways.start(redis_server.url, "gw-b")
    now = time.time()
    mine, theirs = speed_evidence(now, 100.0), speed_evidence(now - 2.0, 40.0)
    a.share_speed(POD.key, mine)
    b.share_speed(POD.key, theirs)

    base, slope = math.exp(-2.0 / 5.0), math.exp(-2.0 / 120.0)  # B's sums decayed to A's time

    def a_sees_b() -> bool:
        got = a.peer_speed().get(POD.key)
        return (got is not None and got[0][2] == pytest.approx(40.0 * base)
                and got[0][10] == pytest.approx(40.0 * slope))

    await eventually(a_sees_b, 5, "A reads B's evidence as the sums less its own")
    # One vector per pod in Redis, whatever the number of gateways: the Lua script's sum is Python's.
    stored = speed_sums.decode(await raw_bytes(redis_server).hget("extproc:speedsum:{llama}", "team/a100-0"))
    assert stored == pytest.approx(speed_sums.move(speed_sums.move(None, None, mine), None, theirs))
    assert stored is not None and stored[2] == pytest.approx(100.0 + 40.0 * base)
    await eventually(lambda: POD.key in b.peer_speed(), 5, "B reads A's")
    assert b.peer_speed()[POD.key][0] == pytest.approx(mine)
    await gateways.silence(b)  # crashed: its share is reaped with its counts
    await eventually(lambda: POD.key not in a.peer_speed(), 8, "B's share out of the sums")
    stored = speed_sums.decode(await raw_bytes(redis_server).hget("extproc:speedsum:{llama}", "team/a100-0"))
    assert stored == pytest.approx(mine)
    await a.close()  # leaving: nothing of A's is left either
    assert await raw.hexists("extproc:speedsum:{llama}", "team/a100-0") == 0


def raw_bytes(server: RedisProc) -> aioredis.Redis:
    return aioredis.from_url(server.url)
