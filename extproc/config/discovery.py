"""The config's `discovery:` section, checked and typed (DiscoverySettings lives with the pool)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.config.schema import ConfigError
from extproc.pool.pod import MODEL_LABEL
from extproc.pool.settings import DISCOVERY_KEYS, KINDS, DiscoverySettings


def parse_discovery(raw: Mapping[str, Any], *, in_cluster: bool = False) -> DiscoverySettings:
    """The `discovery:` section; raises ConfigError naming the bad key."""
    unknown = sorted(str(k) for k in raw if k not in DISCOVERY_KEYS)
    if unknown:
        raise ConfigError(f"unknown key discovery.{unknown[0]} (known: {', '.join(sorted(DISCOVERY_KEYS))})")
    kind = raw.get("kind", "static")
    if kind not in KINDS:
        raise ConfigError(f"discovery.kind {kind!r} is not one of {', '.join(KINDS)}")
    out: dict[str, Any] = {"kind": kind, "in_cluster": in_cluster}
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
