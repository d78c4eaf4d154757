"""gateway.fail_open through real Envoy: with the gateway stopped, the model paths go round robin to the
model's pods (two engine simulators) and nothing else does; with it running, the gateway routes as ever.
Fail-closed (the default) is covered by test_gateway_lifecycle's gateway_unavailable 503."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from extproc.config import load
from extproc.envoy_bootstrap import fail_open_upstreams
from extproc.envoy_contract import TARGET_POD_HEADER
from extproc.localstack import LocalStack, http_get, wait_until
from tests.integration.sim_fixtures import SimProcess, start_sim

MODEL = "llama2-7b"


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SimProcess]]:
    log_dir = tmp_path_factory.mktemp("fail-open-sims")
    started = [start_sim(["--gpu", "A100-80GB", "--model", MODEL, "--time-scale", "10"], log_dir)
               for _ in range(2)]
    yield started
    for s in started:
        s.proc.stop()


def finished(sim: SimProcess) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = http_get(sim.url + "/metrics")[1].decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name.startswith("vllm:request_success"))


async def chat(stack: LocalStack, **extra: object) -> tuple[str | None, str]:
    """(the target-pod header Envoy adds from the gateway's decision, the answer's model)."""
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}], **extra)
    return raw.headers.get(TARGET_POD_HEADER), raw.parse().model


async def test_fail_open_sends_model_paths_round_robin_while_the_gateway_is_down(
        sims: list[SimProcess], tmp_path: Path) -> None:
    stack = LocalStack(config_path=tmp_path / "gateway.yaml", log_dir=tmp_path)
    stack.write_config({"models": {MODEL: {"pods": [{"name": f"sim-{k}", "address": f"127.0.0.1:{s.port}"}
                                                    for k, s in enumerate(sims)]}},
                        "gateway": {"fail_open": True}})
    config = load(stack.config_path)
    assert config.fail_open
    stack.start_gateway()
    stack.start_envoy(fail_open=fail_open_upstreams(config), model_paths=tuple(sorted(config.model_paths)))
    try:
        pod, _ = await chat(stack)
        assert pod in ("sim-0", "sim-1")  # the gateway chose

        stack.gateway.stop()
        before = [finished(s) for s in sims]
        answers = await asyncio.gather(*(chat(stack, extra_headers={
            "x-gateway-destination-endpoint": "127.0.0.1:9"}) for _ in range(6)))  # a client's pick: ignored
        assert answers == [(None, MODEL)] * 6  # served, by no gateway decision
        await asyncio.to_thread(wait_until, lambda: sum(finished(s) for s in sims) >= sum(before) + 6, 10,
                                "six requests finished at the pods")
        assert all(finished(s) >= b + 2 for s, b in zip(sims, before)), "round robin over both pods"

        # never the engines' other endpoints, nor a model Envoy has no pods for
        status, body = http_get(stack.url + "/metrics")
        assert status == 503 and b"vllm:" not in body
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="nobody-serves-this", max_tokens=4,
                                                 messages=[{"role": "user", "content": "hi"}])
        assert refused.value.status_code == 503

        stack.start_gateway()  # back: the gateway routes again
        await asyncio.to_thread(wait_until, lambda: asyncio.run(chat(stack))[0] is not None, 15,
                                "the gateway's decisions again")
    finally:
        stack.stop()
