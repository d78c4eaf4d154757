"""The config pipeline: the YAML file plus the environment → one checked, typed `Config`.

Everything is checked here, once, before a config replaces the one serving: unknown keys, types, ranges,
the routing settings with every strategy built, the API key file read. A bad config is refused whole,
with the key or variable at fault named. `serve`, its reloads and `check-config` all come through here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from extproc import environment, redis_connect
from extproc.config.discovery import parse_discovery
from extproc.config.keys import read_keys
from extproc.config.pods import model_pods
from extproc.config.schema import (
    DEFAULT_FALLBACK_ENDPOINTS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MODEL_PATHS,
    MAX_FALLBACK_ENDPOINTS,
    SECTION_KEYS,
    TOP_KEYS,
    Config,
    ConfigError,
    RedisSync,
    check_known,
)
from extproc.config.source import DuplicateKey, read_yaml
from extproc.envoy_contract import DEFAULT_DESTINATION_HEADER, ENVOY_BUFFER_BYTES
from extproc.ratelimit.settings import OVERRIDE_KEYS as RATE_LIMIT_OVERRIDE_KEYS
from extproc.ratelimit.settings import SECTION_KEYS as RATE_LIMIT_KEYS
from extproc.ratelimit.settings import RateLimitError, parse_rate_limits
from extproc.routing.settings import RoutingSettings

HEADER_NAME = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")  # an RFC 9110 token, lower-cased
RESERVED_HEADERS = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection",
                              "keep-alive", "upgrade", "te", "trailer", "proxy-connection", "x-request-id"})
MODEL_PATH = re.compile(r"/v1(/[a-z0-9_.-]+)+")  # OpenAI-style inference endpoints only


def load(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    try:
        raw = read_yaml(Path(path).read_text())
    except DuplicateKey as exc:
        raise ConfigError(str(exc)) from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if raw is None:  # an empty file, or one caught half-written
        raise ConfigError(f"{path} is empty")
    return parse(raw, os.environ if env is None else env)


def parse(raw: Any, env: Mapping[str, str]) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError("config must be a mapping")
    check_known("", raw, TOP_KEYS)
    discovery = parse_discovery(_section(raw, "discovery"), in_cluster=environment.in_cluster(env),
                                own_namespace=environment.pod_namespace(env))
    if "models" not in raw and not discovery.enabled:
        raise ConfigError("models: the config names no models")
    for name, allowed in SECTION_KEYS.items():
        check_known(name, _section(raw, name), allowed)
    _check_owned_keys(raw)
    routing = dict(_section(raw, "routing"))
    gateway = dict(_section(raw, "gateway"))
    telemetry = dict(_section(raw, "telemetry"))
    redis = dict(_section(raw, "redis"))
    sections = {"routing": routing, "gateway": gateway, "telemetry": telemetry, "redis": redis}
    for var in environment.CONFIG_OVERRIDES:
        if var.name in env:
            section, key = var.sets.split(".")
            try:
                sections[section][key] = var.kind(env[var.name])  # type: ignore[misc]
            except ValueError:
                raise ConfigError(f"{var.name}={env[var.name]!r} is not a valid "
                                  f"{_type_name(var.kind)}") from None

    models = _section(raw, "models")
    pods = tuple(pod for name, spec in models.items() for pod in model_pods(name, spec))

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
    settings = _routing(routing, model_routing, tuple(models), env)
    try:
        rate_limits = parse_rate_limits(raw.get("rate_limits"), tuple(models))
    except RateLimitError as exc:
        raise ConfigError(str(exc)) from None
    redis_url = environment.redis_url_from_env(env, _optional_str(redis, "url"))
    try:
        redis_target = redis_connect.target(redis_url, redis.get("mode"), redis.get("nodes"),
                                            redis.get("master_name"))
    except redis_connect.RedisTargetError as exc:
        raise ConfigError(str(exc)) from None
    return Config(pods=pods, models=tuple(models), default_strategy=settings.default_strategy,
                  destination_header=header, model_paths=frozenset(paths),
                  max_body_bytes=max_body,
                  drain_timeout_seconds=_number(gateway, "drain_timeout_seconds", 30.0, minimum=0),
                  drain_notice_seconds=_number(gateway, "drain_notice_seconds", 0.0, minimum=0),
                  routing_settings=settings, include_usage=_flag(gateway, "include_usage", True),
                  fail_open=_flag(gateway, "fail_open", False),
                  fallback_endpoints=_fallback_endpoints(gateway),
                  request_timeout_seconds=_number(gateway, "request_timeout_seconds", 3600.0, minimum=1),
                  metrics_refresh_seconds=_number(telemetry, "refresh_seconds", 1.0, minimum=0.05),
                  metrics_timeout_seconds=_number(telemetry, "timeout_seconds", 0.5, minimum=0.01),
                  redis_url=redis_target.url if redis_target else None, redis_target=redis_target,
                  redis_instance=environment.pod_name(env), redis_sync=_redis_sync(redis),
                  tracing=environment.tracing_enabled(env),
                  api_keys_file=_keys_file(gateway), api_keys=environment.api_keys(env),
                  discovery=discovery, rate_limits=rate_limits)


def _check_owned_keys(raw: Mapping[str, Any]) -> None:
    """Unknown keys of the sections other packages parse (routing, rate_limits), named here as every
    section's are: with the line and the closest known key. Their parsers check values (and keys
    again, for callers without a file)."""
    import extproc.strategies  # noqa: F401  (the strategies' own routing sections)
    from extproc.routing.settings import known_keys

    routing = _section(raw, "routing")
    for where, allowed in known_keys().items():
        section = routing if where == "routing" else routing.get(where.partition(".")[2])
        if isinstance(section, Mapping):
            check_known(where, section, allowed)
    limits = raw.get("rate_limits")
    if isinstance(limits, Mapping):
        check_known("rate_limits", limits, RATE_LIMIT_KEYS)
        overrides = limits.get("overrides")
        for i, entry in enumerate(overrides if isinstance(overrides, list) else ()):
            if isinstance(entry, Mapping):
                check_known(f"rate_limits.overrides[{i}]", entry, RATE_LIMIT_OVERRIDE_KEYS)


def _routing(routing: dict[str, Any], model_routing: dict[str, Any], models: tuple[str, ...],
             env: Mapping[str, str]) -> RoutingSettings:
    """Every routing setting and strategy checked now, so a bad one refuses the (re)load."""
    # late: importing extproc.strategies registers every strategy; routing never imports config
    import extproc.strategies  # noqa: F401
    from extproc.routing import Router, SettingError, StrategySpecError
    from extproc.routing.settings import merge_env, parse_settings

    try:
        settings = parse_settings(merge_env(routing, env), model_routing)
        Router(settings).validate(models)
    except (SettingError, StrategySpecError) as exc:
        raise ConfigError(str(exc)) from None
    return settings


def _keys_file(gateway: dict[str, Any]) -> str | None:
    path = _optional_str(gateway, "api_keys_file")
    if path is not None:
        try:
            if not read_keys(Path(path)):
                raise ConfigError(f"gateway.api_keys_file {path} holds no keys")
        except OSError as exc:
            raise ConfigError(f"gateway.api_keys_file {path} cannot be read: {exc.strerror}") from None
    return path


def _type_name(kind: Any) -> str:
    return "true/false value" if kind is environment.flag else kind.__name__


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


def _number(section: dict[str, Any], key: str, default: float, minimum: float = 1, where: str = "") -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        name = f"{where}.{key}" if where else key
        raise ConfigError(f"{name} must be a number >= {minimum}, not {value!r}")
    return value


def _fallback_endpoints(gateway: dict[str, Any]) -> int:
    value = gateway.get("fallback_endpoints", DEFAULT_FALLBACK_ENDPOINTS)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_FALLBACK_ENDPOINTS:
        raise ConfigError(f"gateway.fallback_endpoints must be a whole number from 1 to "
                          f"{MAX_FALLBACK_ENDPOINTS}, not {value!r}")
    return value


def _redis_sync(redis: dict[str, Any]) -> RedisSync:
    """`redis.*` timing: a turn must fit its interval's order and come well inside the liveness
    window (3 heartbeats), or every gateway would take the others for dead between two turns."""
    interval = _number(redis, "sync_interval_seconds", 0.1, minimum=0.01, where="redis")
    heartbeat = _number(redis, "heartbeat_seconds", 1.0, minimum=0.1, where="redis")
    timeout = _number(redis, "timeout_seconds", 0.5, minimum=0.01, where="redis")
    if heartbeat < interval:
        raise ConfigError(f"redis.heartbeat_seconds {heartbeat} is below redis.sync_interval_seconds "
                          f"{interval}: a heartbeat goes with a sync turn")
    if interval + timeout >= 3 * heartbeat:
        raise ConfigError(f"redis.sync_interval_seconds + redis.timeout_seconds ({interval + timeout:g}) "
                          f"must stay below the liveness window, 3 x redis.heartbeat_seconds "
                          f"({3 * heartbeat:g})")
    aibrix_rows = redis.get("aibrix_rows", False)
    if not isinstance(aibrix_rows, bool):
        raise ConfigError(f"redis.aibrix_rows must be true or false, not {aibrix_rows!r}")
    return RedisSync(interval, heartbeat, timeout, aibrix_rows)


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a mapping")
    return value
