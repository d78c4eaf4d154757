"""Accounting through real Envoy + gateway + engine simulator: the tally equals the engines' own
counts, usage requested on a client's behalf never reaches it, dead pods are skipped and come back."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.localstack import LocalStack, wait_until
from tests.integration.sim_fixtures import SimProcess, start_sim

MODEL = "llama2-7b"
SIM_ARGS = ["--gpu", "H100", "--model", MODEL, "--time-scale", "20"]


def engine_metric(sim: SimProcess, name: str) -> float:
    with urllib.request.urlopen(sim.url + "/metrics", timeout=2) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def pod(name: str, sim: SimProcess) -> dict:
    return {"name": name, "address": f"127.0.0.1:{sim.port}", "deployment": f"{MODEL}-h100"}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("accounting")


@pytest.fixture(scope="module")
def sims(log_dir: Path) -> Iterator[list[SimProcess]]:
    started = [start_sim(SIM_ARGS, log_dir) for _ in range(3)]
    yield started
    for sim in started:
        sim.stop()


@pytest.fixture(scope="module")
def stack(log_dir: Path, sims: list[SimProcess]) -> Iterator[LocalStack]:
    s = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
    s.write_config({"models": {MODEL: {"pods": [pod(f"p{i}", sim) for i, sim in enumerate(sims)]}},
                    "routing": {"default_strategy": "least-request"}})
    s.start_gateway()
    s.start_envoy()
    yield s
    s.stop()


def client(stack: LocalStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say this is a test!"}]}


async def one(c: openai.AsyncOpenAI, i: int) -> None:
    kind = i % 4
    if kind == 0:
        await c.chat.completions.create(max_tokens=5 + i % 7, **CHAT)
    elif kind == 1:
        await c.completions.create(model=MODEL, prompt="hello there", max_tokens=3 + i % 5)
    else:
        options = {"stream_options": {"include_usage": True}} if kind == 3 else {}
        stream = await c.chat.completions.create(stream=True, max_tokens=4 + i % 9, **CHAT, **options)
        async for _ in stream:
            pass


async def test_tally_equals_the_engines_generated_tokens(stack: LocalStack, sims: list[SimProcess]):
    c = client(stack)
    await asyncio.gather(*(one(c, i) for i in range(40)))

    def engines() -> float:
        return sum(engine_metric(s, "vllm:generation_tokens_total") for s in sims)

    expected = engines()
    assert expected > 0
    wait_until(lambda: stack.sample("extproc_output_tokens_total") == engines(), 10,
               "gateway tally == engines' generation_tokens_total")
    assert stack.sample("extproc_output_tokens_total") == expected
    wait_until(lambda: stack.sample("extproc_pod_running_requests") == 0, 10, "running back to 0")


async def test_streaming_client_that_did_not_ask_gets_no_usage_chunk(stack: LocalStack):
    c = client(stack)
    stream = await c.chat.completions.create(stream=True, max_tokens=6, **CHAT)
    chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is None for chunk in chunks)
    assert all(chunk.choices for chunk in chunks)
    assert sum(1 for chunk in chunks if chunk.choices[0].delta.content) == 6

    asked = await c.chat.completions.create(stream=True, max_tokens=6, stream_options={"include_usage": True},
                                            **CHAT)
    last = [chunk async for chunk in asked][-1]
    assert last.usage is not None and last.usage.completion_tokens == 6


async def test_learned_capacity_appears_per_pod(stack: LocalStack):
    c = client(stack)
    await asyncio.gather(*(one(c, i) for i in range(20)))
    wait_until(lambda: stack.sample("extproc_pod_capacity_tokens_per_second") > 0, 10, "a capacity estimate")


async def test_dead_engine_is_skipped_and_used_again_once_back(stack: LocalStack, sims: list[SimProcess],
                                                               log_dir: Path):
    victim = sims[2]
    port = victim.port
    victim.stop()
    c = client(stack)
    codes = []
    for i in range(40):
        try:
            raw = await c.chat.completions.with_raw_response.create(max_tokens=2, **CHAT)
            codes.append(raw.headers["target-pod"])
        except openai.APIStatusError as err:
            codes.append(err.status_code)
    # Detection takes the first failure or the next scrape; after it, nothing goes to p2.
    wait_until(lambda: stack.sample("extproc_pod_healthy", pod="p2") == 0, 5, "p2 marked down")
    failures = [x for x in codes if not isinstance(x, str)]
    assert len(failures) <= 3, codes
    after = []
    for _ in range(30):
        raw = await c.chat.completions.with_raw_response.create(max_tokens=2, **CHAT)
        after.append(raw.headers["target-pod"])
    assert "p2" not in after and set(after) == {"p0", "p1"}

    sims[2] = start_sim(SIM_ARGS, log_dir, port=port)
    wait_until(lambda: stack.sample("extproc_pod_healthy", pod="p2") == 1, 15, "p2 back")
    seen: set[str] = set()
    deadline = time.monotonic() + 10  # routing's views are rebuilt every 0.25 s: p2 may sit out a few
    while "p2" not in seen and time.monotonic() < deadline:
        raw = await c.chat.completions.with_raw_response.create(max_tokens=2, **CHAT)
        seen.add(raw.headers["target-pod"])
    assert "p2" in seen
