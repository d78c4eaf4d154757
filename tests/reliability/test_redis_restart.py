"""Through real Envoy: Redis SIGKILLed and restarted, from an older snapshot, while two gateways route.
No request fails; each gateway routes on its own counts while Redis is away; within 2 s of its return
both agree on the truth again (a count that went to 0 meanwhile is not left at its snapshot value);
a gateway dead in the snapshot is reaped (its share leaves the totals, its heartbeat the set)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis

from extproc.localstack import LocalStack, wait_until
from extproc.sharing import redis_scripts
from extproc.sharing.redis_sync import write_keys
from extproc.sharing.sync_core import (
    GATEWAY_RETENTION_SECONDS,
    GATEWAYS_KEY,
    KEY_TTL_SECONDS,
    ledger_key,
    members_key,
    running_key,
)
from tests.integration.sim_fixtures import SimProcess, start_sim
from tests.support.redis_server import RedisServer
from tests.support.stack import running_stacks
from tests.support.traffic import Load, chat, engine_tokens, request

MODEL = "llama2-7b"
LOAD_MODEL = "load"
POD = "p0"
POD_ID = f"default/{POD}"
DEAD = "gw-dead:1"  # a gateway that died long ago, its share still in the snapshot


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[list[RedisServer]]:
    box = [RedisServer(tmp_path, None, "--dir", str(tmp_path), "--dbfilename", "snapshot.rdb")]
    yield box
    box[0].stop()


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimProcess]:
    s = start_sim(["--gpu", "A100-80GB", "--model", MODEL, "--time-scale", "1"], tmp_path)
    yield s
    s.stop()


@pytest.fixture
def load_sim(tmp_path: Path) -> Iterator[SimProcess]:
    """The background load's own pod (another model), so the counts on POD are exact to assert."""
    s = start_sim(["--gpu", "A100-80GB", "--model", MODEL, "--served-model-name", LOAD_MODEL,
                   "--time-scale", "20"], tmp_path)
    yield s
    s.stop()


@pytest.fixture
def gateways(tmp_path: Path, redis_server: list[RedisServer], sim: SimProcess,
             load_sim: SimProcess) -> Iterator[list[LocalStack]]:
    config = {"models": {MODEL: {"pods": [{"name": POD, "address": f"127.0.0.1:{sim.port}"}]},
                         LOAD_MODEL: {"pods": [{"name": "q0", "address": f"127.0.0.1:{load_sim.port}"}]}},
              "telemetry": {"refresh_seconds": 0.5}}
    with running_stacks(tmp_path, config, {"EXTPROC_REDIS_URL": redis_server[0].url}) as stacks:
        yield stacks


def running(s: LocalStack) -> float:
    return s.running(MODEL, POD)


def total(client: redis.Redis) -> int:
    return int(client.hget(running_key(MODEL), POD_ID) or 0)


def ledger(client: redis.Redis, gateway: str) -> int:
    """The gateway's in-flight share on the pod, as its ledger holds it."""
    return int(client.hget(ledger_key(MODEL, gateway), f"r:{POD_ID}") or 0)


