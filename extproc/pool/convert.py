"""A Kubernetes pod object (plain JSON) as the gateway's Pod: pure, total over any JSON.

Total because an exception here would look like a broken watch and relist forever. Tested without any
server; the watch (`pool/watch.py`) calls it for every listed pod and every event.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
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
from extproc.pool.settings import DiscoverySettings

POD_TEMPLATE_HASH = re.compile(r"-[a-z0-9]{5,10}$")  # a ReplicaSet name is <deployment>-<template hash>


def as_map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def as_maps(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _labels(meta: Mapping[str, Any], key: str = "labels") -> dict[str, str]:
    return {str(k): str(v) for k, v in as_map(meta.get(key)).items() if v is not None}


def deployment_from_metadata(meta: Mapping[str, Any]) -> str:
    """The rule the SLO profiles use: fleet label, app name label, else the ReplicaSet owner's name
    without its pod-template hash."""
    labels = _labels(as_map(meta))
    for key in (FLEET_LABEL, APP_NAME_LABEL):
        if labels.get(key):
            return labels[key]
    for owner in as_maps(as_map(meta).get("ownerReferences")):
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
    meta = as_map(obj.get("metadata"))
    for source in (_labels(meta, "annotations"), _labels(meta)):
        if settings.port_annotation in source:
            return _port(source[settings.port_annotation])
    ports = [p for c in as_maps(as_map(obj.get("spec")).get("containers")) for p in as_maps(c.get("ports"))
             if p.get("protocol", "TCP") == "TCP"]
    for p in ports:
        if p.get("name") in ("http", "serve", "serving"):
            return _port(p.get("containerPort"))
    return _port(ports[0].get("containerPort")) if ports else None


def is_ready(obj: Mapping[str, Any]) -> bool:
    meta, status = as_map(obj.get("metadata")), as_map(obj.get("status"))
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    conditions = as_maps(status.get("conditions"))
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_from_object(obj: Mapping[str, Any], settings: DiscoverySettings) -> Pod | None:
    """A Kubernetes pod object as the gateway's Pod; None when it cannot be routed to at all (no model
    label, no IP yet, no port)."""
    obj = as_map(obj)
    model = _labels(as_map(obj.get("metadata"))).get(MODEL_LABEL)
    port = serving_port(obj, settings)
    if not model or port is None:
        return None
    return _pod(obj, settings, model, port, None)


def pool_pods_from_object(obj: Mapping[str, Any], settings: DiscoverySettings, ports: tuple[int, ...],
                          default_model: str) -> tuple[Pod, ...]:
    """An InferencePool member as Pods: one per target port (data-parallel ranks each serve on their
    own port; named `<pod>-rank-<i>` as the reference picker names them when there are several). The
    model: the configured one, else the pod's model label, else `default_model` (the pool's name)."""
    obj = as_map(obj)
    pool = settings.inferencepool
    model = (pool.model if pool is not None else None) or \
        _labels(as_map(obj.get("metadata"))).get(MODEL_LABEL) or default_model
    pods = []
    for rank, port in enumerate(ports):
        pod = _pod(obj, settings, model, port, rank if len(ports) > 1 else None)
        if pod is None:
            return ()
        pods.append(pod)
    return tuple(pods)


def _pod(obj: Mapping[str, Any], settings: DiscoverySettings, model: str, port: int,
         rank: int | None) -> Pod | None:
    meta, status = as_map(obj.get("metadata")), as_map(obj.get("status"))
    labels = _labels(meta)
    try:
        ip = ipaddress.ip_address(str(status.get("podIP")))  # ORIGINAL_DST needs a literal address
    except ValueError:
        return None
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    address = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    deployment = deployment_from_metadata(meta)
    gpu = next((labels[k] for k in settings.gpu_labels if labels.get(k)), deployment)
    engine = labels.get(ENGINE_LABEL, "vllm").lower()
    if engine not in ENGINES:
        engine = "vllm"
    metrics_port = _port(_labels(meta, "annotations").get(METRIC_PORT_LABEL, labels.get(METRIC_PORT_LABEL)))
    name = str(meta.get("name") or "")
    if rank is not None:
        name = f"{name}-rank-{rank}"
        metrics_port = None  # each rank reports on its own port
    return Pod(model=model, name=name, address=address, deployment=deployment,
               labels={**labels, "gpu": gpu}, ready=is_ready(obj),
               namespace=str(meta.get("namespace") or "default"), engine=engine, metrics_port=metrics_port)


def object_name(obj: Mapping[str, Any]) -> str:
    """"namespace/name": a pod's identity across events."""
    meta = as_map(as_map(obj).get("metadata"))
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"
