"""Routing decision time, in process: `Gateway.route` over pools of 10, 100 and 1000 pods.

Each decision is timed alone (perf_counter_ns around `route`, which runs the post-choice hooks);
requests are completed through `gateway.complete` as the access log would (timed apart: the
post-response hooks), so counts stay bounded, and some stay in flight so the strategy sees unequal
pods. Every shipped strategy is registered and built (the gateway validates them all), so their hooks
run as they would live. load-balance decides on its real inputs: each pod reports KV usage and a
queue (a few pods sit below the KV guardrail), records carry time to first token and end-to-end time
from a per-GPU speed, and `gateway.refresh()` runs as the 1 s background loop would, fitting each
pod's speed from them.

`tracing=True` adds the OpenTelemetry hook as `extproc serve` runs it with OTEL_TRACES_EXPORTER set
(server/otel.py: the SDK's BatchSpanProcessor, here into an exporter that discards), and times the
span's traceparent with each decision, as the processor asks for it.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import replace
from typing import Any

from extproc.perf.stats import median, percentile

MODEL = "bench"
REFRESH_EVERY = 200  # decisions between capacity refreshes (the live loop runs once a second)
GPUS = {"A100": 0.012, "H100": 0.007, "L20": 0.02, "V100": 0.03}  # seconds per token, idle
SLOWDOWN = 0.03  # relative slowdown per request in flight (tpot = base x (1 + SLOWDOWN x batch))


def _gateway(pods: int, strategy: str, capacity: str | None = None) -> Any:
    from extproc.config import parse
    from extproc.server.gateway import Gateway
    from extproc.sharing.shared import LocalState
    from extproc.state.accounting import Accounting
    from extproc.telemetry.engine_metrics import EngineSample

    names = list(GPUS)
    routing: dict[str, Any] = {"default_strategy": strategy, "seed": 1}
    if capacity is not None:
        routing["load_balance"] = {"capacity": capacity}
    config = parse({"models": {MODEL: {"pods": [
        {"name": f"pod-{i}", "address": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000",
         "labels": {"gpu": names[i % len(names)]}} for i in range(pods)]}},
        "routing": routing}, {})
    rng = random.Random(2)
    # One engine sample per pod, as the scrape loop would leave them: KV 5-85 % used (so ~1 in 20
    # pods is KV-critical), a short queue on some.
    samples = {pod.key: EngineSample(running=None, waiting=float(rng.choice((0, 0, 0, 1, 2))),
                                     kv_usage=rng.uniform(0.05, 0.92), cpu_kv_usage=0.0)
               for pod in config.pods}
    accounting = Accounting(LocalState(), samples=lambda key, now: samples.get(key))
    return Gateway(config, accounting=accounting)


def _spans() -> tuple[Any, Any]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from extproc.server.otel import RequestSpans

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    return RequestSpans(provider.get_tracer("bench")), provider


def decision_times(pod_counts: tuple[int, ...] = (10, 100, 1000), decisions: int = 3000,
                   strategy: str | None = None, capacity: str | None = None,
                   tracing: bool = False) -> dict[str, Any]:
    """Median and p99 µs per decision for each pool size, and the median of `complete` (the
    post-response hooks) as `{n}_complete`. `capacity`: routing.load_balance.capacity (None: the
    default, `speed`)."""
    from extproc.openai import Request
    from extproc.perf.stack import strategy_for_bench
    from extproc.vocabulary import RequestEnd

    name = strategy or strategy_for_bench()
    rng = random.Random(1)
    out: dict[str, Any] = {"strategy": name, "tracing": tracing}
    for n in pod_counts:
        gw = _gateway(n, name, capacity)
        spans, provider = _spans() if tracing else (None, None)
        if spans is not None:
            gw.add_spans(spans)
        profile = gw.profile(name)
        requests = [Request(model=MODEL, path="/v1/chat/completions", stream=True,
                            prompt_tokens=rng.randint(50, 2000), max_tokens=rng.randint(16, 512))
                    for _ in range(64)]
        in_flight: deque[tuple[str, Any]] = deque()
        keep = 2 * n  # requests left running: the pods differ in load, as in a busy fleet
        samples: list[float] = []
        completions: list[float] = []
        for i in range(decisions + keep):
            request = replace(requests[i % len(requests)])  # one object per request, as live
            t = time.perf_counter_ns()
            decision = gw.route(request, profile, "bench")
            if spans is not None:
                spans.traceparent(request)
            elapsed = time.perf_counter_ns() - t
            if decision is None:
                raise RuntimeError(f"no pod chosen among {n}")
            if i >= keep:
                samples.append(elapsed / 1e3)
            in_flight.append((decision.key, decision.pod))
            if len(in_flight) > keep:
                key, pod = in_flight.popleft()
                out_tokens = rng.randint(16, 512)
                tpot = GPUS[pod.gpu] * (1.0 + SLOWDOWN * gw.shared.running(pod.key))
                ttfb = 0.05 + rng.random() * 0.1
                t = time.perf_counter_ns()
                gw.complete(key, RequestEnd(200, output_tokens=out_tokens, token_source="usage",
                                            ttfb_s=ttfb, e2e_s=ttfb + tpot * (out_tokens - 1)))
                if i >= keep:
                    completions.append((time.perf_counter_ns() - t) / 1e3)
            if i % REFRESH_EVERY == 0:
                gw.refresh()
        while in_flight:
            gw.complete(in_flight.popleft()[0], RequestEnd(200, output_tokens=1))
        if provider is not None:
            provider.shutdown()
        out[str(n)] = median(samples)
        out[f"{n}_p99"] = percentile(samples, 0.99)
        out[f"{n}_complete"] = median(completions)
    return out