async def test_redis_killed_and_restarted_from_a_snapshot(gateways, redis_server, sim, load_sim, tmp_path):
    a, b = gateways
    client = redis.Redis(port=redis_server[0].port)
    up = lambda: a.sample("extproc_redis_up") == 1 and b.sample("extproc_redis_up") == 1  # noqa: E731
    await asyncio.to_thread(wait_until, up, 10, "both gateways share through Redis")
    engines_before = engine_tokens([sim.url, load_sim.url])
    tallies_before = a.sample("extproc_output_tokens_total") + b.sample("extproc_output_tokens_total")
    load = Load([a.url, b.url], chat(LOAD_MODEL, 4)).start()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        # 4 streams through a, 3 through b: both gateways count 7 (+ the load's short requests)
        first = [asyncio.create_task(request(session, a.url, chat(MODEL, 150, True))) for _ in range(4)]
        first += [asyncio.create_task(request(session, b.url, chat(MODEL, 150, True))) for _ in range(3)]
        await asyncio.to_thread(wait_until, lambda: running(a) == 7 and running(b) == 7, 10, "7 shared")
        # The snapshot Redis will come back from: these counts, and a gateway gone for longer than the
        # retention (its heartbeat that old). Its share written by the write script: in its ledger, the
        # members and the totals (both forms). Writes are paused in the same transaction, so the snapshot
        # holds exactly what it counted: a BGSAVE inside MULTI is only scheduled (Redis forks at its next
        # cron tick, when a gateway may have written a key since).
        with client.pipeline(transaction=True) as pipe:
            pipe.zadd(GATEWAYS_KEY, {DEAD: time.time() - GATEWAY_RETENTION_SECONDS - 100})
            pipe.eval(redis_scripts.WRITE, 8, *write_keys(MODEL, DEAD), KEY_TTL_SECONDS, DEAD, 1, POD_ID, 9)
            pipe.hget(running_key(MODEL), POD_ID)
            pipe.dbsize()
            pipe.client_pause(10_000, all=False)  # writes only: our BGSAVE and INFO still run
            *_, saved_total, saved_keys, _ = pipe.execute()
        assert int(saved_total) == 7 + 9  # the snapshot's total: both live gateways' 7 and the dead one's 9
        client.bgsave()
        saved = lambda: (info := client.info("persistence"))["rdb_bgsave_in_progress"] == 0 \
            and info["rdb_changes_since_last_save"] == 0  # noqa: E731
        await asyncio.to_thread(wait_until, saved, 10, "snapshot written")
        client.client_unpause()
        assert {e for e, _ in await asyncio.gather(*first)} == {"done"}
        await asyncio.to_thread(wait_until, lambda: running(a) == 0 and running(b) == 0, 10, "idle")
        client.close()

        redis_server[0].proc.stop(signal.SIGKILL)
        await asyncio.to_thread(wait_until, lambda: a.sample("extproc_redis_up") == 0
                                and b.sample("extproc_redis_up") == 0, 5, "Redis gone, seen by both")
        # While it is away: 3 long streams through b; each gateway counts its own.
        second = [asyncio.create_task(request(session, b.url, chat(MODEL, 1000, True))) for _ in range(3)]
        await asyncio.to_thread(wait_until, lambda: running(b) == 3, 10, "b counts its own 3")
        assert running(a) == 0

        redis_server[0] = RedisServer(tmp_path, redis_server[0].port, *redis_server[0].extra)
        back = time.monotonic()
        client = redis.Redis(port=redis_server[0].port)
        # the snapshot was restored, every key of it (the gateways may have written since: they reconnect
        # at once, so its values are checked by what they converge to below)
        assert client.info("persistence")["rdb_last_load_keys_loaded"] == saved_keys
        # both sharing again (each has read Redis since), and both at the truth
        await asyncio.to_thread(wait_until, lambda: up() and running(a) == 3 and running(b) == 3, 2,
                                "both gateways agree on b's 3 within 2 s of Redis's return")
        converged = time.monotonic() - back
        # The dead gateway is reaped (its share out of the total) and its heartbeat, past the retention,
        # dropped; the live ones' snapshot values rewritten (a's 4 is 0 now, b's 3 is its 3 new ones).
        assert total(client) == 3 and ledger(client, DEAD) == 0
        assert not client.sismember(members_key(MODEL), DEAD)
        assert client.zscore(GATEWAYS_KEY, DEAD) is None
        live = {key: int(client.hget(key, f"r:{POD_ID}") or 0)
                for key in client.scan_iter(match=ledger_key(MODEL, "gw-[ab]:*"))}
        assert len(live) == 2 and sorted(live.values()) == [0, 3], live
        assert {e for e, _ in await asyncio.gather(*second)} == {"done"}
        client.close()
    outcomes = await load.stop()
    assert set(outcomes) == {"200"}, outcomes  # no request failed, outage or not
    await asyncio.to_thread(wait_until, lambda: running(a) == 0 and running(b) == 0, 10, "idle again")
    engines = engine_tokens([sim.url, load_sim.url]) - engines_before
    await asyncio.to_thread(wait_until, lambda: a.sample("extproc_output_tokens_total") + b.sample(
        "extproc_output_tokens_total") - tallies_before == engines, 10, f"tally equal to {engines}")
    assert a.sample("extproc_released_requests_total") == b.sample("extproc_released_requests_total") == 0
    print(f"converged {converged:.2f} s after Redis's return")
