"""Through real Envoy: Envoy SIGKILLed with streams open and started again. Its access-log records of
those streams never come; the gateway holds its count against the engine's own and releases them
within seconds, not after gateway.request_timeout_seconds (an hour)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest

from extproc.localstack import LocalStack, wait_until
from tests.integration.sim_fixtures import start_sim

MODEL = "llama2-7b"
STREAMS = 10


@pytest.fixture
def stack(tmp_path) -> Iterator[tuple[LocalStack, object]]:
    sim = start_sim(["--gpu", "A100-80GB", "--model", MODEL], tmp_path)
    s = LocalStack(config_path=tmp_path / "gateway.yaml", log_dir=tmp_path)
    s.write_config({"models": {MODEL: {"pods": [
        {"name": "a100-0", "address": f"127.0.0.1:{sim.port}", "labels": {"gpu": "A100"}}]}},
        "telemetry": {"refresh_seconds": 0.5}})
    s.start_gateway()
    s.start_envoy()
    yield s, sim
    s.stop()
    sim.stop()


async def test_envoy_sigkill_with_streams_open_releases_the_lost_counts_within_seconds(stack):
    s, _ = stack
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 600}
    async with aiohttp.ClientSession() as session:
        responses = [await session.post(s.url + "/v1/chat/completions", json=body) for _ in range(STREAMS)]
        for resp in responses:
            assert resp.status == 200
            await resp.content.readline()  # streaming: the engine holds it
        wait_until(lambda: s.running(MODEL, "a100-0") == STREAMS, what="ten streams counted")
        s.envoy.stop(signal.SIGKILL)
        for resp in responses:  # the client sees its stream cut
            with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                                aiohttp.ClientConnectionError)):
                await asyncio.wait_for(resp.read(), 30)
    killed = time.monotonic()
    s.start_envoy()
    wait_until(lambda: s.running(MODEL, "a100-0") == 0, timeout=20, what="phantom streams released")
    assert time.monotonic() - killed < 15  # scrapes every 0.5 s, released after three: seconds, not an hour
    assert s.sample("extproc_released_requests_total", cause="engine_count") == STREAMS
    # The new Envoy routes, and its requests are counted and released as usual.
    async with aiohttp.ClientSession() as session:
        resp = await session.post(s.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 5})
        assert resp.status == 200
    wait_until(lambda: s.running(MODEL, "a100-0") == 0, what="the new request released by its record")
