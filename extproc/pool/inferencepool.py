"""InferencePool discovery: the gateway's pods follow an InferencePool (inference.networking.k8s.io/v1),
as the Gateway API Inference Extension's reference picker's do.

Two list + watch loops (`pool/watch.py`'s `ListWatcher`: resumed from the last resourceVersion, a
relist after 410 Gone or a disconnect, a backoff while failures repeat):

- the pool itself (a field selector on its name): its `spec.selector.matchLabels` and
  `spec.targetPorts[].number`;
- the pods of its namespace that its selector matches. When the selector or the ports change, this
  watch is replaced by one for the new selector, which lists afresh: the pods follow the new spec at
  once and none of the old selection lingers. With no pool (not created yet, or deleted) there are no
  pods, and requests get the no-pod answer rather than going to pods the pool no longer names.

A pod becomes one Pod per target port (`pool/convert.py`); an unready or terminating pod stays in the
pool as not ready (no new requests; its in-flight requests' records still find it), as with label
discovery. The API reads are get/list/watch on pods and inferencepools in one namespace, nothing more
(deploy/samples/inferencepool/rbac.yaml).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from extproc.pool.convert import as_map, as_maps, pool_pods_from_object
from extproc.pool.pod import Pod
from extproc.pool.settings import (
    POOL_GROUP,
    POOL_PLURAL,
    POOL_VERSION,
    DiscoverySettings,
    InferencePoolRef,
)
from extproc.pool.watch import ListWatcher

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class PoolSpec:
    """What of an InferencePool chooses pods: its label selector and target ports."""
    match_labels: tuple[tuple[str, str], ...]
    ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.match_labels)

    @property
    def selects(self) -> bool:
        """An empty selector would match every pod of the namespace: it selects none instead."""
        return bool(self.match_labels and self.ports)


def pool_spec(obj: Mapping[str, Any]) -> PoolSpec:
    """An InferencePool object's spec; total over any JSON (what the API server's schema would refuse
    reads as selecting nothing)."""
    spec = as_map(as_map(obj).get("spec"))
    labels = as_map(as_map(spec.get("selector")).get("matchLabels"))
    match = tuple(sorted((str(k), str(v)) for k, v in labels.items() if isinstance(v, str)))
    ports: list[int] = []
    for entry in as_maps(spec.get("targetPorts")):
        number = entry.get("number")
        if isinstance(number, int) and not isinstance(number, bool) and 0 < number < 65536 \
                and number not in ports:
            ports.append(number)
    return PoolSpec(match, tuple(ports))


def followed(settings: DiscoverySettings) -> InferencePoolRef:
    if settings.inferencepool is None:
        raise ValueError("InferencePool discovery needs discovery.inferencepool")
    return settings.inferencepool


class PoolWatcher(ListWatcher[PoolSpec]):
    """The one InferencePool named in the settings (a list filtered to its name, and its watch)."""

    kind = "inferencepool"

    def _api_class(self, client: Any) -> Any:
        return client.CustomObjectsApi

    def _call(self, api: Any, **kwargs: Any) -> Any:
        pool = followed(self.settings)
        return api.list_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, pool.namespace, POOL_PLURAL,
            field_selector=f"metadata.name={pool.name}", _preload_content=False, **kwargs)

    def _convert(self, obj: Mapping[str, Any]) -> PoolSpec | None:
        return pool_spec(obj)


class PoolPodWatcher(ListWatcher[tuple[Pod, ...]]):
    """The pods one pool spec selects, each as one Pod per target port."""

    kind = "pod"

    def __init__(self, settings: DiscoverySettings, spec: PoolSpec,
                 on_change: Callable[[list[tuple[Pod, ...]]], None], configuration: Any = None) -> None:
        super().__init__(settings, on_change, configuration)
        self.spec = spec
        self.ref = followed(settings)

    def _api_class(self, client: Any) -> Any:
        return client.CoreV1Api

    def _call(self, api: Any, **kwargs: Any) -> Any:
        return api.list_namespaced_pod(self.ref.namespace, label_selector=self.spec.label_selector,
                                       _preload_content=False, **kwargs)

    def _convert(self, obj: Mapping[str, Any]) -> tuple[Pod, ...] | None:
        return pool_pods_from_object(obj, self.settings, self.spec.ports, self.ref.name) or None

    def _same(self, before: tuple[Pod, ...], after: tuple[Pod, ...]) -> bool:
        return before == after and all(b.labels == a.labels for b, a in zip(before, after, strict=True))


class InferencePoolDiscovery:
    """Follows one InferencePool: `on_change(pods)` with the pool's pods after every change of the pool
    or of its pods. Run `run()` as a supervised task."""

    def __init__(self, settings: DiscoverySettings, on_change: Callable[[list[Pod]], None],
                 configuration: Any = None) -> None:
        self.settings = settings
        self.ref = followed(settings)
        self._on_change = on_change
        self._configuration = configuration
        self.pool = PoolWatcher(settings, self._pool_changed, configuration)
        self.spec: PoolSpec | None = None  # the spec the pod watch follows; None: no pool
        self.pods: PoolPodWatcher | None = None
        self._pods_task: asyncio.Task | None = None
        self._retiring: set[asyncio.Task] = set()  # replaced pod watches, closing their connections
        self.reselections = 0  # pod watches started for a new spec

    async def run(self) -> None:
        try:
            await self.pool.run()
        finally:
            await self._stop_pods()

    def _pool_changed(self, specs: list[PoolSpec]) -> None:
        spec = specs[0] if specs else None
        if spec == self.spec:
            return
        log.info("InferencePool %s/%s: %s", self.ref.namespace, self.ref.name,
                 "gone" if spec is None else f"selector {spec.label_selector or '(empty)'}, "
                                             f"ports {list(spec.ports)}")
        self.spec = spec
        old, self._pods_task, self.pods = self._pods_task, None, None
        if old is not None:
            old.cancel()
            self._retiring.add(old)
            old.add_done_callback(self._retiring.discard)
        if spec is None or not spec.selects:
            self._publish([])
            return
        self.reselections += 1
        self.pods = PoolPodWatcher(self.settings, spec, partial(self._pods_changed, self.reselections),
                                   self._configuration)
        self._pods_task = asyncio.get_running_loop().create_task(self.pods.run(), name="inferencepool-pods")

    def _pods_changed(self, selection: int, ranks: list[tuple[Pod, ...]]) -> None:
        if selection != self.reselections or self.spec is None:
            return  # a replaced watch's last word (its task is being cancelled)
        self._publish([pod for pods in ranks for pod in pods])

    def _publish(self, pods: list[Pod]) -> None:
        try:
            self._on_change(pods)
        except Exception:  # the gateway refused it (logged there); the watches go on
            log.exception("InferencePool discovery: applying %d pods failed", len(pods))

    async def _stop_pods(self) -> None:
        tasks = [t for t in (self._pods_task, *self._retiring) if t is not None]
        self._pods_task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
