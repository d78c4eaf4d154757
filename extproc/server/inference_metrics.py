"""The metrics the Gateway API Inference Extension's reference endpoint picker exports, under its names,
labels and buckets (its pkg/epp/metrics/metrics.go), beside the gateway's own extproc_* series: the
dashboards users already chart for an InferencePool keep working when extproc is the pool's picker.

- `inference_pool_*` (labels `name`): readings of the pool, computed when /metrics is scraped from the
  views routing reads (no work on the request path). `name` is the followed InferencePool's name
  (discovery.inferencepool), else each model's name: a model's pods are its pool.
- `inference_objective_*` (labels `model_name`, `target_model_name`[, `priority`]): per request, from its
  completion record (a post-response hook: off the ext_proc stream), one label set's children kept per
  model so a record costs a few observes. Counted when the record arrives, errors included; the
  histograms take successful requests only. `target_model_name` is the model routed to (extproc does not
  rewrite models); `priority` is 0 (no InferenceObjective is read).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from extproc.config import Config
from extproc.state.record import PodView, RequestRecord

# 5 ms to an hour, for long-running inference (the reference's generalLatencyBuckets)
LATENCY_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15,
                   20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
TPOT_BUCKETS = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.6, 0.8, 1, 1.5, 2, 3, 4.5, 6, 12, 18, 24, 30, 36, 48, 60, 90, 120, 180, 270, 360)
NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
INPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
                       262144, 524288, 1048576)
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
MODEL_LABELS = ("model_name", "target_model_name")
PRIORITY = "0"


class PoolReadings(Protocol):
    """What the pool gauges read of the gateway (extproc.server.gateway.Gateway)."""

    clock: Callable[[], float]
    config: Config
    pool: Any

    def views(self, model: str, now: float) -> Sequence[PodView]: ...


def pool_names(config: Config, models: Sequence[str]) -> dict[str, list[str]]:
    """The pools to report, by name: the followed InferencePool holds every model; else one per model."""
    followed = config.discovery.inferencepool
    if followed is not None:
        return {followed.name: list(models)}
    return {model: [model] for model in models}


class InferencePoolCollector:
    """inference_pool_average_kv_cache_utilization, _average_queue_size, _average_running_requests,
    _ready_pods: averages over the pool's ready pods, as the reference picker reports them."""

    def __init__(self, gateway: PoolReadings) -> None:
        self._gw = gateway

    def describe(self) -> list[Metric]:
        return []  # unchecked: the series depend on the pool

    def collect(self) -> Iterator[Metric]:
        gw = self._gw
        now = gw.clock()
        kv = GaugeMetricFamily("inference_pool_average_kv_cache_utilization",
                               "The average kv cache utilization for an inference server pool.", labels=["name"])
        queue = GaugeMetricFamily("inference_pool_average_queue_size",
                                  "The average number of requests pending in the model server queue.",
                                  labels=["name"])
        running = GaugeMetricFamily("inference_pool_average_running_requests",
                                    "The average number of running requests across model servers in the pool.",
                                    labels=["name"])
        ready = GaugeMetricFamily("inference_pool_ready_pods",
                                  "The number of ready pods in the inference server pool.", labels=["name"])
        for name, models in pool_names(gw.config, gw.pool.models()).items():
            views = [v for model in models for v in gw.views(model, now)]
            ready.add_metric([name], len(views))
            if not views:
                continue
            queue.add_metric([name], sum(v.queued for v in views) / len(views))
            running.add_metric([name], sum(v.running for v in views) / len(views))
            used = [1.0 - v.kv_free for v in views if v.kv_free is not None]
            if used:
                kv.add_metric([name], sum(used) / len(used))
        yield from (kv, queue, running, ready)


class ObjectiveMetrics:
    """A post-response hook: each finished request into the reference picker's per-objective series."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.requests = Counter("inference_objective_request",
                                "Counter of inference objective requests broken out for each model and "
                                "target model.", [*MODEL_LABELS, "priority"], registry=registry)
        self.duration = Histogram("inference_objective_request_duration_seconds",
                                  "Inference objective response latency distribution in seconds for each "
                                  "model and target model.", MODEL_LABELS, buckets=LATENCY_BUCKETS,
                                  registry=registry)
        self.ttft = Histogram("inference_objective_request_ttft_seconds",
                              "Inference model TTFT distribution in seconds for each model and target model.",
                              MODEL_LABELS, buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("inference_objective_request_tpot_seconds",
                              "Inference model TPOT distribution in seconds for each model and target model.",
                              MODEL_LABELS, buckets=TPOT_BUCKETS, registry=registry)
        self.ntpot = Histogram("inference_objective_normalized_time_per_output_token_seconds",
                               "Inference objective latency divided by number of output tokens in seconds "
                               "for each model and target model.", MODEL_LABELS, buckets=NTPOT_BUCKETS,
                               registry=registry)
        self.input_tokens = Histogram("inference_objective_input_tokens",
                                      "Inference objective input token count distribution for requests in "
                                      "each model.", MODEL_LABELS, buckets=INPUT_TOKEN_BUCKETS,
                                      registry=registry)
        self.output_tokens = Histogram("inference_objective_output_tokens",
                                       "Inference objective output token count distribution for requests in "
                                       "each model.", MODEL_LABELS, buckets=OUTPUT_TOKEN_BUCKETS,
                                       registry=registry)
        self._children: dict[str, tuple[Any, ...]] = {}  # model -> its series' children

    def _of(self, model: str) -> tuple[Any, ...]:
        children = self._children.get(model)
        if children is None:
            labels = (model, model)
            children = self._children[model] = (
                self.requests.labels(*labels, PRIORITY), self.duration.labels(*labels),
                self.ttft.labels(*labels), self.tpot.labels(*labels), self.ntpot.labels(*labels),
                self.input_tokens.labels(*labels), self.output_tokens.labels(*labels))
        return children

    def post_response(self, record: RequestRecord, now: float) -> None:
        requests, duration, ttft, tpot, ntpot, input_tokens, output_tokens = self._of(record.model)
        requests.inc()
        if not record.ok:
            return
        e2e = record.e2e_s
        duration.observe(e2e)
        if record.prompt_tokens:
            input_tokens.observe(record.prompt_tokens)
        out = record.output_tokens
        if out:
            output_tokens.observe(out)
            ntpot.observe(e2e / out)
        if record.stream and record.ttfb_s is not None:
            ttft.observe(record.ttfb_s)
            if out and out > 1:
                tpot.observe(max(0.0, e2e - record.ttfb_s) / (out - 1))
