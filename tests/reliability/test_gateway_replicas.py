"""Through real Envoy: two gateway processes behind one Envoy (its ext_proc cluster with two
endpoints), sharing counts through Redis. Envoy's access-log stream goes to one of them, so records of
the other's requests arrive at the wrong one and are passed on. Then one is SIGKILLed with streams
open: the streams finish, the other keeps routing, no request hangs, counts are true afterwards."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from extproc.localstack import LocalStack, Proc, wait_until
from tests.integration.sim_fixtures import SimProcess, start_sim
from tests.support.redis_server import RedisServer
from tests.support.stack import envoy_in_front_of, start_envoy_at
from tests.support.traffic import Load, chat, engine_tokens, request

MODEL, LOAD_MODEL = "llama2-7b", "load"


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[tuple[SimProcess, SimProcess]]:
    main = start_sim(["--gpu", "A100-80GB", "--model", MODEL, "--time-scale", "2"], tmp_path)
    load = start_sim(["--gpu", "A100-80GB", "--model", MODEL, "--served-model-name", LOAD_MODEL,
                      "--time-scale", "20"], tmp_path)
    yield main, load
    main.stop()
    load.stop()


@pytest.fixture
def replicas(tmp_path: Path, sims) -> Iterator[tuple[list[LocalStack], Proc, str]]:
    """(the two gateways, the Envoy in front of both, its URL)"""
    main, load = sims
    server = RedisServer(tmp_path)
    gateways: list[LocalStack] = []
    envoy: Proc | None = None
    try:
        for name in ("a", "b"):
            d = tmp_path / name
            d.mkdir()
            g = LocalStack(config_path=d / "gateway.yaml", log_dir=d, env={"EXTPROC_REDIS_URL": server.url})
            g.write_config({"models": {
                MODEL: {"pods": [{"name": "p0", "address": f"127.0.0.1:{main.port}"}]},
                LOAD_MODEL: {"pods": [{"name": "q0", "address": f"127.0.0.1:{load.port}"}]}},
                "telemetry": {"refresh_seconds": 0.5}})
            gateways.append(g)
            g.start_gateway()
        bootstrap, listen = envoy_in_front_of(gateways)
        envoy = start_envoy_at(bootstrap, listen, tmp_path)
        yield gateways, envoy, f"http://127.0.0.1:{listen}"
    finally:
        if envoy is not None:
            envoy.stop()
        for g in gateways:
            g.stop()
        server.stop()


def running(g: LocalStack) -> float:
    return g.running(MODEL, "p0")


async def test_one_of_two_gateways_killed_behind_one_envoy(replicas, sims):
    (a, b), _, url = replicas
    main, load_sim = sims
    await asyncio.to_thread(wait_until, lambda: a.sample("extproc_redis_up") == 1
                            and b.sample("extproc_redis_up") == 1, 10, "both share through Redis")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        # Both route (Envoy balances its ext_proc streams); every record reaches one of them.
        outcomes = await asyncio.gather(*(request(session, url, chat(MODEL, 8)) for _ in range(20)))
        assert {o for o, _ in outcomes} == {"200"}
        await asyncio.to_thread(wait_until, lambda: running(a) == 0 and running(b) == 0, 5,
                                "both counts back to 0 by the records, passed on through Redis")
        assert a.sample("extproc_requests_total") + b.sample("extproc_requests_total") == 20
        assert a.sample("extproc_requests_total") > 0 and b.sample("extproc_requests_total") > 0
        sent_a, sent_b = (g.sample("extproc_peer_access_logs_total", direction="sent") for g in (a, b))
        receiver, other = (a, b) if sent_a else (b, a)
        assert (sent_a > 0) != (sent_b > 0)  # one log stream, to one of them
        assert a.sample("extproc_released_requests_total") == b.sample("extproc_released_requests_total") == 0

        # Streams open through both, load running; the log stream's gateway dies.
        tallies_before = sum(g.sample("extproc_output_tokens_total") for g in (receiver, other))
        engines_before = engine_tokens([main.url, load_sim.url])
        load = Load([url], chat(LOAD_MODEL, 4)).start()
        streams = [asyncio.create_task(request(session, url, chat(MODEL, 300, True))) for _ in range(8)]
        await asyncio.to_thread(wait_until, lambda: running(other) == 8, 15, "8 streams counted")
        assert receiver.gateway is not None
        await asyncio.to_thread(wait_until, lambda: load.outcomes["200"] >= 20, 10, "load running")
        tally_receiver = receiver.sample("extproc_output_tokens_total")
        receiver.gateway.stop(signal.SIGKILL)
        killed = time.monotonic()
        ends = await asyncio.gather(*streams)
        # the response path does not pass through the gateway: every stream finishes
        assert {e for e, _ in ends} == {"done"}, ends
        # Envoy's health check takes the dead endpoint out: then the survivor routes everything.
        await asyncio.to_thread(wait_until, lambda: time.monotonic() - killed > 4, 10, "health check")
        after = await asyncio.gather(*(request(session, url, chat(MODEL, 8)) for _ in range(20)))
        assert {o for o, _ in after} == {"200"}, after
        outcomes = await load.stop()
    # What the load saw around the kill: routed, or a retryable 503 at once; nothing hung.
    assert set(outcomes) <= {"200", "503 gateway_unavailable"}, outcomes
    assert outcomes["200"] > 0 and load.longest < 5, (outcomes, load.longest)
    # Counts true afterwards: the survivor's own requests whose records died with the other gateway
    # are released against the engine's count; the dead gateway drops out of the shared sum.
    await asyncio.to_thread(wait_until, lambda: running(other) == 0, 15, "the survivor's count at 0")
    # Tally: what both credited (the dead one up to its death) never exceeds what the engines
    # generated; only the records lost with the dead gateway are missing (a few short requests).
    engines = engine_tokens([main.url, load_sim.url]) - engines_before
    credited = tally_receiver + other.sample("extproc_output_tokens_total") - tallies_before
    assert 0.9 * engines <= credited <= engines, (credited, engines)
    print(f"released by engine count: {other.sample('extproc_released_requests_total')}, "
          f"load outcomes {dict(outcomes)}, longest {load.longest:.2f} s, tally {credited} of {engines}")
