"""The metrics the Gateway API Inference Extension's reference endpoint picker exports, under its names,
labels and buckets (its pkg/epp/metrics/metrics.go), beside the gateway's own extproc_* series: the
dashboards users already chart for an InferencePool keep working when extproc is the pool's picker.

- `inference_pool_*` (labels `name`): readings of the pool, computed when /metrics is scraped from the
  views routing reads (no work on the request path). `name` is the followed InferencePool's name
  (discovery.inferencepool), else each model's name: a model's pods are its pool.
- `inference_objective_*` (labels `model_name`, `target_model_name`[, `priority`]): per request, from its
  completion record (a post-response hook: off the ext_proc stream), kept as plain counts per model
  (a record costs a few bisects) and rendered when /metrics is scraped. Counted when the record
  arrives, errors included; the histograms take successful requests only. `target_model_name` is the
  model routed to (extproc does not rewrite models); `priority` is 0 (no InferenceObjective is read).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from extproc.config import Config
from extproc.server.metrics import GatewayCollector
from extproc.vocabulary import PodView, RequestRecord

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


class InferencePoolCollector(GatewayCollector):
    """inference_pool_average_kv_cache_utilization, _average_queue_size, _average_running_requests,
    _ready_pods: averages over the pool's ready pods, as the reference picker reports them."""

    _gw: PoolReadings

    def collect(self) -> Iterator[Metric]:
        gw = self._gw
        now = gw.clock()
        kv = GaugeMetricFamily("inference_pool_average_kv_cache_utilization",
                               "The average kv cache utilization for an inference server pool.",
                               labels=["name"])
        queue = GaugeMetricFamily("inference_pool_average_queue_size",
                                  "The average number of requests pending in the model server queue.",
                                  labels=["name"])
        running = GaugeMetricFamily("inference_pool_average_running_requests",
                                    "The average number of running requests across model servers in the "
                                    "pool.",
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


@dataclass(slots=True)
class Buckets:
    """One label set's histogram as plain numbers: a record adds with one bisect (prometheus_client's
    Histogram.observe walks its bounds under a lock: ~2 us each, six per record); rendered at scrape."""
    bounds: tuple[float, ...]
    counts: list[int]  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0

    @staticmethod
    def of(bounds: tuple[float, ...]) -> Buckets:
        return Buckets(bounds, [0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: a value on a bound falls in it
        self.total += value

    def samples(self) -> tuple[list[tuple[str, float]], float]:
        cumulative, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            cumulative.append((floatToGoString(bound), running))
        return cumulative, self.total


# name, help, buckets of each per-objective histogram, in the order ObjectiveSeries holds them
HISTOGRAMS = (
    ("inference_objective_request_duration_seconds", "Inference objective response latency distribution in "
     "seconds for each model and target model.", LATENCY_BUCKETS),
    ("inference_objective_request_ttft_seconds", "Inference model TTFT distribution in seconds for each "
     "model and target model.", LATENCY_BUCKETS),
    ("inference_objective_request_tpot_seconds", "Inference model TPOT distribution in seconds for each "
     "model and target model.", TPOT_BUCKETS),
    ("inference_objective_normalized_time_per_output_token_seconds", "Inference objective latency divided by "
     "number of output tokens in seconds for each model and target model.", NTPOT_BUCKETS),
    ("inference_objective_input_tokens", "Inference objective input token count distribution for requests in "
     "each model.", INPUT_TOKEN_BUCKETS),
    ("inference_objective_output_tokens", "Inference objective output token count distribution for requests "
     "in each model.", OUTPUT_TOKEN_BUCKETS),
)


@dataclass(slots=True)
class ObjectiveSeries:
    """One model's counts."""
    requests: int = 0
    histograms: tuple[Buckets, ...] = field(
        default_factory=lambda: tuple(Buckets.of(bounds) for _, _, bounds in HISTOGRAMS))


class ObjectiveMetrics:
    """A post-response hook and its collector: each finished request into the reference picker's
    per-objective series."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._series: dict[str, ObjectiveSeries] = {}  # model -> its counts
        if registry is not None:
            registry.register(self)

    def post_response(self, record: RequestRecord, now: float) -> None:
        series = self._series.get(record.model)
        if series is None:
            series = self._series[record.model] = ObjectiveSeries()
        series.requests += 1
        if not record.ok:
            return
        duration, ttft, tpot, ntpot, input_tokens, output_tokens = series.histograms
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

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("inference_objective_request", "Counter of inference objective "
                                       "requests broken out for each model and target model.",
                                       labels=[*MODEL_LABELS, "priority"])
        families = [HistogramMetricFamily(name, doc, labels=list(MODEL_LABELS))
                    for name, doc, _ in HISTOGRAMS]
        for model, series in self._series.items():
            requests.add_metric([model, model, PRIORITY], series.requests)
            for family, histogram in zip(families, series.histograms, strict=True):
                buckets, total = histogram.samples()
                family.add_metric([model, model], buckets, total)
        yield requests
        yield from families
