"""The config's `discovery:` section, checked and typed (DiscoverySettings lives with the pool)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from extproc.config.schema import ConfigError, check_known
from extproc.pool.pod import MODEL_LABEL
from extproc.pool.settings import (
    DISCOVERY_KEYS,
    INFERENCEPOOL_KEYS,
    KINDS,
    DiscoverySettings,
    InferencePoolRef,
)

# An object name (RFC 1123 subdomain) and a namespace name (RFC 1123 label), as the API server checks
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# With a pool, its selector chooses the pods and its namespace is the pool's: these would contradict it
NOT_WITH_POOL = ("label_selector", "namespace")


def parse_discovery(raw: Mapping[str, Any], *, in_cluster: bool = False,
                    own_namespace: str | None = None) -> DiscoverySettings:
    """The `discovery:` section; raises ConfigError naming the bad key. `own_namespace`: the
    gateway's namespace (POD_NAMESPACE), the pool's when the section names none."""
    check_known("discovery", raw, DISCOVERY_KEYS)
    pool_raw = raw.get("inferencepool")
    kind = raw.get("kind", "static" if pool_raw is None else "inferencepool")
    if kind not in KINDS:
        raise ConfigError(f"discovery.kind {kind!r} is not one of {', '.join(KINDS)}")
    out: dict[str, Any] = {"kind": kind, "in_cluster": in_cluster}
    if kind == "inferencepool" or pool_raw is not None:
        if kind != "inferencepool":
            raise ConfigError(f"discovery.inferencepool is set, but discovery.kind is {kind!r}: "
                              "leave kind out (or set it to inferencepool)")
        for key in NOT_WITH_POOL:
            if key in raw:
                raise ConfigError(f"discovery.{key} does not apply to an InferencePool (its selector "
                                  "chooses the pods; set discovery.inferencepool.namespace)")
        out["inferencepool"] = _inferencepool(pool_raw, own_namespace)
    for key in ("namespace", "port_annotation", "kubeconfig", "label_selector"):
        if raw.get(key) is not None:
            if not isinstance(raw[key], str) or not raw[key]:
                raise ConfigError(f"discovery.{key} must be a non-empty string")
            out[key] = raw[key]
    if "label_selector" in out and MODEL_LABEL not in out["label_selector"]:
        raise ConfigError(f"discovery.label_selector must still select on {MODEL_LABEL}")
    if "gpu_labels" in raw:
        labels = raw["gpu_labels"]
        if not isinstance(labels, list) or not all(isinstance(x, str) and x for x in labels):
            raise ConfigError("discovery.gpu_labels must be a list of label names")
        out["gpu_labels"] = tuple(labels)
    for key, minimum in (("watch_timeout_seconds", 1), ("backoff_seconds", 0.01),
                         ("max_backoff_seconds", 0.01)):
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
                raise ConfigError(f"discovery.{key} must be a number >= {minimum}, not {value!r}")
            out[key] = float(value)
    return DiscoverySettings(**out)


def _inferencepool(raw: Any, own_namespace: str | None) -> InferencePoolRef:
    if not isinstance(raw, Mapping):
        raise ConfigError("discovery.inferencepool must be a mapping: {name: <pool>, namespace: <ns>}")
    check_known("discovery.inferencepool", raw, INFERENCEPOOL_KEYS)
    name = raw.get("name")
    if not isinstance(name, str) or len(name) > 253 or not SUBDOMAIN.fullmatch(name):
        raise ConfigError(f"discovery.inferencepool.name must name an InferencePool (a lower-case "
                          f"DNS subdomain), not {name!r}")
    namespace = raw.get("namespace", own_namespace or "default")
    if not isinstance(namespace, str) or len(namespace) > 63 or not LABEL.fullmatch(namespace):
        raise ConfigError(f"discovery.inferencepool.namespace must be a namespace name, not {namespace!r}")
    model = raw.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise ConfigError(f"discovery.inferencepool.model must be a model name, not {model!r}")
    return InferencePoolRef(name=name, namespace=namespace, model=model)
