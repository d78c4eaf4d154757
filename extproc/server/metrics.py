"""Per-pod gauges computed when /metrics is scraped, so the request path never updates a gauge."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from extproc.routing.store import Series
from extproc.state.accounting import PodFigures
from extproc.vocabulary import PodView

LABELS = ["model", "pod"]
FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class Scraped(Protocol):
    """What /metrics reads of the gateway (extproc.server.gateway.Gateway)."""

    clock: Callable[[], float]
    router: Any

    def pod_figures(self, now: float) -> list[PodFigures]: ...

    def views(self, model: str, now: float) -> Sequence[PodView]: ...


def family(series: Series) -> Metric:
    metric = FAMILIES[series.kind](series.name, series.help, labels=list(series.labels))
    for labels, value in series.samples:
        metric.add_metric(list(labels), value)
    return metric


class GatewayCollector:
    """Series computed from the gateway's state when /metrics is scraped."""

    def __init__(self, gateway: Any) -> None:
        self._gw = gateway

    def describe(self) -> list[Metric]:
        return []  # unchecked: the series depend on the pool


class PodMetricsCollector(GatewayCollector):
    _gw: Scraped

    def collect(self) -> Iterator[Metric]:
        gw = self._gw
        now = gw.clock()
        running = GaugeMetricFamily("extproc_pod_running_requests", "Requests in flight per pod, "
                                    "across every gateway replica when Redis is configured", labels=LABELS)
        local = GaugeMetricFamily("extproc_pod_local_running_requests",
                                  "Requests in flight per pod routed by this gateway", labels=LABELS)
        queued = GaugeMetricFamily("extproc_pod_queued_requests", "Requests waiting in the engine",
                                   labels=LABELS)
        kv_free = GaugeMetricFamily("extproc_pod_kv_free_ratio", "Free fraction of the GPU KV cache",
                                    labels=LABELS)
        capacity = GaugeMetricFamily("extproc_pod_capacity_tokens_per_second",
                                     "Learned serving capacity (output tokens/s): saturated throughput "
                                     "for the current mix (capacity: speed), else the observed rate",
                                     labels=LABELS)
        observed = GaugeMetricFamily("extproc_pod_observed_tokens_per_second",
                                     "Output tokens/s the pod was seen to produce while busy (AIBrix's "
                                     "estimate, capacity: observed)", labels=LABELS)
        tpot = GaugeMetricFamily("extproc_pod_time_per_output_token_seconds",
                                 "Fitted time per output token at the pod's current in-flight count",
                                 labels=LABELS)
        healthy = GaugeMetricFamily("extproc_pod_healthy", "1 while the pod receives traffic",
                                    labels=LABELS)
        tokens = CounterMetricFamily("extproc_output_tokens", "Output tokens tallied by this gateway",
                                     labels=LABELS)
        for pod in gw.pod_figures(now):
            view = pod.view
            labels = [view.pod.model, view.pod.name]
            running.add_metric(labels, view.running)
            local.add_metric(labels, pod.local_running)
            queued.add_metric(labels, view.queued)
            if view.kv_free is not None:
                kv_free.add_metric(labels, view.kv_free)
            if view.capacity is not None:
                capacity.add_metric(labels, view.capacity)
            if pod.observed is not None:
                observed.add_metric(labels, pod.observed)
            if pod.speed is not None:
                tpot.add_metric(labels, pod.speed.tpot(max(1, view.running)))
            healthy.add_metric(labels, 1.0 if view.healthy else 0.0)
            tokens.add_metric(labels, pod.output_tokens)
        imbalance = CounterMetricFamily("extproc_load_imbalance", "Times the load-imbalance gate kept only "
                                        "the least-loaded pods", labels=["model"])
        for model, n in gw.router.imbalance_total.items():
            imbalance.add_metric([model], n)
        yield from (running, local, queued, kv_free, capacity, observed, tpot, healthy, tokens, imbalance)
        # what strategies learned (prefix-cache lookups, SLO utilization ...), each strategy's own series
        for series in gw.router.state.collect(lambda model: gw.views(model, now), now):
            yield family(series)
