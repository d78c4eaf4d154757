"""Concurrent streaming requests through one Envoy + one gateway process + eight simulated engines:
no gateway-caused error, the tally equals what the engines generated, in-flight counts return to 0,
and the gateway's memory stays bounded. `make test`: one wave of 500 streams; `make soak`: 2,000 at
once (RELIABILITY_CONCURRENCY), RELIABILITY_SCALE waves. And 500 clients that disconnect at once."""

from __future__ import annotations

import asyncio
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.localstack import LocalStack, http_get, wait_until
from tests.integration.sim_fixtures import SimProcess, running_sims
from tests.support.stack import running_stack

MODEL = "llama2-7b"
PODS = 8
CONCURRENCY = int(os.environ.get("RELIABILITY_CONCURRENCY", "500"))
WAVES = int(os.environ.get("RELIABILITY_SCALE", "1"))  # `make soak`: many waves
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("load")


@pytest.fixture(scope="module")
def sims(log_dir: Path) -> Iterator[list[SimProcess]]:
    # max-num-seqs above a pod's share of the wave: the engines queue nothing, so the test is the gateway's
    args = ["--gpu", "A100-80GB", "--model", MODEL, "--time-scale", "20", "--max-num-seqs", "512"]
    with running_sims(args, log_dir, PODS) as box:
        yield box


@pytest.fixture(scope="module")
def stack(log_dir: Path, sims: list[SimProcess]) -> Iterator[LocalStack]:
    pods = [{"name": f"p{i}", "address": f"127.0.0.1:{sim.port}"} for i, sim in enumerate(sims)]
    # Scrapes 2 s apart: the disconnect test holds streams the simulated engines have finished
    # generating (its stall fault is in the HTTP writer), which the reconciler would rightly release.
    config = {"models": {MODEL: {"pods": pods}}, "telemetry": {"refresh_seconds": 2}}
    with running_stack(log_dir, config) as s:
        yield s


def generated(sims: list[SimProcess]) -> float:
    total = 0.0
    for sim in sims:
        text = http_get(sim.url + "/metrics")[1].decode()
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "vllm:generation_tokens_total")
    return total


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def one(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, int, bool]:
    """(status, content chunks, saw [DONE])"""
    body = {"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": f"request {i}: say something"}]}
    async with session.post(url, json=body) as resp:
        chunks, done = 0, False
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks += 1
            done = done or line.strip() == b"data: [DONE]"
        return resp.status, chunks, done


def idle(stack: LocalStack) -> bool:
    return all(stack.running(MODEL, f"p{i}") == 0 for i in range(PODS))


async def test_concurrent_streams(stack: LocalStack, sims: list[SimProcess]):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * CONCURRENCY:  # one socket per stream here
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * CONCURRENCY), hard))
    assert stack.gateway is not None
    pid = stack.gateway.popen.pid
    tallied_before, generated_before = stack.sample("extproc_output_tokens_total"), generated(sims)
    rss_start = rss_mib(pid)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as s:
        url = stack.url + "/v1/chat/completions"
        for wave in range(WAVES):
            results = await asyncio.gather(*(one(s, url, wave * CONCURRENCY + i) for i in range(CONCURRENCY)),
                                           return_exceptions=True)
            bad = [r for r in results if isinstance(r, BaseException) or r[0] != 200 or not r[2]]
            assert not bad, f"wave {wave}: {len(bad)} failed, e.g. {bad[:5]}"
    await asyncio.to_thread(wait_until, lambda: idle(stack), 30, "in-flight back to 0")
    engines = generated(sims) - generated_before
    assert engines >= WAVES * CONCURRENCY  # every stream produced tokens
    await asyncio.to_thread(wait_until, lambda: stack.sample("extproc_output_tokens_total") - tallied_before
                            == engines, 30, f"the tally equal to the engines' {engines:.0f} tokens")
    # every request's record arrived: counted 200 once, and none released without its record
    assert stack.sample("extproc_requests_total", code="200") >= WAVES * CONCURRENCY
    assert stack.sample("extproc_released_requests_total") == 0
    grown = rss_mib(pid) - rss_start
    assert grown < 64, f"gateway RSS grew {grown:.0f} MiB over {WAVES * CONCURRENCY} streams"
    print(f"{WAVES} x {CONCURRENCY} streams: gateway RSS grew {grown:.1f} MiB")


def set_faults(sim: SimProcess, faults: dict) -> None:
    import json
    import urllib.request
    request = urllib.request.Request(sim.url + "/sim/faults", data=json.dumps(faults).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.status == 200


async def opened(session: aiohttp.ClientSession, url: str, i: int) -> aiohttp.ClientResponse:
    """A stream read up to its last chunk before the engine holds it, still open."""
    body = {"model": MODEL, "stream": True, "max_tokens": 100,
            "messages": [{"role": "user", "content": f"request {i}: say something"}]}
    resp = await session.post(url, json=body)
    assert resp.status == 200
    tokens = 0
    while tokens < HELD_AFTER:  # the role chunk first, then one chunk per token
        line = await resp.content.readline()
        assert line, "stream ended early"
        tokens += line.startswith(b"data: {") and b'"content": ""' not in line
    return resp


HELD_AFTER = 32  # tokens each engine writes before it holds the stream
DISCONNECTING = 500


async def test_500_clients_disconnect_at_once(stack: LocalStack, sims: list[SimProcess]):
    """Every stream's record arrives (Envoy logs the downstream disconnect): counts back to 0 without
    any release by reconciliation, the tally within its running count of what was sent, routing goes on."""
    released = stack.sample("extproc_released_requests_total")
    tallied = stack.sample("extproc_output_tokens_total")
    for sim in sims:  # each engine writes HELD_AFTER tokens, then holds the stream
        set_faults(sim, {"stall_after_tokens": HELD_AFTER, "stall_seconds": 60})
    try:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
            url = stack.url + "/v1/chat/completions"
            streams = await asyncio.gather(*(opened(s, url, i) for i in range(DISCONNECTING)))
            await asyncio.to_thread(wait_until, lambda: sum(
                stack.running(MODEL, f"p{i}") for i in range(PODS)) == DISCONNECTING, 20, "500 counted")
            for resp in streams:  # all gone at once
                resp.close()
        await asyncio.to_thread(wait_until, lambda: idle(stack), 10, "in-flight back to 0")
    finally:
        for sim in sims:
            set_faults(sim, {})
    assert stack.sample("extproc_released_requests_total") == released  # by their records, not released
    # The engines wrote HELD_AFTER tokens to each stream; the records (which released the counts)
    # carry the tally's running count, written every 16 content events: up to 15 short per cut stream,
    # never more than was sent.
    sent = HELD_AFTER * DISCONNECTING
    tally = stack.sample("extproc_output_tokens_total") - tallied
    assert sent - 15 * DISCONNECTING <= tally <= sent, (tally, sent)
    async with aiohttp.ClientSession() as s:  # and the gateway routes on
        assert (await one(s, stack.url + "/v1/chat/completions", 0))[0] == 200
