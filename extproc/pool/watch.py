"""Pod discovery from the Kubernetes API: the pool follows the pods labelled `model.aibrix.ai/name`.
`ListWatcher` is the list + watch loop for any kind (the optimizer watches Deployments with it:
extproc/optimizer/kubernetes.py); `PodWatcher` is it for pods.

One list, then a watch resumed from the last resourceVersion; a 410 Gone (the version fell out of the
API server's window), an ERROR event or a dropped connection leads to a fresh list, after a backoff
that grows while the failures repeat. A list replaces everything known, so a deletion missed while
disconnected is still seen.

Every change is handed on at once: a pod that turns unready (or starts terminating) is kept in the pool
as not ready, so it gets no new requests while the access-log records of its in-flight requests still
find it; a deleted pod leaves the pool. The official client (`kubernetes_asyncio`) supplies the
connection, credentials and request building; the watch stream is read line by line as plain JSON
dicts, which keeps this module independent of the client's generated model classes. Each object
becomes a Pod through `pool/convert.py`; `server/discovery.py` joins the pods with the config file's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from extproc.pool.convert import as_map, as_maps, object_name, pod_from_object
from extproc.pool.pod import Pod
from extproc.pool.settings import DiscoverySettings

log = logging.getLogger(__name__)

# Pod events closer together than this are applied together: applying a 1,000-pod pool costs ~8 ms
# of event loop, and a rollout sends several events per pod. Readiness still takes effect within it.
APPLY_INTERVAL_SECONDS = 0.05
LIST_READ_TIMEOUT_SECONDS = 60.0


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


T = TypeVar("T")


class ListWatcher(Generic[T]):
    """List + watch of one kind; calls `on_change(items)` with every converted object after each change.
    A subclass says which API to call (`_api_class`, `_call`) and what an object becomes (`_convert`:
    None leaves it out)."""

    kind = "object"  # for the log

    def __init__(self, settings: DiscoverySettings, on_change: Callable[[list[T]], None],
                 configuration: Any = None) -> None:
        self.settings = settings
        self._on_change = on_change
        self._configuration = configuration  # a kubernetes_asyncio Configuration (tests); else loaded
        self._objects: dict[str, T] = {}  # "namespace/name" -> item
        self.resource_version: str | None = None
        self.lists = 0  # full lists done (the first, then one per 410 or disconnect)
        self.failures = 0  # consecutive failures without a watch event between them: the backoff's exponent
        self.synced = asyncio.Event()  # set after the first list has been handed on
        self.published = 0  # times on_change was called
        self._last_publish = float("-inf")
        self._pending: asyncio.TimerHandle | None = None

    def items(self) -> list[T]:
        return list(self._objects.values())

    def _api_class(self, client: Any) -> Any:
        raise NotImplementedError

    def _call(self, api: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _convert(self, obj: Mapping[str, Any]) -> T | None:
        raise NotImplementedError

    def _same(self, before: T, after: T) -> bool:
        return before == after

    async def connect(self) -> Any:
        """An API object of `_api_class`, credentials loaded; the caller closes its api_client."""
        from kubernetes_asyncio import client, config

        configuration = self._configuration
        if configuration is None:
            configuration = client.Configuration()
            if self.settings.kubeconfig is None and self.settings.in_cluster:
                config.load_incluster_config(client_configuration=configuration)
            else:
                await config.load_kube_config(config_file=self.settings.kubeconfig,
                                              client_configuration=configuration, persist_config=False)
        return self._api_class(client)(client.ApiClient(configuration))

    async def run(self) -> None:
        api = None
        try:
            while True:
                try:
                    if api is None:  # credentials not there yet (a Secret still mounting) are retried too
                        api = await self.connect()
                    await self._list(api)
                    await self._watch(api)
                except asyncio.CancelledError:
                    raise
                except Gone:
                    log.info("%s watch: resourceVersion %s expired (410), listing again",
                             self.kind, self.resource_version)
                except Exception as exc:  # no credentials, disconnect, API error, bad JSON
                    log.warning("%s discovery: %s: %s; retrying", self.kind, type(exc).__name__, exc)
                self.failures += 1
                delay = min(self.settings.max_backoff_seconds,
                            self.settings.backoff_seconds * 2 ** (self.failures - 1))
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
        finally:
            if self._pending is not None:
                self._pending.cancel()
            if api is not None:
                await api.api_client.close()

    async def _list(self, api: Any) -> None:
        response = await self._call(api, _request_timeout=_timeout(LIST_READ_TIMEOUT_SECONDS))
        async with response:
            body = await response.read()
            if response.status != 200:
                raise RuntimeError(f"{self.kind} list: HTTP {response.status}: {body[:200]!r}")
        data = json.loads(body)
        objects = {}
        for obj in as_maps(as_map(data).get("items")):
            item = self._convert(obj)
            if item is not None:
                objects[object_name(obj)] = item
        self._objects = objects
        self.resource_version = as_map(as_map(data).get("metadata")).get("resourceVersion")
        self.lists += 1
        self._publish()
        self.synced.set()

    async def _watch(self, api: Any) -> None:
        """Watch, resuming each time the server ends the stream; raises Gone on 410, or on failure."""
        while True:
            response = await self._call(api, watch=True, resource_version=self.resource_version,
                                        allow_watch_bookmarks=True,
                                        timeout_seconds=int(self.settings.watch_timeout_seconds),
                                        # a connection that died silently is given up after this
                                        _request_timeout=_timeout(self.settings.watch_timeout_seconds + 30))
            async with response:
                if response.status == 410:
                    raise Gone()
                if response.status != 200:
                    raise RuntimeError(f"{self.kind} watch: HTTP {response.status}")
                # one JSON event per line; the client's 2 MiB read buffer allows 4 MiB lines, above
                # the largest object etcd stores (1.5 MiB)
                while line := await response.content.readline():
                    if line.strip():
                        self._event(json.loads(line))
                        self.failures = 0  # the watch delivered: a later failure backs off afresh
            # the server's timeout ended the watch cleanly: resume from the last version

    def _event(self, event: Mapping[str, Any]) -> None:
        event = as_map(event)
        kind, obj = event.get("type"), as_map(event.get("object"))
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise RuntimeError(f"watch error: {obj.get('message') or obj}")
        version = as_map(obj.get("metadata")).get("resourceVersion")
        if version:
            self.resource_version = version
        if kind == "BOOKMARK":
            return
        name = object_name(obj)
        item = None if kind == "DELETED" else self._convert(obj)
        before = self._objects.get(name)
        if item is None:
            if self._objects.pop(name, None) is None:
                return
        elif before is not None and self._same(before, item):
            return
        else:
            self._objects[name] = item
        self._changed()

    def _changed(self) -> None:
        """Apply now, or once APPLY_INTERVAL_SECONDS after the last apply if that was very recent."""
        if self._pending is not None:
            return
        loop = asyncio.get_running_loop()
        wait = self._last_publish + APPLY_INTERVAL_SECONDS - loop.time()
        if wait <= 0:
            self._publish()
        else:
            self._pending = loop.call_later(wait, self._publish)

    def _publish(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        self._last_publish = asyncio.get_running_loop().time()
        self.published += 1
        try:
            self._on_change(self.items())
        except Exception:  # the gateway refused it (logged there); the watch goes on
            log.exception("%s discovery: applying %d objects failed", self.kind, len(self._objects))


class PodWatcher(ListWatcher[Pod]):
    """The pods labelled as the settings select, as routable Pods (`pool/convert.py`)."""

    kind = "pod"

    def pods(self) -> list[Pod]:
        return self.items()

    def _api_class(self, client: Any) -> Any:
        return client.CoreV1Api

    def _call(self, api: Any, **kwargs: Any) -> Any:
        kwargs.update(label_selector=self.settings.label_selector, _preload_content=False)
        if self.settings.namespace:
            return api.list_namespaced_pod(self.settings.namespace, **kwargs)
        return api.list_pod_for_all_namespaces(**kwargs)

    def _convert(self, obj: Mapping[str, Any]) -> Pod | None:
        return pod_from_object(obj, self.settings)

    def _same(self, before: Pod, after: Pod) -> bool:
        return before == after and before.labels == after.labels


def _timeout(read_seconds: float) -> Any:
    import aiohttp

    return aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_seconds)
