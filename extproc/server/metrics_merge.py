"""One /metrics for the workers of `serve --workers N`: their exposition texts merged into one.

Counters, histograms and summaries add up (each worker counts its own requests). Gauges are of two
kinds: a worker's own share of something (requests it routed, its SLO queue) adds up like a counter;
a reading of state every worker sees alike (a pod's in-flight count summed across gateways, its
capacity, KV, health, info) is the same in each and is reported once (the largest, so a worker that
has not caught up yet does not hide the value).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# Gauges that hold one worker's own share, so the gateway's value is their sum.
SUMMED_GAUGES = frozenset({
    "extproc_pod_local_running_requests",
    "extproc_slo_queue_length",
})


def merge(texts: Iterable[str]) -> str:
    families: dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            kind, doc, samples = families.setdefault(family.name, (family.type, family.documentation, {}))
            add = kind != "gauge" or family.name in SUMMED_GAUGES
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # a creation time per worker: no sum of those means anything
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in samples:
                    samples[key] = sample.value
                elif add:
                    samples[key] += sample.value
                else:
                    samples[key] = max(samples[key], sample.value)
    out = []
    for name, (kind, doc, samples) in families.items():
        metric = Metric(name, doc, kind)
        for (sample_name, labels), value in samples.items():
            metric.add_sample(sample_name, dict(labels), value)
        out.append(metric)
    return generate_latest(_Fixed(out)).decode()


class _Fixed:
    """A collector of metrics already built (what `generate_latest` renders)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        return self._metrics


__all__ = ["SUMMED_GAUGES", "merge"]
