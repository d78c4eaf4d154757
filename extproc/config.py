"""Typed gateway settings: a YAML file, overridable by environment variables.

    models:
      llama2-7b:
        pods:
          - {name: a100-0, address: 127.0.0.1:8001, deployment: llama2-7b-a100, labels: {gpu: A100}}
    routing: {default_strategy: load-balance}
    gateway: {destination_header: x-gateway-destination-endpoint, max_body_bytes: 8388608}
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from extproc.pool.kubernetes import DISCOVERY_KEYS, DiscoverySettings
from extproc.pool.kubernetes import parse_settings as parse_discovery
from extproc.pool.pod import ENGINE_LABEL, ENGINES, METRIC_PORT_LABEL, Pod

if TYPE_CHECKING:
    from extproc.routing.settings import RoutingSettings

DEFAULT_DESTINATION_HEADER = "x-gateway-destination-endpoint"
# Inference endpoints routed to a pod; anything else (engine admin endpoints included) gets a 404.
DEFAULT_MODEL_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
HEADER_NAME = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")  # an RFC 9110 token, lower-cased
RESERVED_HEADERS = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection",
                              "keep-alive", "upgrade", "te", "trailer", "proxy-connection", "x-request-id"})
# Envoy's per-connection buffer (envoy_bootstrap.BUFFER_LIMIT_BYTES) must stay above this, so that
# oversized bodies reach the gateway and get an OpenAI-style 413 instead of Envoy's plain-text one.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
ENVOY_BUFFER_BYTES = 16 * 1024 * 1024  # the bootstrap's per-connection buffer (envoy_bootstrap)
ENVOY_MAX_HEADERS = 100  # Envoy's default header count limit, also applied after the gateway's mutation

# Every key the file may hold, per section: anything else is a typo that would silently change what is
# served (`modles:` once meant "no models", a pod's `raedy: false` was ignored), so it is an error.
# `routing` is checked by extproc.routing.settings; models and pods below.
SECTION_KEYS: dict[str, frozenset[str]] = {
    "gateway": frozenset({"destination_header", "model_paths", "max_body_bytes", "drain_timeout_seconds",
                          "drain_notice_seconds", "include_usage", "request_timeout_seconds",
                          "api_keys_file"}),
    "telemetry": frozenset({"refresh_seconds", "timeout_seconds"}),
    "redis": frozenset({"url"}),
    "discovery": DISCOVERY_KEYS,  # typed by extproc.pool.kubernetes.parse_settings
}
TOP_KEYS = frozenset({"models", "routing", *SECTION_KEYS})
MODEL_KEYS = frozenset({"pods", "routingConfig"})
POD_KEYS = frozenset({"name", "address", "deployment", "labels", "ready", "namespace", "engine",
                      "metrics_port"})
MODEL_PATH = re.compile(r"/v1(/[a-z0-9_.-]+)+")  # OpenAI-style inference endpoints only

def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


# Environment variable -> (section, key, type), applied in order: a later entry wins, so AIBrix's names
# (ROUTING_ALGORITHM, AIBRIX_ROUTING_ALGORITHM) come before our own. The routing knobs' variables
# (AIBRIX_LOAD_BALANCE_*, AIBRIX_ROUTING_AUTO_BLEND_* and their EXTPROC_* twins) are read by
# extproc.routing.settings.merge_env.
ENV_OVERRIDES: dict[str, tuple[str, str, type]] = {
    "ROUTING_ALGORITHM": ("routing", "default_strategy", str),
    "AIBRIX_ROUTING_ALGORITHM": ("routing", "default_strategy", str),
    "EXTPROC_DEFAULT_STRATEGY": ("routing", "default_strategy", str),
    "EXTPROC_DESTINATION_HEADER": ("gateway", "destination_header", str),
    "EXTPROC_MAX_BODY_BYTES": ("gateway", "max_body_bytes", int),
    "EXTPROC_DRAIN_TIMEOUT_SECONDS": ("gateway", "drain_timeout_seconds", float),
    "EXTPROC_DRAIN_NOTICE_SECONDS": ("gateway", "drain_notice_seconds", float),
    "EXTPROC_REQUEST_TIMEOUT_SECONDS": ("gateway", "request_timeout_seconds", float),
    "EXTPROC_INCLUDE_USAGE": ("gateway", "include_usage", _bool),
    "EXTPROC_METRICS_REFRESH_SECONDS": ("telemetry", "refresh_seconds", float),
    "EXTPROC_METRICS_TIMEOUT_SECONDS": ("telemetry", "timeout_seconds", float),
    "EXTPROC_REDIS_URL": ("redis", "url", str),
    "EXTPROC_API_KEYS_FILE": ("gateway", "api_keys_file", str),
}


class ConfigError(ValueError):
    pass


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
    routing: Mapping[str, Any] = field(default_factory=dict)
    # Streaming requests get stream_options.include_usage, so every engine reports exact usage; the
    # usage chunk is removed again for clients that did not ask for it.
    include_usage: bool = True
    # A routed request whose access-log record never comes is released after this long.
    request_timeout_seconds: float = 3600.0
    metrics_refresh_seconds: float = 1.0
    metrics_timeout_seconds: float = 0.5
    redis_url: str | None = None
    api_keys_file: str | None = None  # optional client API keys (extproc.server.auth)
    # Where pods come from besides `models`: the file only (default) or the Kubernetes API.
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    # Each model's `routingConfig` (loadBalance.*, autoBlend.*), validated with `routing` at load.
    model_routing: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def routing_settings(self) -> RoutingSettings:
        """Typed routing settings for `extproc.routing.Router` (derived, so a replaced `routing` counts)."""
        from extproc.routing.settings import parse_settings

        return parse_settings(self.routing, self.model_routing)


def load(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if raw is None:  # an empty file, or one caught half-written
        raise ConfigError(f"{path} is empty")
    return parse(raw, os.environ if env is None else env)


def _known(where: str, mapping: Mapping[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(str(k) for k in mapping if k not in allowed)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(allowed))})")


def parse(raw: Any, env: Mapping[str, str]) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError("config must be a mapping")
    _known("", raw, TOP_KEYS)
    try:
        discovery = parse_discovery(_section(raw, "discovery"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if "models" not in raw and not discovery.enabled:
        raise ConfigError("models: the config names no models")
    for name, allowed in SECTION_KEYS.items():
        _known(name, _section(raw, name), allowed)
    routing = dict(_section(raw, "routing"))
    gateway = dict(_section(raw, "gateway"))
    telemetry = dict(_section(raw, "telemetry"))
    redis = dict(_section(raw, "redis"))
    sections = {"routing": routing, "gateway": gateway, "telemetry": telemetry, "redis": redis}
    for var, (section, key, kind) in ENV_OVERRIDES.items():
        if var in env:
            try:
                sections[section][key] = kind(env[var])
            except ValueError:
                raise ConfigError(f"{var}={env[var]!r} is not a valid {kind.__name__}") from None

    models = _section(raw, "models")
    pods = tuple(pod for name, spec in models.items() for pod in _pods(name, spec))

    header = str(gateway.get("destination_header", DEFAULT_DESTINATION_HEADER)).lower()
    if not HEADER_NAME.fullmatch(header) or header in RESERVED_HEADERS or header.startswith("x-envoy-"):
        raise ConfigError(f"destination_header {header!r} must be a plain header name of its own")
    paths = gateway.get("model_paths", list(DEFAULT_MODEL_PATHS))
    if not isinstance(paths, list) or not all(isinstance(p, str) and MODEL_PATH.fullmatch(p) for p in paths):
        raise ConfigError(f"gateway.model_paths must list inference endpoints under /v1/, not {paths!r} "
                          "(an engine's other endpoints must stay out of reach)")
    max_body = int(_number(gateway, "max_body_bytes", DEFAULT_MAX_BODY_BYTES))
    if max_body > ENVOY_BUFFER_BYTES:
        raise ConfigError(f"gateway.max_body_bytes {max_body} is above Envoy's {ENVOY_BUFFER_BYTES}-byte "
                          "buffer: larger bodies would get Envoy's plain-text 413")
    model_routing = {name: spec["routingConfig"] for name, spec in models.items()
                     if isinstance(spec, dict) and spec.get("routingConfig") is not None}
    routing, strategy = _routing(routing, model_routing, tuple(models), env)
    return Config(pods=pods, models=tuple(models), default_strategy=strategy, model_routing=model_routing,
                  destination_header=header, model_paths=frozenset(paths),
                  max_body_bytes=max_body,
                  drain_timeout_seconds=_number(gateway, "drain_timeout_seconds", 30.0, minimum=0),
                  drain_notice_seconds=_number(gateway, "drain_notice_seconds", 0.0, minimum=0),
                  routing=routing, include_usage=_flag(gateway, "include_usage", True),
                  request_timeout_seconds=_number(gateway, "request_timeout_seconds", 3600.0, minimum=1),
                  metrics_refresh_seconds=_number(telemetry, "refresh_seconds", 1.0, minimum=0.05),
                  metrics_timeout_seconds=_number(telemetry, "timeout_seconds", 0.5, minimum=0.01),
                  redis_url=_optional_str(redis, "url"), api_keys_file=_keys_file(gateway),
                  discovery=discovery)


def _routing(routing: dict[str, Any], model_routing: dict[str, Any], models: tuple[str, ...],
             env: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    """Every routing setting and strategy checked now, so a bad one refuses the (re)load."""
    # late: importing extproc.strategies registers every strategy; routing never imports config
    import extproc.strategies  # noqa: F401
    from extproc.routing import Router, SettingError, StrategySpecError
    from extproc.routing.settings import merge_env, parse_settings

    try:
        routing = merge_env(routing, env)
        settings = parse_settings(routing, model_routing)
        Router(settings).validate(models)
    except (SettingError, StrategySpecError) as exc:
        raise ConfigError(str(exc)) from None
    return routing, settings.default_strategy


def _keys_file(gateway: dict[str, Any]) -> str | None:
    path = _optional_str(gateway, "api_keys_file")
    if path is not None:
        from extproc.server.auth import read_keys

        try:
            if not read_keys(Path(path)):
                raise ConfigError(f"gateway.api_keys_file {path} holds no keys")
        except OSError as exc:
            raise ConfigError(f"gateway.api_keys_file {path} cannot be read: {exc.strerror}") from None
    return path


def _flag(section: dict[str, Any], key: str, default: bool) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, not {value!r}")
    return value


def _optional_str(section: dict[str, Any], key: str) -> str | None:
    value = section.get(key)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{key} must be a string")
    return value or None


def _number(section: dict[str, Any], key: str, default: float, minimum: float = 1) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ConfigError(f"{key} must be a number >= {minimum}, not {value!r}")
    return value


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a mapping")
    return value


def _pods(model: str, spec: Any) -> list[Pod]:
    if not isinstance(spec, dict):
        raise ConfigError(f"models.{model} must be a mapping with a pods list")
    _known(f"models.{model}", spec, MODEL_KEYS)
    entries = spec.get("pods") or []
    if not isinstance(entries, list):
        raise ConfigError(f"models.{model}.pods must be a list")
    pods, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"models.{model}.pods[{i}]"
        if not isinstance(entry, dict) or "name" not in entry or "address" not in entry:
            raise ConfigError(f"{where} needs a name and an address")
        _known(where, entry, POD_KEYS)
        name = str(entry["name"])
        if name in seen:
            raise ConfigError(f"{where}: duplicate pod name {name!r}")
        seen.add(name)
        labels = entry.get("labels") or {}
        if not isinstance(labels, dict):
            raise ConfigError(f"{where}.labels must be a mapping")
        ready = entry.get("ready", True)
        if not isinstance(ready, bool):
            raise ConfigError(f"{where}.ready must be true or false")
        labels = {str(k): str(v) for k, v in labels.items()}
        engine = str(entry.get("engine", labels.get(ENGINE_LABEL, "vllm"))).lower()
        if engine not in ENGINES:
            raise ConfigError(f"{where}.engine {engine!r} is not one of {', '.join(ENGINES)}")
        metrics_port = entry.get("metrics_port", labels.get(METRIC_PORT_LABEL))
        if metrics_port is not None:
            try:
                metrics_port = int(metrics_port)
                if not 0 < metrics_port < 65536:
                    raise ValueError
            except (TypeError, ValueError):
                raise ConfigError(f"{where}.metrics_port {metrics_port!r} is not a port") from None
        pods.append(Pod(model=model, name=name, address=_address(str(entry["address"]), where),
                        deployment=str(entry.get("deployment", "")), labels=labels, ready=ready,
                        namespace=str(entry.get("namespace", "default")), engine=engine,
                        metrics_port=metrics_port))
    return pods


def _address(value: str, where: str) -> str:
    """ORIGINAL_DST needs a literal ip:port; a hostname here would never connect."""
    host, sep, port_text = value.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{where}.address {value!r} must be ip:port") from None
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise ConfigError(f"{where}.address {value!r} is not one host's address")
    port = int(port_text)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
