"""Pod discovery from the Kubernetes API: the pool follows the pods labelled `model.aibrix.ai/name`.

One list, then a watch resumed from the last resourceVersion; a 410 Gone (the version fell out of the
API server's window), an ERROR event or a dropped connection leads to a fresh list, after a backoff
that grows while the failures repeat. A list replaces everything known, so a deletion missed while
disconnected is still seen.

Every change is handed on at once: a pod that turns unready (or starts terminating) is kept in the pool
as not ready, so it gets no new requests while the access-log records of its in-flight requests still
find it; a deleted pod leaves the pool. The official client (`kubernetes_asyncio`) supplies the
connection, credentials and request building; the watch stream is read line by line as plain JSON
dicts, which keeps this module independent of the client's generated model classes.

The conversion of a pod object (`pod_from_object`) is a pure function, tested without any server.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from extproc.pool.pod import (
    APP_NAME_LABEL,
    ENGINE_LABEL,
    ENGINES,
    FLEET_LABEL,
    METRIC_PORT_LABEL,
    MODEL_LABEL,
    Pod,
)

log = logging.getLogger(__name__)

PORT_KEY = "model.aibrix.ai/port"  # AIBrix's key for the serving port (annotation or label)
# Where a pod's GPU type is read from, first found wins; else the deployment name stands for it
# (the spec's prerequisite: one Deployment per GPU type).
DEFAULT_GPU_LABELS = ("machine.cluster.vke.volcengine.com/gpu-name", "nvidia.com/gpu.product")
KINDS = ("static", "kubernetes")
DISCOVERY_KEYS = frozenset({"kind", "namespace", "port_annotation", "gpu_labels", "kubeconfig",
                            "label_selector", "watch_timeout_seconds", "backoff_seconds",
                            "max_backoff_seconds"})
# Pod events closer together than this are applied together: applying a 1,000-pod pool costs ~8 ms
# of event loop, and a rollout sends several events per pod. Readiness still takes effect within it.
APPLY_INTERVAL_SECONDS = 0.05
LIST_READ_TIMEOUT_SECONDS = 60.0
POD_TEMPLATE_HASH = re.compile(r"-[a-z0-9]{5,10}$")  # a ReplicaSet name is <deployment>-<template hash>


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


@dataclass(slots=True, frozen=True)
class DiscoverySettings:
    kind: str = "static"  # "static": the pods are the config file's; "kubernetes": watched
    namespace: str | None = None  # None: all namespaces
    port_annotation: str = PORT_KEY
    gpu_labels: tuple[str, ...] = DEFAULT_GPU_LABELS
    kubeconfig: str | None = None  # None: in-cluster service account, else ~/.kube/config
    label_selector: str = MODEL_LABEL  # further restrictions may be added: "model.aibrix.ai/name,team=a"
    watch_timeout_seconds: float = 300.0  # the server ends each watch after this; it resumes at once
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 30.0

    @property
    def enabled(self) -> bool:
        return self.kind == "kubernetes"


def parse_settings(raw: Mapping[str, Any]) -> DiscoverySettings:
    """The config file's `discovery:` section; raises ValueError naming the bad key."""
    unknown = sorted(str(k) for k in raw if k not in DISCOVERY_KEYS)
    if unknown:
        raise ValueError(f"unknown key discovery.{unknown[0]} (known: {', '.join(sorted(DISCOVERY_KEYS))})")
    kind = raw.get("kind", "static")
    if kind not in KINDS:
        raise ValueError(f"discovery.kind {kind!r} is not one of {', '.join(KINDS)}")
    out: dict[str, Any] = {"kind": kind}
    for key in ("namespace", "port_annotation", "kubeconfig", "label_selector"):
        if raw.get(key) is not None:
            if not isinstance(raw[key], str) or not raw[key]:
                raise ValueError(f"discovery.{key} must be a non-empty string")
            out[key] = raw[key]
    if "label_selector" in out and MODEL_LABEL not in out["label_selector"]:
        raise ValueError(f"discovery.label_selector must still select on {MODEL_LABEL}")
    if "gpu_labels" in raw:
        labels = raw["gpu_labels"]
        if not isinstance(labels, list) or not all(isinstance(x, str) and x for x in labels):
            raise ValueError("discovery.gpu_labels must be a list of label names")
        out["gpu_labels"] = tuple(labels)
    for key, minimum in (("watch_timeout_seconds", 1), ("backoff_seconds", 0.01),
                         ("max_backoff_seconds", 0.01)):
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
                raise ValueError(f"discovery.{key} must be a number >= {minimum}, not {value!r}")
            out[key] = float(value)
    return DiscoverySettings(**out)


