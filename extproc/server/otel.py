"""OpenTelemetry: one span per routed request, and its W3C traceparent passed to the engine.

Off by default. On when OTEL_TRACES_EXPORTER names an exporter (`otlp`, `console`) and OTEL_SDK_DISABLED
is not true; the exporter is configured by the standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT,
..._PROTOCOL, ..._HEADERS, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) and sits behind the SDK's
BatchSpanProcessor: the request path only builds the span in memory; export runs on the SDK's thread,
and a full queue drops spans, never waits. Needs the `otel` extra (opentelemetry-sdk and
opentelemetry-exporter-otlp-proto-http).

The span opens when the pod is chosen (a post-choice hook) and ends when the request's access-log
record arrives (post-response), named and attributed after the GenAI semantic conventions where they
apply (`chat <model>`, gen_ai.* with the required gen_ai.provider.name, server.*,
http.response.status_code, error.type), with the routing decision's inputs under extproc.*. A request
the SLO queue held has a span that starts at its arrival, an `extproc.slo.dequeued` event when it left
the queue and its wait in `extproc.slo.queue_wait_s`. A client's `traceparent` makes it a child span;
the engine gets
this span's traceparent (Envoy adds it from the decision's metadata), so its spans join the trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from extproc.openai import Request
from extproc.routing.framework import PodView
from extproc.vocabulary import RequestRecord

log = logging.getLogger(__name__)

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
              "/v1/embeddings": "embeddings"}
QUEUE_EVENT = "extproc.slo.dequeued"  # a span event: the request left the SLO queue for its pod
QUEUE_WAIT = "extproc.slo.queue_wait_s"  # seconds in the SLO queue (attribute of the span and event)
MAX_OPEN_SPANS = 100_000  # spans whose record never came (a lost access log) are ended beyond this


def enabled(env: Mapping[str, str]) -> bool:
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    return bool(exporter) and exporter != "none" and not disabled


class RequestSpans:
    """The gateway hook (post_choice / post_response) that traces routed requests."""

    def __init__(self, tracer: Any) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer
        self._kind = SpanKind.CLIENT
        self._propagator = TraceContextTextMapPropagator()
        # id(Request) -> (the Request, its span, the decision's inputs): the access-log record carries
        # the same Request object; holding it keeps its id from being reused while the span is open
        self._open: dict[int, tuple[Any, ...]] = {}
        self._waited: tuple[Request, float] | None = None  # the SLO queue's request being routed now

    def waited(self, request: Request, seconds: float) -> None:
        """The SLO waiting room is routing `request` after `seconds` in its queue: the span about to
        open starts when the request arrived and records the wait (one request at a time: the room
        routes synchronously, this is read by the post_choice that follows or dropped)."""
        self._waited = (request, seconds)

    def post_choice(self, request: Request, chosen: PodView, now: float) -> None:
        """Opens the span, bare: its attributes are set when it ends, off the decision's path (the SDK
        checks each one, ~4 µs apiece). The decision's inputs are kept as they were at the choice."""
        parent = (self._propagator.extract({"traceparent": request.traceparent})
                  if request.traceparent else None)
        if len(self._open) >= MAX_OPEN_SPANS:
            self._open.pop(next(iter(self._open)))[1].end()
        wait, self._waited = (self._waited[1] if self._waited is not None and self._waited[0] is request
                              else None), None
        # a queued request's span covers its wait: it starts when the request arrived
        start = time.time_ns() - int(wait * 1e9) if wait else None
        span = self._tracer.start_span(f"{OPERATIONS.get(request.path, 'chat')} {request.model}",
                                       context=parent, kind=self._kind, start_time=start)
        if wait is not None:
            span.add_event(QUEUE_EVENT, {QUEUE_WAIT: wait})  # when it left the queue
        self._open[id(request)] = (request, span, chosen.pod, chosen.running, chosen.queued,
                                   chosen.kv_free, chosen.capacity, wait)

    def traceparent(self, request: Request) -> str | None:
        """The W3C traceparent of the request's span, for the engine."""
        entry = self._open.get(id(request))
        if entry is None:
            return None
        ctx = entry[1].get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def post_response(self, record: RequestRecord, now: float) -> None:
        from opentelemetry.trace import Status, StatusCode

        entry = self._open.pop(id(record.request), None)
        if entry is None:
            return
        request, span, pod, running, queued, kv_free, capacity, wait = entry
        host, _, port = pod.address.rpartition(":")
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": OPERATIONS.get(request.path, "chat"),
            # required: no registered provider fits a self-hosted engine, so its own name (the pod's
            # engine: vllm, sglang, trtllm), which the conventions allow for providers off their list
            "gen_ai.provider.name": pod.engine,
            "gen_ai.request.model": request.model,
            "server.address": host.strip("[]"), "server.port": int(port) if port.isdigit() else 0,
            "extproc.pod.name": pod.name, "extproc.pod.gpu": pod.gpu,
            "extproc.pod.deployment": pod.deployment,
            "extproc.pod.running": running, "extproc.pod.queued": queued,
            "extproc.request.stream": request.stream, "extproc.routing.strategy": record.strategy,
            "http.response.status_code": record.status,
            "gen_ai.usage.input_tokens": (record.prompt_tokens if record.prompt_tokens is not None
                                          else request.prompt_tokens),
        }
        for name, value in (("gen_ai.request.max_tokens", request.max_tokens),
                            ("extproc.pod.kv_free", kv_free),
                            ("extproc.pod.capacity_tokens_per_second", capacity),
                            ("gen_ai.usage.output_tokens", record.output_tokens),
                            ("extproc.time_to_first_byte_s", record.ttfb_s),
                            (QUEUE_WAIT, wait)):
            if value is not None:
                attributes[name] = value
        span.set_attributes(attributes)
        if record.aborted or record.connect_failure or not record.ok:
            reason = ("aborted" if record.aborted else "connect_failure" if record.connect_failure
                      else str(record.status))
            span.set_attribute("error.type", reason)
            span.set_status(Status(StatusCode.ERROR, reason))
        span.end()


def from_env(env: Mapping[str, str]) -> tuple[RequestSpans, Any] | None:
    """The hook and its TracerProvider (shut down at exit to flush), or None when tracing is off or its
    packages are missing (logged: a tracing setup never stops the gateway)."""
    if not enabled(env):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        exporter = _exporter(env.get("OTEL_TRACES_EXPORTER", "").strip().lower(), env)
    except ImportError as e:
        # xds-protos (a dependency) ships an old opentelemetry/proto; installed after opentelemetry-proto
        # it overwrites that package's files and the exporter's import fails.
        clobbered = "opentelemetry.proto" in str(e)
        hint = ("pip install --force-reinstall --no-deps opentelemetry-proto" if clobbered
                else "pip install 'extproc[otel]'")
        log.error("OpenTelemetry tracing is off: %s (%s)", e, hint)
        return None
    except ValueError as e:
        log.error("OpenTelemetry tracing is off: %s", e)
        return None
    provider = TracerProvider(resource=Resource.create(
        {"service.name": env.get("OTEL_SERVICE_NAME", "extproc-gateway")}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("OpenTelemetry: a span per routed request, exported by %s", type(exporter).__name__)
    return RequestSpans(provider.get_tracer("extproc.gateway")), provider


def _exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: supported are otlp and console")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    if protocol.strip() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    return HttpExporter()
