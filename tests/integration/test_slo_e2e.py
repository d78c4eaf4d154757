"""Through real Envoy with the engine simulator and the `openai` client: `slo` holds a request in the
gateway queue while the pod is full by its profile and answers it once a completion frees capacity; a
request whose SLO is breached while it waits gets a 429 with Retry-After."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import openai
import pytest

from extproc.localstack import LocalStack, wait_until
from tests.integration.sim_fixtures import start_sim
from tests.support.traffic import fill_then_queue

RELAXED, TIGHT = "llama2-7b", "llama2-7b-tight"
CHAT = [{"role": "user", "content": "Say this is a test!"}]


def profile(deployment: str, target_e2e: float) -> dict:
    # every cell: 2 requests/s at 1 s latency -> each request holds half a pod (1 / (tput x e2e))
    return {"gpu": deployment, "cost": 1.0, "tputs": [[2.0, 2.0], [2.0, 2.0]],
            "indexes": [[8, 1024], [16, 4096]], "e2e": [[1.0, 1.0], [1.0, 1.0]],
            "slos": {"percentile": 99, "e2e": target_e2e}, "created": time.time()}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    log_dir = tmp_path_factory.mktemp("slo")
    relaxed = start_sim(["--gpu", "V100", "--model", "llama2-7b"], log_dir)
    tight = start_sim(["--gpu", "V100", "--model", "llama2-7b", "--served-model-name", TIGHT], log_dir)
    files = []
    for name, target in (("dep-relaxed", 100.0), ("dep-tight", 2.0)):   # tight: 1 s of slack
        path = log_dir / f"{name}.json"
        path.write_text(json.dumps(profile(name, target)))
        files.append(str(path))
    s = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
    s.write_config({
        "models": {RELAXED: {"pods": [{"name": "r0", "address": f"127.0.0.1:{relaxed.port}",
                                       "deployment": "dep-relaxed"}]},
                   TIGHT: {"pods": [{"name": "t0", "address": f"127.0.0.1:{tight.port}",
                                     "deployment": "dep-tight"}]}},
        "routing": {"default_strategy": "slo", "slo": {"profiles": files, "max_wait_seconds": 30}}})
    s.start_gateway()
    s.start_envoy()
    wait_until(lambda: 'deployment="dep-tight"' in s.metrics() and 'deployment="dep-relaxed"' in s.metrics(),
               20, "profiles loaded")
    yield s
    s.stop()
    relaxed.stop()
    tight.stop()


def client(stack: LocalStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0, timeout=60)


async def test_queued_request_is_answered_once_capacity_frees(stack: LocalStack):
    fill, queued = await fill_then_queue(client(stack), stack, RELAXED, "r0", 256, CHAT)
    assert not queued.done()
    raw = await asyncio.wait_for(queued, 60)
    assert raw.http_response.status_code == 200 and raw.headers["target-pod"] == "r0"
    await asyncio.gather(*fill)
    assert stack.sample("extproc_slo_queue_wait_seconds_count", model=RELAXED, outcome="dispatched") >= 1
    assert stack.sample("extproc_slo_queue_length", model=RELAXED) == 0


async def test_breached_while_queued_gets_429_with_retry_after(stack: LocalStack):
    c = client(stack)
    fill = [asyncio.create_task(c.chat.completions.create(model=TIGHT, messages=CHAT, max_tokens=1024))
            for _ in range(2)]
    await asyncio.to_thread(wait_until, lambda: stack.running(TIGHT, "t0") == 2, 20, "pod full")
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as err:
        await c.chat.completions.create(model=TIGHT, messages=CHAT, max_tokens=8)
    waited = time.monotonic() - started
    assert err.value.status_code == 429
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert err.value.body["code"] == "slo_breached"
    assert 0.5 <= waited < 10, waited              # it waited about its slack (1 s), not at once
    assert any(not f.done() for f in fill), "the fillers must still run: capacity never freed"
    assert stack.sample("extproc_slo_rejections_total", model=TIGHT, reason="slo_breached") == 1
    for f in fill:
        f.cancel()
    await asyncio.gather(*fill, return_exceptions=True)
