"""Through real Envoy, the gateway and an engine simulator: the Gateway API Inference Extension's pool and
per-objective series (extproc/server/inference_metrics.py) are on the admin /metrics beside extproc's
own, and move with the requests that go through."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from extproc.localstack import LocalStack, wait_until
from tests.integration.sim_fixtures import start_sim

MODEL = "llama2-7b"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say this is a test, at some length!"}]}
LABELS = {"model_name": MODEL, "target_model_name": MODEL}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    log_dir = tmp_path_factory.mktemp("inference-metrics")
    sim = start_sim(["--gpu", "H100", "--model", MODEL, "--time-scale", "8"], log_dir)
    s = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
    s.write_config({"models": {MODEL: {"pods": [
        {"name": "h100-0", "address": f"127.0.0.1:{sim.port}", "labels": {"gpu": "H100"}}]}}})
    try:
        s.start_gateway()
        s.start_envoy()
        yield s
    finally:
        s.stop()
        sim.proc.stop()


def pool_reading(stack: LocalStack, metric: str) -> float | None:
    """The pool gauge for this model's pool (its label is `name`, which LocalStack.sample takes itself)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = [s.value for f in text_string_to_metric_families(stack.metrics()) for s in f.samples
             if s.name == metric and s.labels == {"name": MODEL}]
    return found[0] if found else None


async def test_the_pool_and_objective_series_move_with_requests(stack: LocalStack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0)
    before = stack.sample("inference_objective_request_total", priority="0", **LABELS)
    # the pool's readings: one ready pod, its engine's KV usage and queue as scraped (0 when idle)
    await asyncio.to_thread(wait_until, lambda: pool_reading(stack, "inference_pool_ready_pods") == 1,
                            10, "the pool's ready pod")
    await asyncio.to_thread(wait_until, lambda: pool_reading(
        stack, "inference_pool_average_kv_cache_utilization") is not None, 10, "a KV reading from the engine")
    assert pool_reading(stack, "inference_pool_average_queue_size") == 0  # idle

    plain = await client.chat.completions.create(max_tokens=12, **CHAT)
    assert plain.usage.completion_tokens == 12
    stream = await client.chat.completions.create(max_tokens=16, stream=True, **CHAT)
    chunks = [c async for c in stream]
    assert chunks
    await asyncio.to_thread(wait_until, lambda: stack.sample(
        "inference_objective_request_total", priority="0", **LABELS) == before + 2, 10,
        "two requests counted")

    assert stack.sample("inference_objective_request_duration_seconds_count", **LABELS) == 2
    assert stack.sample("inference_objective_output_tokens_sum", **LABELS) == 12 + 16
    assert stack.sample("inference_objective_output_tokens_count", **LABELS) == 2
    assert stack.sample("inference_objective_input_tokens_count", **LABELS) == 2
    assert stack.sample("inference_objective_input_tokens_sum", **LABELS) >= 2 * 8  # the prompt's words
    assert stack.sample("inference_objective_normalized_time_per_output_token_seconds_count", **LABELS) == 2
    # TTFT and TPOT from the streamed request only
    assert stack.sample("inference_objective_request_ttft_seconds_count", **LABELS) == 1
    assert stack.sample("inference_objective_request_tpot_seconds_count", **LABELS) == 1
    tpot = stack.sample("inference_objective_request_tpot_seconds_sum", **LABELS)
    duration = stack.sample("inference_objective_request_duration_seconds_sum", **LABELS)
    assert 0 < tpot < duration
    # the reference picker's buckets: an hour is the last finite latency bucket
    assert 'inference_objective_request_duration_seconds_bucket{le="3600.0",model_name="llama2-7b"' in \
        stack.metrics()
    # extproc's own series are still there beside them
    assert stack.sample("extproc_requests_total", model=MODEL, code="200") >= 2
