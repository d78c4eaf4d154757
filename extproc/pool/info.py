"""`extproc_pod_info`: one series per known pod carrying what the per-pod metrics leave out (GPU type,
deployment, namespace, engine), so dashboards can aggregate any per-pod series by GPU type with
`* on (model, pod) group_left (gpu) extproc_pod_info`. The per-pod series keep only (model, pod)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from extproc.pool.pod import Pod

LABELS = ["model", "pod", "gpu", "deployment", "namespace", "engine"]


class PodInfoCollector:
    def __init__(self, pods: Callable[[], list[Pod]]) -> None:
        self._pods = pods  # a callable: a reload or a discovery change replaces the pool

    def describe(self) -> list[Metric]:
        return []  # unchecked: the series depend on the pool

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("extproc_pod_info", "1 per known pod; labels: its GPU type, deployment, "
                                 "namespace and engine", labels=LABELS)
        seen = set()
        for pod in self._pods():
            labels = [pod.model, pod.name, pod.gpu, pod.deployment, pod.namespace, pod.engine]
            if (pod.model, pod.name) not in seen:  # one series per (model, pod), as the others
                seen.add((pod.model, pod.name))
                info.add_metric(labels, 1.0)
        yield info
