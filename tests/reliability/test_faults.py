"""Engines that die mid-stream, answer 5xx, hang, or publish garbage metrics: clients get a clean,
bounded answer, in-flight counts return to 0, the pod is skipped until it serves again, and what the
gateway learns (capacity) is not poisoned. Real Envoy, gateway and engine simulators."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from extproc.localstack import LocalStack, free_port, wait_until
from tests.integration.sim_fixtures import SimProcess, start_sim
from tests.support.stack import running_stack

MODEL = "llama2-7b"
SIM_ARGS = ["--gpu", "A100-80GB", "--model", MODEL, "--time-scale", "5"]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say this is a test!"}]}
IDLE_TIMEOUT_S = 3  # Envoy cuts a request whose pod is silent this long


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def sims(log_dir: Path) -> Iterator[dict[str, SimProcess]]:
    box = {name: start_sim(SIM_ARGS, log_dir) for name in ("x", "y")}
    yield box
    for sim in box.values():
        sim.stop()


def config(sims: dict[str, SimProcess], metrics_port: dict[str, int] | None = None) -> dict:
    pods = []
    for name, sim in sims.items():
        pod = {"name": name, "address": f"127.0.0.1:{sim.port}", "labels": {"gpu": "A100-80GB"}}
        if metrics_port and name in metrics_port:
            pod["metrics_port"] = metrics_port[name]
        pods.append(pod)
    return {"models": {MODEL: {"pods": pods}}, "routing": {"default_strategy": "least-request"}}


@pytest.fixture(scope="module")
def stack(log_dir: Path, sims: dict[str, SimProcess]) -> Iterator[LocalStack]:
    with running_stack(log_dir, config(sims), idle_timeout_seconds=IDLE_TIMEOUT_S) as s:
        yield s


def set_faults(sim: SimProcess, faults: dict) -> None:
    request = urllib.request.Request(sim.url + "/sim/faults", data=json.dumps(faults).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.status == 200


async def stream(session: aiohttp.ClientSession, stack: LocalStack, max_tokens: int) -> tuple[str, str]:
    """(pod, "done" | "cut" | "<status>"): how one streaming request ended, as a client sees it."""
    try:
        async with session.post(stack.url + "/v1/chat/completions",
                                json={**CHAT, "stream": True, "max_tokens": max_tokens}) as resp:
            pod = resp.headers.get("target-pod", "")
            if resp.status != 200:
                await resp.read()
                return pod, str(resp.status)
            done = False
            async for line in resp.content:
                done = done or line.strip() == b"data: [DONE]"
            return pod, "done" if done else "cut"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        return pod, "cut"


async def routed(session: aiohttp.ClientSession, stack: LocalStack) -> tuple[int, str]:
    async with session.post(stack.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}) as resp:
        body = await resp.read()
        if resp.status != 200:
            assert json.loads(body)["error"]["message"]  # every failure in the OpenAI shape
        return resp.status, resp.headers.get("target-pod", "")


def settled(stack: LocalStack) -> bool:
    return stack.running(MODEL, "x") == 0 and stack.running(MODEL, "y") == 0


async def test_engine_killed_mid_stream(stack: LocalStack, sims: dict[str, SimProcess], log_dir: Path):
    async with aiohttp.ClientSession() as session:
        streams = [asyncio.create_task(stream(session, stack, 3000)) for _ in range(8)]
        await asyncio.to_thread(wait_until, lambda: stack.running(MODEL, "x") >= 2
                                and stack.running(MODEL, "y") >= 2, 10, "streams on both pods")
        port = sims["x"].port
        sims["x"].proc.popen.send_signal(signal.SIGKILL)
        ends = await asyncio.gather(*streams)
        # a prompt, clean end, never a hang: cut mid-body, or a 503 (OpenAI JSON) before the first byte
        assert {e for p, e in ends if p == "x"} <= {"cut", "503"} and any(p == "x" for p, _ in ends), ends
        assert {e for p, e in ends if p == "y"} == {"done"}, ends
        await asyncio.to_thread(wait_until, lambda: settled(stack), 10, "in-flight back to 0")
        await asyncio.to_thread(wait_until, lambda: stack.sample("extproc_pod_healthy", pod="x") == 0, 10,
                                "x marked down")
        after = [await routed(session, stack) for _ in range(20)]
        assert after == [(200, "y")] * 20

        sims["x"].stop()
        sims["x"] = start_sim(SIM_ARGS, log_dir, port=port)
        await asyncio.to_thread(wait_until, lambda: stack.sample("extproc_pod_healthy", pod="x") == 1, 20,
                                "x back")
        # routing reads views rebuilt every 0.25 s, so x may sit out a few more requests
        deadline = asyncio.get_running_loop().time() + 10
        seen: set[str] = set()
        while "x" not in seen and asyncio.get_running_loop().time() < deadline:
            status, pod = await routed(session, stack)
            assert status == 200
            seen.add(pod)
        assert "x" in seen


async def test_5xx_engine_is_ejected_and_its_capacity_not_poisoned(stack: LocalStack,
                                                                   sims: dict[str, SimProcess]):
    async with aiohttp.ClientSession() as session:
        for _ in range(10):  # both pods serve: capacity learned for each
            await asyncio.gather(*(stream(session, stack, 200) for _ in range(4)))
        await asyncio.to_thread(wait_until, lambda: stack.sample("extproc_pod_capacity_tokens_per_second",
                                                                 pod="y") > 0, 10, "y's capacity learned")
        before = stack.sample("extproc_pod_capacity_tokens_per_second", pod="y")
        set_faults(sims["y"], {"error_rate": 1.0, "error_status": 500})
        try:
            results = [await routed(session, stack) for _ in range(40)]
            failed = [r for r in results if r[0] != 200]
            assert all(pod == "y" for _, pod in failed) and all(s == 500 for s, _ in failed)
            # ejected after three failures; re-probed with backoff (its /health still says 200)
            assert len(failed) <= 12, results
            # failures credit no tokens and no speed observation: y keeps the speed it was learned at
            # (compared with itself: x and y saw different request lengths in the earlier tests)
            after = stack.sample("extproc_pod_capacity_tokens_per_second", pod="y")
            assert after >= 0.8 * before, (before, after)
        finally:
            set_faults(sims["y"], {})
        await asyncio.to_thread(wait_until, lambda: settled(stack), 10, "in-flight back to 0")


async def counted_stream(session: aiohttp.ClientSession, stack: LocalStack,
                         max_tokens: int) -> tuple[str, int]:
    """("done" | "cut", content tokens the client received) of one streaming request."""
    tokens = 0
    try:
        async with session.post(stack.url + "/v1/chat/completions",
                                json={**CHAT, "stream": True, "max_tokens": max_tokens}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.strip() == b"data: [DONE]":
                    return "done", tokens
                tokens += line.startswith(b"data: {") and b'"content": ""' not in line
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        pass
    return "cut", tokens


HUNG_AFTER = 32  # tokens each engine writes before it hangs


async def test_a_hanging_engine_is_cut_off_by_envoys_idle_timeout(stack: LocalStack,
                                                                  sims: dict[str, SimProcess]):
    tallied = stack.sample("extproc_output_tokens_total")
    for sim in sims.values():
        set_faults(sim, {"stall_after_tokens": HUNG_AFTER, "stall_seconds": 60})
    try:
        async with aiohttp.ClientSession() as session:
            started = asyncio.get_running_loop().time()
            ends = await asyncio.gather(*(counted_stream(session, stack, 50) for _ in range(2)))
            async with session.post(stack.url + "/v1/chat/completions",
                                    json={**CHAT, "max_tokens": 50}) as resp:
                status, body = resp.status, await resp.read()
            elapsed = asyncio.get_running_loop().time() - started
        assert ends == [("cut", HUNG_AFTER)] * 2  # what the clients saw: 32 tokens, then cut
        assert status == 504 and json.loads(body)["error"]["type"]  # Envoy's reply, in the OpenAI shape
        assert elapsed < 4 * IDLE_TIMEOUT_S + 5  # bounded by the timeout, not by the 60 s stall
    finally:
        for sim in sims.values():
            set_faults(sim, {})
    await asyncio.to_thread(wait_until, lambda: settled(stack), 10, "in-flight back to 0")
    # The records of the cut requests carry the tally's running count (every 16 content events): at
    # most what the clients received, at most 15 short per stream; the 504 credits nothing.
    received = sum(tokens for _, tokens in ends)
    tally = stack.sample("extproc_output_tokens_total") - tallied
    assert received - 15 * len(ends) <= tally <= received, (tally, received)


@pytest.fixture
def garbage_metrics() -> Iterator[int]:
    """A metrics endpoint that answers garbage, and one that never answers."""
    port = free_port()

    async def garbage(_: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running{ 12 ???\n\x00\x01 not prometheus")

    async def serve(ready: asyncio.Event, stop: asyncio.Event) -> None:
        app = web.Application()
        app.router.add_get("/metrics", garbage)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    import threading

    loop = asyncio.new_event_loop()
    ready, stop = asyncio.Event(), asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(ready, stop),), daemon=True)
    thread.start()
    wait_until(lambda: ready.is_set(), 5, "garbage server")
    yield port
    loop.call_soon_threadsafe(stop.set)
    thread.join(5)


async def test_garbage_metrics_are_counted_and_routing_goes_on(stack: LocalStack, sims: dict[str, SimProcess],
                                                               garbage_metrics: int):
    before = stack.sample("extproc_metrics_scrape_errors_total", pod="y")
    stack.write_config(config(sims, {"y": garbage_metrics}))
    try:
        await asyncio.to_thread(wait_until, lambda: stack.sample("extproc_metrics_scrape_errors_total",
                                                                 pod="y") >= before + 3, 15, "scrape errors")
        async with aiohttp.ClientSession() as session:
            results = [await routed(session, stack) for _ in range(20)]
        assert all(status == 200 for status, _ in results)  # the healthy pod serves whatever y does
    finally:
        stack.write_config(config(sims))
    await asyncio.to_thread(wait_until, lambda: stack.sample("extproc_pod_healthy", pod="y") == 1, 20,
                            "y back")
