"""OpenTelemetry through real Envoy: the gateway (OTEL_TRACES_EXPORTER=console) writes one span per routed
request, a child of the client's traceparent, after the GenAI conventions (gen_ai.provider.name
included), with the engine simulator's real token counts and, for a request the SLO queue held, its
wait. The pod receives the span's traceparent, so the engine's spans join the trace (checked on the
test upstream, which reports the headers it got: the simulator keeps none). Off (the default): the pod
gets the client's traceparent untouched."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from extproc.localstack import LocalStack, http_get, wait_until
from tests.integration.sim_fixtures import SimProcess, start_sim
from tests.support.stack import running_upstreams

MODEL = "llama2-7b"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with running_upstreams(tmp_path_factory.mktemp("otel-upstream"), ("a",)) as ports:
        yield ports["a"]


def seen_traceparent(port: int) -> str | None:
    (headers,) = json.loads(http_get(f"http://127.0.0.1:{port}/stats")[1])["headers"]
    return {k.lower(): v for k, v in headers.items()}.get("traceparent")


def stack_with(tmp_path: Path, upstream: int, env: dict[str, str], routing: dict | None = None,
               deployment: str | None = None) -> LocalStack:
    stack = LocalStack(config_path=tmp_path / "gateway.yaml", log_dir=tmp_path, env=env)
    pod = {"name": "a100-0", "address": f"127.0.0.1:{upstream}", "labels": {"gpu": "A100"}}
    if deployment:
        pod["deployment"] = deployment
    stack.write_config({"models": {MODEL: {"pods": [pod]}},
                        "routing": routing or {"default_strategy": "least-request"}})
    stack.start_gateway()
    stack.start_envoy()
    return stack


def console_spans(stack: LocalStack) -> list[dict]:
    """The spans the gateway's console exporter wrote to its log so far (all of it: `log()` is a tail)."""
    text = stack.gateway.log_path.read_text(errors="replace")
    return [json.loads(m.group(0)) for m in re.finditer(r'^\{\n.*?^\}$', text, re.S | re.M)]


async def chat(stack: LocalStack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0)
    await client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                                         extra_headers={"traceparent": CLIENT_PARENT})


async def test_the_pod_gets_the_gateways_span_as_parent(upstream: int, tmp_path: Path) -> None:
    stack = stack_with(tmp_path, upstream, {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "gw-e2e"})
    try:
        await chat(stack)
        traceparent = seen_traceparent(upstream)
        assert traceparent is not None and traceparent != CLIENT_PARENT
        version, trace_id, span_id, _ = traceparent.split("-")
        assert (version, trace_id) == ("00", CLIENT_TRACE)  # the client's trace, one hop further
        # the span ends when Envoy's access-log record reaches the gateway; the batch goes out within
        # the SDK's schedule delay (5 s)
        spans: list[dict] = []

        def exported() -> bool:
            spans[:] = console_spans(stack)
            return any(s.get("context", {}).get("span_id") == f"0x{span_id}" for s in spans)

        wait_until(exported, 15, "the gateway's span in its console export")
        (span,) = [s for s in spans if s["context"]["span_id"] == f"0x{span_id}"]
        assert span["name"] == f"chat {MODEL}" and span["kind"] == "SpanKind.CLIENT"
        assert span["parent_id"] == "0x00f067aa0ba902b7"
        assert span["resource"]["attributes"]["service.name"] == "gw-e2e"
        a = span["attributes"]
        assert (a["gen_ai.request.model"], a["extproc.pod.name"], a["extproc.pod.gpu"]) == (MODEL, "a100-0", "A100")
        assert (a["http.response.status_code"], a["extproc.routing.strategy"]) == (200, "least-request")
        assert a["gen_ai.usage.output_tokens"] == 3 and a["gen_ai.provider.name"] == "vllm"
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    s = start_sim(["--gpu", "V100", "--model", MODEL], tmp_path_factory.mktemp("otel-sim"))
    yield s
    s.stop()


async def test_spans_through_the_engine_simulator_carry_real_counts_and_the_slo_queue_wait(
        sim: SimProcess, tmp_path: Path) -> None:
    """`slo` routing with a profile by which each request holds half the pod: the third of three
    requests waits in the gateway's queue until one ends, and its span says so."""
    profile = {"gpu": "dep-a100", "cost": 1.0, "tputs": [[2.0, 2.0], [2.0, 2.0]],
               "indexes": [[8, 1024], [16, 4096]], "e2e": [[1.0, 1.0], [1.0, 1.0]],
               "slos": {"percentile": 99, "e2e": 100.0}, "created": time.time()}
    (tmp_path / "dep-a100.json").write_text(json.dumps(profile))
    stack = stack_with(tmp_path, sim.port, {"OTEL_TRACES_EXPORTER": "console"}, deployment="dep-a100",
                       routing={"default_strategy": "slo", "slo": {
                           "profiles": [str(tmp_path / "dep-a100.json")], "max_wait_seconds": 30}})
    try:
        await asyncio.to_thread(wait_until, lambda: 'deployment="dep-a100"' in stack.metrics(), 20,
                                "the profile loaded")
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0, timeout=60)

        async def chat_stream(max_tokens: int) -> int:
            stream = await client.chat.completions.create(
                model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": "hi"}],
                stream=True, stream_options={"include_usage": True},
                extra_headers={"traceparent": CLIENT_PARENT})
            return [c.usage.completion_tokens async for c in stream if c.usage is not None][0]

        fill = [asyncio.create_task(chat_stream(200)) for _ in range(2)]
        await asyncio.to_thread(wait_until, lambda: stack.running(MODEL, "a100-0") == 2, 20, "the pod full")
        queued = asyncio.create_task(chat_stream(5))
        await asyncio.to_thread(wait_until,
                                lambda: stack.sample("extproc_slo_queue_length", model=MODEL) == 1,
                                20, "the third request queued")
        produced = await asyncio.gather(*fill, queued)
        spans: list[dict] = []

        def exported() -> bool:
            spans[:] = [s for s in console_spans(stack) if s["name"] == f"chat {MODEL}"]
            return len(spans) == 3

        await asyncio.to_thread(wait_until, exported, 15, "three spans exported")
        assert sorted(s["attributes"]["gen_ai.usage.output_tokens"] for s in spans) == sorted(produced)
        for span in spans:
            a = span["attributes"]
            assert span["parent_id"] == "0x00f067aa0ba902b7" and a["gen_ai.provider.name"] == "vllm"
            assert a["extproc.routing.strategy"] == "slo" and a["http.response.status_code"] == 200
        (held,) = [s for s in spans if "extproc.slo.queue_wait_s" in s["attributes"]]
        wait = held["attributes"]["extproc.slo.queue_wait_s"]
        assert held["attributes"]["gen_ai.usage.output_tokens"] == produced[-1] and wait > 0
        (event,) = held["events"]
        assert event["name"] == "extproc.slo.dequeued"
        assert event["attributes"]["extproc.slo.queue_wait_s"] == wait
    finally:
        stack.stop()


async def test_off_by_default_the_clients_traceparent_goes_through(upstream: int, tmp_path: Path) -> None:
    stack = stack_with(tmp_path, upstream, {})
    try:
        await chat(stack)
        assert seen_traceparent(upstream) == CLIENT_PARENT
        assert '"span_id"' not in stack.gateway.log()
    finally:
        stack.stop()
