"""Through real Envoy, a real redis-server and the engine simulator: a request the `slo` router holds in
the gateway queue shows in the request trace's `meta_queueing_reqs` (and the requests on the pod in
`meta_pending_reqs`), the gauges docs/optimizer.md documents; before, the queue was always written as 0."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import openai
import pytest

from extproc.localstack import LocalStack, wait_until
from tests.integration.sim_fixtures import start_sim
from tests.support.redis_server import RedisServer
from tests.support.traffic import fill_then_queue

MODEL = "llama2-7b"
CHAT = [{"role": "user", "content": "Say this is a test!"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, RedisServer]]:
    log_dir = tmp_path_factory.mktemp("trace-queue")
    redis = RedisServer(log_dir)
    sim = start_sim(["--gpu", "V100", "--model", MODEL], log_dir)
    # every cell: 2 requests/s at 1 s -> each request holds half the pod; a relaxed SLO, so the third waits
    profile = {"gpu": "dep", "cost": 1.0, "tputs": [[2.0, 2.0], [2.0, 2.0]],
               "indexes": [[8, 1024], [16, 4096]], "e2e": [[1.0, 1.0], [1.0, 1.0]],
               "slos": {"percentile": 99, "e2e": 100.0}, "created": time.time()}
    path = log_dir / "dep.json"
    path.write_text(json.dumps(profile))
    s = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir,
                   env={"EXTPROC_REDIS_URL": redis.url, "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": "true"})
    s.write_config({
        "models": {MODEL: {"pods": [{"name": "p0", "address": f"127.0.0.1:{sim.port}",
                                     "deployment": "dep"}]}},
        "routing": {"default_strategy": "slo", "slo": {"profiles": [str(path)], "max_wait_seconds": 60}}})
    s.start_gateway()
    s.start_envoy()
    wait_until(lambda: 'deployment="dep"' in s.metrics(), 20, "profile loaded")
    yield s, redis
    s.stop()
    sim.stop()
    redis.stop()


async def test_a_queued_request_shows_in_the_trace(stack: tuple[LocalStack, RedisServer]):
    from redis import asyncio as aioredis

    s, redis = stack
    c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="sk-test", max_retries=0, timeout=120)
    fill, queued = await fill_then_queue(c, s, MODEL, "p0", 2048, CHAT)
    client = aioredis.Redis.from_url(redis.url)
    try:
        async def gauges() -> list[tuple[int, int]]:
            out = []
            async for key in client.scan_iter(match=f"aibrix:{MODEL}_request_trace_*"):
                v = json.loads(await client.get(key))
                out.append((v["meta_pending_reqs"], v["meta_queueing_reqs"]))
            return out

        deadline = asyncio.get_running_loop().time() + 25  # the queued request's window closes within 10 s
        seen = await gauges()
        while not any(q >= 1 for _, q in seen) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
            seen = await gauges()
        assert not queued.done(), "the fillers must still hold the pod while the window is written"
        assert (2, 1) in seen, seen
    finally:
        await client.aclose()
        for f in fill:
            f.cancel()
        await asyncio.gather(*fill, return_exceptions=True)
    raw = await asyncio.wait_for(queued, 60)  # capacity freed: the held request is served, not lost
    assert raw.http_response.status_code == 200
