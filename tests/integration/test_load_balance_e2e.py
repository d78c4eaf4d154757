"""Through real Envoy: `load-balance` on a pool of two speeds sends the faster pod more requests once the
gateway has learned their capacities from the tokens it counted."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import openai
import pytest

from extproc.localstack import LocalStack, wait_until
from tests.integration.sim_fixtures import start_sim

MODEL = "llama2-7b"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say this is a test!"}]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    log_dir = tmp_path_factory.mktemp("load-balance")
    fast = start_sim(["--gpu", "H100", "--model", MODEL, "--time-scale", "4"], log_dir)
    slow = start_sim(["--gpu", "V100", "--model", MODEL, "--time-scale", "4"], log_dir)
    s = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
    s.write_config({"models": {MODEL: {"pods": [
        {"name": "fast", "address": f"127.0.0.1:{fast.port}", "labels": {"gpu": "H100"}},
        {"name": "slow", "address": f"127.0.0.1:{slow.port}", "labels": {"gpu": "V100"}}]}}})
    s.start_gateway()
    s.start_envoy()
    yield s
    s.stop()
    fast.stop()
    slow.stop()


async def test_faster_pod_gets_more_once_capacity_is_learned(stack: LocalStack):
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0)
    picks: Counter[str] = Counter()

    async def worker(n: int) -> None:
        for _ in range(n):
            raw = await client.chat.completions.with_raw_response.create(
                max_tokens=64, extra_headers={"routing-strategy": "load-balance"}, **CHAT)
            picks[raw.headers["target-pod"]] += 1

    await asyncio.gather(*(worker(6) for _ in range(8)))  # warm-up: both pods serve and get measured
    await asyncio.to_thread(wait_until, lambda: all(
        stack.sample("extproc_pod_capacity_tokens_per_second", pod=p) > 0 for p in ("fast", "slow")),
        10, "both capacities learned")
    assert stack.sample("extproc_pod_capacity_tokens_per_second", pod="fast") > \
        stack.sample("extproc_pod_capacity_tokens_per_second", pod="slow")
    picks.clear()
    await asyncio.gather(*(worker(10) for _ in range(8)))
    assert picks["fast"] > 1.3 * picks["slow"], picks
