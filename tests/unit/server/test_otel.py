"""OpenTelemetry spans of routed requests (extproc/server/otel.py), into the SDK's in-memory exporter:
GenAI names and attributes, the client's trace continued, the traceparent the engine gets, the outcome;
off unless asked for."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from extproc.openai import Request
from extproc.pool.pod import Pod
from extproc.routing.framework import PodView
from extproc.server import otel
from extproc.server.otel import RequestSpans, enabled, from_env
from extproc.vocabulary import RequestRecord

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"
POD = Pod("llama", "a100-0", "10.0.0.7:8000", deployment="llama-a100", labels={"gpu": "A100"})


@pytest.fixture
def exported() -> tuple[RequestSpans, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestSpans(provider.get_tracer("test")), exporter


def view() -> PodView:
    return PodView(POD, running=3, queued=1.0, kv_free=0.4, capacity=850.0)


def record(request: Request, status: int = 200, **kw: object) -> RequestRecord:
    fields: dict = dict(request_id="r1", model=request.model, pod=POD, strategy="load-balance",
                        status=status, prompt_tokens=12, output_tokens=40, token_source="usage",
                        ttfb_s=0.05, e2e_s=0.9, request=request)
    fields.update(kw)
    return RequestRecord(**fields)


def test_a_routed_request_is_one_genai_span_with_the_decisions_inputs(exported) -> None:
    spans, exporter = exported
    request = Request("llama", "/v1/chat/completions", stream=True, prompt_tokens=11, max_tokens=64)
    spans.post_choice(request, view(), 0.0)
    traceparent = spans.traceparent(request)
    assert not exporter.get_finished_spans()  # open until the access-log record comes
    spans.post_response(record(request), 1.0)
    (span,) = exporter.get_finished_spans()
    assert span.name == "chat llama" and span.kind is SpanKind.CLIENT
    a = span.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"], a["gen_ai.request.max_tokens"]) == \
        ("chat", "llama", 64)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (12, 40)
    assert (a["server.address"], a["server.port"], a["http.response.status_code"]) == ("10.0.0.7", 8000, 200)
    assert (a["extproc.pod.name"], a["extproc.pod.gpu"], a["extproc.pod.deployment"]) == \
        ("a100-0", "A100", "llama-a100")
    assert (a["extproc.pod.running"], a["extproc.pod.queued"], a["extproc.pod.kv_free"],
            a["extproc.pod.capacity_tokens_per_second"]) == (3, 1.0, 0.4, 850.0)
    assert a["extproc.routing.strategy"] == "load-balance" and span.status.status_code is StatusCode.UNSET
    ctx = span.get_span_context()
    assert traceparent.startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")  # sampled (+ random)
    assert span.parent is None  # no client trace: a root span
    assert spans.traceparent(request) is None  # ended: nothing left open


def test_the_required_provider_name_is_the_pods_engine(exported) -> None:
    spans, exporter = exported
    request = Request("llama", "/v1/chat/completions")
    sglang = Pod("llama", "h100-0", "10.0.0.8:30000", engine="sglang")
    spans.post_choice(request, PodView(sglang, running=0, queued=0.0), 0.0)
    spans.post_response(record(request, pod=sglang), 1.0)
    spans.post_choice(request, view(), 0.0)
    spans.post_response(record(request), 1.0)
    assert [s.attributes["gen_ai.provider.name"] for s in exporter.get_finished_spans()] == ["sglang", "vllm"]


def test_a_request_the_slo_queue_held_records_its_wait_and_starts_at_its_arrival(exported) -> None:
    spans, exporter = exported
    queued, other = Request("llama", "/v1/chat/completions"), Request("llama", "/v1/completions")
    spans.waited(queued, 2.5)
    spans.post_choice(queued, view(), 0.0)
    spans.post_choice(other, view(), 0.0)  # routed at once: no wait of another request's
    spans.post_response(record(queued), 1.0)
    spans.post_response(record(other), 1.0)
    held, direct = exporter.get_finished_spans()
    assert held.attributes["extproc.slo.queue_wait_s"] == 2.5
    (event,) = held.events
    assert event.name == "extproc.slo.dequeued" and event.attributes["extproc.slo.queue_wait_s"] == 2.5
    assert event.timestamp - held.start_time == pytest.approx(2.5e9, rel=0.01)
    assert "extproc.slo.queue_wait_s" not in direct.attributes and not direct.events


def test_the_clients_trace_is_continued(exported) -> None:
    spans, exporter = exported
    request = Request("llama", "/v1/completions", traceparent=CLIENT_PARENT)
    spans.post_choice(request, view(), 0.0)
    assert spans.traceparent(request).startswith(f"00-{CLIENT_TRACE}-")
    spans.post_response(record(request), 1.0)
    (span,) = exporter.get_finished_spans()
    assert span.name == "text_completion llama"
    assert f"{span.context.trace_id:032x}" == CLIENT_TRACE
    assert f"{span.parent.span_id:016x}" == "00f067aa0ba902b7"


@pytest.mark.parametrize(("kw", "error"), [({"status": 503}, "503"), ({"aborted": True}, "aborted"),
                                           ({"status": 502, "connect_failure": True}, "connect_failure")])
def test_a_failed_request_is_an_error_span(exported, kw: dict, error: str) -> None:
    spans, exporter = exported
    request = Request("llama", "/v1/chat/completions")
    spans.post_choice(request, view(), 0.0)
    spans.post_response(record(request, **kw), 1.0)
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and span.attributes["error.type"] == error


def test_spans_whose_record_never_comes_are_bounded(exported, monkeypatch) -> None:
    spans, exporter = exported
    monkeypatch.setattr(otel, "MAX_OPEN_SPANS", 3)
    requests = [Request("llama", "/v1/chat/completions") for _ in range(5)]
    for r in requests:
        spans.post_choice(r, view(), 0.0)
    assert len(exporter.get_finished_spans()) == 2  # the two oldest ended to make room
    assert spans.traceparent(requests[0]) is None and spans.traceparent(requests[4]) is not None


OTLP = {"OTEL_TRACES_EXPORTER": "otlp"}


@pytest.mark.parametrize(("env", "on"), [({}, False), ({"OTEL_TRACES_EXPORTER": "none"}, False), (OTLP, True),
                                         ({"OTEL_TRACES_EXPORTER": "console"}, True),
                                         ({**OTLP, "OTEL_SDK_DISABLED": "true"}, False),
                                         ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False)])
def test_off_unless_an_exporter_is_named(env: dict, on: bool) -> None:
    assert enabled(env) is on


def test_from_env_builds_a_batching_provider_or_nothing() -> None:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    assert from_env({}) is None
    assert from_env({"OTEL_TRACES_EXPORTER": "zipkin"}) is None  # unsupported: logged, tracing stays off
    hook, provider = from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SERVICE_NAME": "gw-test"})
    try:
        assert isinstance(hook, RequestSpans)
        assert provider.resource.attributes["service.name"] == "gw-test"
        (processor,) = provider._active_span_processor._span_processors
        assert isinstance(processor, BatchSpanProcessor)  # export off the request path
    finally:
        provider.shutdown()
