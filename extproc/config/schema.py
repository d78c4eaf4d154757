"""The typed gateway config and the keys its file may hold.

    models:
      llama2-7b:
        pods:
          - {name: a100-0, address: 127.0.0.1:8001, deployment: llama2-7b-a100, labels: {gpu: A100}}
    routing: {default_strategy: load-balance}
    gateway: {destination_header: x-gateway-destination-endpoint, max_body_bytes: 8388608}

A `Config` is what `serve` runs and `check-config` prints: the file with the environment folded in
(extproc.environment), routing settings parsed and every strategy built once, at load.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.config.source import line_of
from extproc.envoy_contract import DEFAULT_DESTINATION_HEADER
from extproc.pool.pod import Pod
from extproc.pool.settings import DISCOVERY_KEYS, DiscoverySettings
from extproc.ratelimit.settings import RateLimitSettings
from extproc.redis_connect import RedisTarget
from extproc.routing.settings import RoutingSettings

# Inference endpoints routed to a pod; anything else (engine admin endpoints included) gets a 404.
DEFAULT_MODEL_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# Envoy's per-connection buffer (envoy_contract.ENVOY_BUFFER_BYTES) must stay above this, so that
# oversized bodies reach the gateway and get an OpenAI-style 413 instead of Envoy's plain-text one.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_FALLBACK_ENDPOINTS = 3  # the pick and two next-best pods (`gateway.fallback_endpoints`)
MAX_FALLBACK_ENDPOINTS = 16

# Every key the file may hold, per section: anything else is a typo that would silently change what is
# served (`modles:` once meant "no models", a pod's `raedy: false` was ignored), so it is an error.
# `routing` is checked by extproc.routing.settings; models and pods by extproc.config.pods.
SECTION_KEYS: dict[str, frozenset[str]] = {
    "gateway": frozenset({"destination_header", "model_paths", "max_body_bytes", "drain_timeout_seconds",
                          "drain_notice_seconds", "include_usage", "request_timeout_seconds",
                          "api_keys_file", "fail_open", "fallback_endpoints"}),
    "telemetry": frozenset({"refresh_seconds", "timeout_seconds"}),
    "redis": frozenset({"url", "sync_interval_seconds", "heartbeat_seconds", "timeout_seconds",
                        "aibrix_rows", "mode", "nodes", "master_name"}),
    "discovery": DISCOVERY_KEYS,  # typed by extproc.config.discovery
}
TOP_KEYS = frozenset({"models", "routing", "rate_limits", *SECTION_KEYS})  # rate_limits: extproc.ratelimit


class ConfigError(ValueError):
    pass


@dataclass(slots=True, frozen=True)
class RedisSync:
    """How the shared state keeps step with Redis (`redis.*`; docs/kubernetes.md sizes them)."""
    interval_seconds: float = 0.1   # a sync turn: own changes out, the others' totals in
    heartbeat_seconds: float = 1.0  # liveness beat; a gateway silent for 3 heartbeats is reaped
    timeout_seconds: float = 0.5    # a turn not answered within this fails: local counts until one is
    aibrix_rows: bool = False       # also write and read AIBrix gateways' aibrix:pod:* rows

    @property
    def gateway_ttl(self) -> float:
        return 3 * self.heartbeat_seconds


@dataclass(slots=True, frozen=True)
class Config:
    pods: tuple[Pod, ...] = ()
    models: tuple[str, ...] = ()
    default_strategy: str = "load-balance"
    destination_header: str = DEFAULT_DESTINATION_HEADER
    model_paths: frozenset[str] = frozenset(DEFAULT_MODEL_PATHS)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_seconds: float = 30.0
    # NOT_SERVING is announced this long before new streams are refused, so that health checkers
    # (Envoy's, Kubernetes') can steer traffic away first.
    drain_notice_seconds: float = 0.0
    # Typed routing settings for `extproc.routing.Router`: the `routing` section, its environment
    # variables and each model's `routingConfig`, parsed once at load (every strategy built from them).
    routing_settings: RoutingSettings = field(default_factory=RoutingSettings)
    # Streaming requests get stream_options.include_usage, so every engine reports exact usage; the
    # usage chunk is removed again for clients that did not ask for it.
    include_usage: bool = True
    # A routed request whose access-log record never comes is released after this long.
    request_timeout_seconds: float = 3600.0
    metrics_refresh_seconds: float = 1.0
    metrics_timeout_seconds: float = 0.5
    # Where shared state lives, as `serve` connects: EXTPROC_REDIS_URL, redis.url, else AIBrix's
    # REDIS_HOST/REDIS_PORT, with REDIS_PASSWORD added. None: this gateway keeps its counts to itself.
    redis_url: str | None = field(default=None, repr=False)  # may carry a password
    # How to reach it: one instance at redis_url, a Cluster or a Sentinel-watched master (redis.mode).
    redis_target: RedisTarget | None = field(default=None, repr=False)
    redis_instance: str | None = None  # this gateway's name in Redis (POD_NAME; None: the hostname)
    redis_sync: RedisSync = field(default_factory=lambda: RedisSync())  # read once, at start
    tracing: bool = False  # request traces for the GPU optimizer (AIBRIX_GPU_OPTIMIZER_TRACING_FLAG)
    api_keys_file: str | None = None  # optional client API keys (extproc.server.auth)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # EXTPROC_API_KEYS
    # Envoy's failure_mode_allow (`extproc envoy-config --gateway-config`): while the gateway is
    # unreachable, the model paths go round robin to the model's pods instead of a 503. Off: fail closed.
    fail_open: bool = False
    # The endpoint-picker protocol's ordered list (docs/conformance.md): the pick, then the next-best
    # pods by the same strategy, which a pool's data plane tries in order on retry. 1: the pick alone.
    fallback_endpoints: int = DEFAULT_FALLBACK_ENDPOINTS
    # Where pods come from besides `models`: the file only (default) or the Kubernetes API.
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    # Per-key request and token limits (docs/rate-limits.md); off unless the section sets a limit.
    rate_limits: RateLimitSettings = field(default_factory=RateLimitSettings)


def check_known(where: str, mapping: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """Refuse a key the section does not know, naming it, its line and the key it is closest to."""
    unknown = sorted((k for k in mapping if k not in allowed), key=str)
    if unknown:
        key = unknown[0]
        prefix = f"{where}." if where else ""
        close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown key {prefix}{key}{line_of(mapping, key)}{hint} "
                          f"(known: {', '.join(sorted(allowed))})")
