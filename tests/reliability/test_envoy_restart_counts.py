"""Through real Envoy: Envoy SIGKILLed with streams open and started again. Its access-log records of
those streams never come; the gateway holds its count against the engine's own and releases them
within seconds, not after gateway.request_timeout_seconds (an hour). And Envoy restarted gracefully
(drained, then SIGTERM): every record arrives, nothing needs releasing, the tally is exact."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest

from extproc.localstack import LocalStack, wait_until
from tests.integration.sim_fixtures import start_sim
from tests.support.traffic import Load, chat, engine_tokens, request

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
    s, sim = stack
    tallied, generated = s.sample("extproc_output_tokens_total"), engine_tokens([sim.url])
    body = chat(MODEL, 600, stream=True)
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
    took = time.monotonic() - killed
    # the bound: the truth within 5 s (3 s grace, then three scrapes 0.5 s apart)
    assert took < 5, f"counts back to the truth {took:.1f} s after the kill"
    print(f"counts back to the truth {took:.1f} s after the kill")
    assert s.sample("extproc_released_requests_total", cause="engine_count") == STREAMS
    # Tally: the lost records' tokens are missing, nothing is counted twice.
    assert s.sample("extproc_output_tokens_total") - tallied < engine_tokens([sim.url]) - generated
    # The new Envoy routes, and its requests are counted and released as usual.
    async with aiohttp.ClientSession() as session:
        tallied, generated = s.sample("extproc_output_tokens_total"), engine_tokens([sim.url])
        resp = await session.post(s.url + "/v1/chat/completions",
                                  json={**body, "stream": False, "max_tokens": 5})
        assert resp.status == 200
    wait_until(lambda: s.running(MODEL, "a100-0") == 0, what="the new request released by its record")
    wait_until(lambda: tally(s) - tallied == engine_tokens([sim.url]) - generated, what="its tokens tallied")


async def test_envoy_graceful_restart_loses_no_record(stack):
    """Drain (as a rollout's preStop does), the streams finish while load goes on, the load moves away,
    SIGTERM, start again: every request's record arrives; nothing is left to release."""
    s, sim = stack
    tallied, generated = s.sample("extproc_output_tokens_total"), engine_tokens([sim.url])
    load = Load([s.url], chat(MODEL, 4)).start()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        streams = [asyncio.create_task(request(session, s.url, chat(MODEL, 150, True)))
                   for _ in range(STREAMS)]
        await asyncio.to_thread(wait_until, lambda: s.running(MODEL, "a100-0") >= STREAMS, 10,
                                "streams counted")
        admin = f"http://127.0.0.1:{s.envoy_admin_port}"
        await asyncio.to_thread(_post, admin + "/drain_listeners?graceful")
        ends = await asyncio.gather(*streams)
        outcomes = await load.stop()  # the load balancer takes this Envoy out
    assert {e for e, _ in ends} == {"done"} and set(outcomes) == {"200"}, (ends, outcomes)
    await asyncio.to_thread(wait_until, lambda: s.running(MODEL, "a100-0") == 0, 5, "every record in")
    assert s.envoy is not None
    assert s.envoy.stop(signal.SIGTERM) == 0
    s.start_envoy()
    async with aiohttp.ClientSession() as session:
        assert (await request(session, s.url, chat(MODEL, 5)))[0] == "200"
    wait_until(lambda: s.running(MODEL, "a100-0") == 0, 5, "the new Envoy's request released")
    assert s.sample("extproc_released_requests_total") == 0
    wait_until(lambda: tally(s) - tallied == engine_tokens([sim.url]) - generated, 5, "the tally exact")


def tally(s: LocalStack) -> float:
    return s.sample("extproc_output_tokens_total")


def _post(url: str) -> None:
    import urllib.request
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5) as resp:
        assert resp.status == 200
