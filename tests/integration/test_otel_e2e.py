"""OpenTelemetry through real Envoy: the gateway (OTEL_TRACES_EXPORTER=console) writes one span per routed
request, a child of the client's traceparent, and the pod receives that span's traceparent, so the
engine's spans join the trace. Off (the default): the pod gets the client's traceparent untouched."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from extproc.localstack import LocalStack, http_get, wait_until
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


def stack_with(tmp_path: Path, upstream: int, env: dict[str, str]) -> LocalStack:
    stack = LocalStack(config_path=tmp_path / "gateway.yaml", log_dir=tmp_path, env=env)
    stack.write_config({"models": {MODEL: {"pods": [{"name": "a100-0", "address": f"127.0.0.1:{upstream}",
                                                     "labels": {"gpu": "A100"}}]}},
                        "routing": {"default_strategy": "least-request"}})
    stack.start_gateway()
    stack.start_envoy()
    return stack


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
            spans[:] = [json.loads(m.group(0)) for m in
                        re.finditer(r'^\{\n.*?^\}$', stack.gateway.log(), re.S | re.M)]
            return any(s.get("context", {}).get("span_id") == f"0x{span_id}" for s in spans)

        wait_until(exported, 15, "the gateway's span in its console export")
        (span,) = [s for s in spans if s["context"]["span_id"] == f"0x{span_id}"]
        assert span["name"] == f"chat {MODEL}" and span["kind"] == "SpanKind.CLIENT"
        assert span["parent_id"] == "0x00f067aa0ba902b7"
        assert span["resource"]["attributes"]["service.name"] == "gw-e2e"
        a = span["attributes"]
        assert (a["gen_ai.request.model"], a["extproc.pod.name"], a["extproc.pod.gpu"]) == (MODEL, "a100-0", "A100")
        assert (a["http.response.status_code"], a["extproc.routing.strategy"]) == (200, "least-request")
        assert a["gen_ai.usage.output_tokens"] == 3
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