# -- pure conversion ------------------------------------------------------------------------------
# Total over any JSON: an exception here would look like a broken watch and relist forever.

def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _maps(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _labels(meta: Mapping[str, Any], key: str = "labels") -> dict[str, str]:
    return {str(k): str(v) for k, v in _map(meta.get(key)).items() if v is not None}


def deployment_from_metadata(meta: Mapping[str, Any]) -> str:
    """The rule the SLO profiles use: fleet label, app name label, else the ReplicaSet owner's name
    without its pod-template hash."""
    labels = _labels(_map(meta))
    for key in (FLEET_LABEL, APP_NAME_LABEL):
        if labels.get(key):
            return labels[key]
    for owner in _maps(_map(meta).get("ownerReferences")):
        name = str(owner.get("name") or "")
        if owner.get("kind") == "ReplicaSet" and name:
            template = labels.get("pod-template-hash")
            if template and name.endswith(f"-{template}"):
                return name[: -len(template) - 1]
            return POD_TEMPLATE_HASH.sub("", name)
        if owner.get("kind") in ("StatefulSet", "LeaderWorkerSet") and name:
            return name
    return ""


def _port(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        port = int(str(value))
    except (TypeError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def serving_port(obj: Mapping[str, Any], settings: DiscoverySettings) -> int | None:
    """The annotation (or a label of that name), else a container port named http/serve, else the
    first container port declared."""
    meta = _map(obj.get("metadata"))
    for source in (_labels(meta, "annotations"), _labels(meta)):
        if settings.port_annotation in source:
            return _port(source[settings.port_annotation])
    ports = [p for c in _maps(_map(obj.get("spec")).get("containers")) for p in _maps(c.get("ports"))
             if p.get("protocol", "TCP") == "TCP"]
    for p in ports:
        if p.get("name") in ("http", "serve", "serving"):
            return _port(p.get("containerPort"))
    return _port(ports[0].get("containerPort")) if ports else None


def is_ready(obj: Mapping[str, Any]) -> bool:
    meta, status = _map(obj.get("metadata")), _map(obj.get("status"))
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    conditions = _maps(status.get("conditions"))
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_from_object(obj: Mapping[str, Any], settings: DiscoverySettings) -> Pod | None:
    """A Kubernetes pod object as the gateway's Pod; None when it cannot be routed to at all (no model
    label, no IP yet, no port)."""
    obj = _map(obj)
    meta, status = _map(obj.get("metadata")), _map(obj.get("status"))
    labels = _labels(meta)
    model = labels.get(MODEL_LABEL)
    port = serving_port(obj, settings)
    try:
        ip = ipaddress.ip_address(str(status.get("podIP")))  # ORIGINAL_DST needs a literal address
    except ValueError:
        return None
    if not model or port is None or status.get("phase") in ("Succeeded", "Failed"):
        return None
    address = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    deployment = deployment_from_metadata(meta)
    gpu = next((labels[k] for k in settings.gpu_labels if labels.get(k)), deployment)
    engine = labels.get(ENGINE_LABEL, "vllm").lower()
    if engine not in ENGINES:
        engine = "vllm"
    metrics_port = _port(_labels(meta, "annotations").get(METRIC_PORT_LABEL, labels.get(METRIC_PORT_LABEL)))
    return Pod(model=model, name=str(meta.get("name") or ""), address=address, deployment=deployment,
               labels={**labels, "gpu": gpu}, ready=is_ready(obj),
               namespace=str(meta.get("namespace") or "default"), engine=engine, metrics_port=metrics_port)


# -- the watch ------------------------------------------------------------------------------------

class PodWatcher:
    """List + watch; calls `on_change(pods)` with every routable pod after each change."""

    def __init__(self, settings: DiscoverySettings, on_change: Callable[[list[Pod]], None],
                 configuration: Any = None) -> None:
        self.settings = settings
        self._on_change = on_change
        self._configuration = configuration  # a kubernetes_asyncio Configuration (tests); else loaded
        self._objects: dict[str, Pod] = {}  # "namespace/name" -> Pod
        self.resource_version: str | None = None
        self.lists = 0  # full lists done (the first, then one per 410 or disconnect)
        self.failures = 0  # consecutive failures without a watch event between them: the backoff's exponent
        self.synced = asyncio.Event()  # set after the first list has been handed on
        self.published = 0  # times on_change was called
        self._last_publish = float("-inf")
        self._pending: asyncio.TimerHandle | None = None

    def pods(self) -> list[Pod]:
        return list(self._objects.values())

    async def _api(self) -> Any:
        from kubernetes_asyncio import client, config

        configuration = self._configuration
        if configuration is None:
            configuration = client.Configuration()
            if self.settings.kubeconfig is None and _in_cluster():
                config.load_incluster_config(client_configuration=configuration)
            else:
                await config.load_kube_config(config_file=self.settings.kubeconfig,
                                              client_configuration=configuration, persist_config=False)
        return client.CoreV1Api(client.ApiClient(configuration))

    def _call(self, api: Any, **kwargs: Any) -> Any:
        kwargs.update(label_selector=self.settings.label_selector, _preload_content=False)
        if self.settings.namespace:
            return api.list_namespaced_pod(self.settings.namespace, **kwargs)
        return api.list_pod_for_all_namespaces(**kwargs)

    async def run(self) -> None:
        api = None
        try:
            while True:
                try:
                    if api is None:  # credentials not there yet (a Secret still mounting) are retried too
                        api = await self._api()
                    await self._list(api)
                    await self._watch(api)
                except asyncio.CancelledError:
                    raise
                except Gone:
                    log.info("pod watch: resourceVersion %s expired (410), listing again",
                             self.resource_version)
                except Exception as exc:  # no credentials, disconnect, API error, bad JSON
                    log.warning("pod discovery: %s: %s; retrying", type(exc).__name__, exc)
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
                raise RuntimeError(f"pod list: HTTP {response.status}: {body[:200]!r}")
        data = json.loads(body)
        objects = {}
        for obj in _maps(_map(data).get("items")):
            pod = pod_from_object(obj, self.settings)
            if pod is not None:
                objects[_name(obj)] = pod
        self._objects = objects
        self.resource_version = _map(_map(data).get("metadata")).get("resourceVersion")
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
                    raise RuntimeError(f"pod watch: HTTP {response.status}")
                # one JSON event per line; the client's 2 MiB read buffer allows 4 MiB lines, above
                # the largest object etcd stores (1.5 MiB)
                while line := await response.content.readline():
                    if line.strip():
                        self._event(json.loads(line))
                        self.failures = 0  # the watch delivered: a later failure backs off afresh
            # the server's timeout ended the watch cleanly: resume from the last version

    def _event(self, event: Mapping[str, Any]) -> None:
        event = _map(event)
        kind, obj = event.get("type"), _map(event.get("object"))
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise RuntimeError(f"watch error: {obj.get('message') or obj}")
        version = _map(obj.get("metadata")).get("resourceVersion")
        if version:
            self.resource_version = version
        if kind == "BOOKMARK":
            return
        name = _name(obj)
        pod = None if kind == "DELETED" else pod_from_object(obj, self.settings)
        before = self._objects.get(name)
        if pod is None:
            if self._objects.pop(name, None) is None:
                return
        elif before == pod and before.labels == pod.labels:
            return
        else:
            self._objects[name] = pod
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
            self._on_change(self.pods())
        except Exception:  # the gateway refused it (logged there); the watch goes on
            log.exception("pod discovery: applying %d pods failed", len(self._objects))


def _timeout(read_seconds: float) -> Any:
    import aiohttp

    return aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_seconds)


def _name(obj: Mapping[str, Any]) -> str:
    meta = _map(_map(obj).get("metadata"))
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _in_cluster() -> bool:
    import os

    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
