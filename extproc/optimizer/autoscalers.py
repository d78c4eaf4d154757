"""The most replicas each Deployment's autoscaler will run, read from the Kubernetes API: a plan must not
count on replicas its autoscaler will never start.

With `kubernetes.autoscalers` in the optimizer's config, the optimizer lists and watches (the same
`pool.watch.ListWatcher` loop as its Deployments) HorizontalPodAutoscalers (`hpa`: autoscaling/v2, which
KEDA's ScaledObjects also create) and/or AIBrix PodAutoscalers (`podautoscaler`:
autoscaling.aibrix.ai/v1alpha1), and each one whose `spec.scaleTargetRef` is a Deployment caps that
Deployment at its `spec.maxReplicas` (the lowest, when several name it, and below the Deployment's own
`model.aibrix.ai/max_replicas` label only if lower). Access needed: get, list, watch on those kinds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from extproc.optimizer.deployments import AUTOSCALER_KINDS, Deployment
from extproc.pool.convert import as_map
from extproc.pool.watch import ListWatcher

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Cap:
    """An autoscaler's most replicas for the Deployment it scales."""

    namespace: str
    deployment: str
    max_replicas: int


def cap_of(obj: Mapping[str, Any]) -> Cap | None:
    """The cap an HPA or PodAutoscaler object sets; None when it scales something else or has none."""
    meta, spec = as_map(obj.get("metadata")), as_map(obj.get("spec"))
    target = as_map(spec.get("scaleTargetRef"))
    most = spec.get("maxReplicas")
    if target.get("kind") != "Deployment" or not target.get("name"):
        return None
    if isinstance(most, bool) or not isinstance(most, int) or most < 0:
        log.warning("%s %s/%s: spec.maxReplicas %r is not a whole number; not read", obj.get("kind"),
                    meta.get("namespace"), meta.get("name"), most)
        return None
    return Cap(meta.get("namespace") or "default", str(target["name"]), most)


def capped(deployments: Iterable[Deployment], caps: Iterable[Cap]) -> list[Deployment]:
    """Each deployment with the lowest of its own max_replicas and its autoscalers' maxReplicas."""
    lowest: dict[str, int] = {}
    for c in caps:
        key = f"{c.namespace}/{c.deployment}"
        lowest[key] = min(lowest.get(key, c.max_replicas), c.max_replicas)
    out = []
    for d in deployments:
        most = lowest.get(d.key)
        if most is not None and (d.max_replicas is None or most < d.max_replicas):
            d = replace(d, max_replicas=most)
        out.append(d)
    return out


class HpaWatcher(ListWatcher[Cap]):
    kind = "horizontalpodautoscaler"

    def _api_class(self, client: Any) -> Any:
        return client.AutoscalingV2Api

    def _call(self, api: Any, **kwargs: Any) -> Any:
        kwargs.update(_preload_content=False)
        if self.settings.namespace:
            return api.list_namespaced_horizontal_pod_autoscaler(self.settings.namespace, **kwargs)
        return api.list_horizontal_pod_autoscaler_for_all_namespaces(**kwargs)

    def _convert(self, obj: Mapping[str, Any]) -> Cap | None:
        return cap_of(obj)


class PodAutoscalerWatcher(HpaWatcher):
    kind = "podautoscaler"
    GROUP, VERSION, PLURAL = "autoscaling.aibrix.ai", "v1alpha1", "podautoscalers"

    def _api_class(self, client: Any) -> Any:
        return client.CustomObjectsApi

    def _call(self, api: Any, **kwargs: Any) -> Any:
        kwargs.update(_preload_content=False)
        if self.settings.namespace:
            return api.list_namespaced_custom_object(self.GROUP, self.VERSION, self.settings.namespace,
                                                     self.PLURAL, **kwargs)
        return api.list_cluster_custom_object(self.GROUP, self.VERSION, self.PLURAL, **kwargs)


WATCHERS: dict[str, type[HpaWatcher]] = dict(zip(AUTOSCALER_KINDS, (HpaWatcher, PodAutoscalerWatcher)))
