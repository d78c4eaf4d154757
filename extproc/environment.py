"""Every environment variable the product reads, in one table, and the rules that read them.

The config loader (`extproc.config.loader`) is the one reader for `serve` and `check-config`: it folds
these into the typed `Config`, so both show the same gateway. Nothing else in the gateway looks at the
environment. (The optimizer's CLI resolves Redis with the same `redis_url_from_env`.)

Project variables are EXTPROC_*; AIBrix's names are accepted as aliases, so a gateway deployed with the
seed's manifests keeps its settings. Pure: nothing read at import; the routing knobs are listed by
`extproc.routing.settings`, which owns and checks them, and only named here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from extproc.routing.settings import env_knobs


def flag(text: str) -> bool:
    """Our boolean variables: 1/true/yes/on or 0/false/no/off; anything else is refused."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


@dataclass(slots=True, frozen=True)
class Variable:
    name: str
    sets: str  # the config key it overrides ("gateway.max_body_bytes"), or what it sets
    kind: Callable[[str], Any] | None = None  # a config override's type; None: read by a rule below
    aibrix: bool = False  # AIBrix's name (or the seed's), accepted for compatibility


# Overrides of one config key, applied in this order: a later entry wins, so AIBrix's names
# (ROUTING_ALGORITHM, AIBRIX_ROUTING_ALGORITHM) come before our own.
CONFIG_OVERRIDES: tuple[Variable, ...] = (
    Variable("ROUTING_ALGORITHM", "routing.default_strategy", str, aibrix=True),
    Variable("AIBRIX_ROUTING_ALGORITHM", "routing.default_strategy", str, aibrix=True),
    Variable("EXTPROC_DEFAULT_STRATEGY", "routing.default_strategy", str),
    Variable("EXTPROC_DESTINATION_HEADER", "gateway.destination_header", str),
    Variable("EXTPROC_MAX_BODY_BYTES", "gateway.max_body_bytes", int),
    Variable("EXTPROC_DRAIN_TIMEOUT_SECONDS", "gateway.drain_timeout_seconds", float),
    Variable("EXTPROC_DRAIN_NOTICE_SECONDS", "gateway.drain_notice_seconds", float),
    Variable("EXTPROC_REQUEST_TIMEOUT_SECONDS", "gateway.request_timeout_seconds", float),
    Variable("EXTPROC_INCLUDE_USAGE", "gateway.include_usage", flag),
    Variable("EXTPROC_METRICS_REFRESH_SECONDS", "telemetry.refresh_seconds", float),
    Variable("EXTPROC_METRICS_TIMEOUT_SECONDS", "telemetry.timeout_seconds", float),
    Variable("EXTPROC_REDIS_URL", "redis.url", str),
    Variable("EXTPROC_REDIS_MODE", "redis.mode", str),
    Variable("EXTPROC_REDIS_NODES", "redis.nodes", str),
    Variable("EXTPROC_REDIS_MASTER_NAME", "redis.master_name", str),
    Variable("EXTPROC_API_KEYS_FILE", "gateway.api_keys_file", str),
)

# The routing knobs: EXTPROC_X beats its AIBRIX_X twin, both beat the file. Listed, applied and
# range-checked by extproc.routing.settings (merge_env), which owns the routing section: named here from
# its table, so the two cannot drift apart.
ROUTING_KNOBS: tuple[Variable, ...] = tuple(
    Variable(f"{prefix}_{suffix}", key, aibrix=prefix == "AIBRIX")
    for suffix, key in env_knobs().items() for prefix in ("EXTPROC", "AIBRIX"))

REDIS_URL, REDIS_HOST, REDIS_PORT, REDIS_PASSWORD = ("EXTPROC_REDIS_URL", "REDIS_HOST", "REDIS_PORT",
                                                     "REDIS_PASSWORD")
API_KEYS = "EXTPROC_API_KEYS"
TRACING_FLAG = "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG"
POD_NAME = "POD_NAME"
POD_NAMESPACE = "POD_NAMESPACE"
IN_CLUSTER = "KUBERNETES_SERVICE_HOST"

# Read by the rules below, into settings of their own.
OWN_RULES: tuple[Variable, ...] = (
    Variable(REDIS_HOST, "Redis host when no URL is set (redis://HOST:PORT/0)", aibrix=True),
    Variable(REDIS_PORT, "Redis port with REDIS_HOST (default 6379)", aibrix=True),
    Variable(REDIS_PASSWORD, "Redis password, added to a URL that carries none", aibrix=True),
    Variable(API_KEYS, "client API keys, comma-separated (with gateway.api_keys_file's)"),
    Variable(TRACING_FLAG, "request traces for the GPU optimizer (needs Redis)", aibrix=True),
    Variable(POD_NAME, "this gateway's name in Redis (else the hostname)", aibrix=True),
    Variable(IN_CLUSTER, "Kubernetes discovery: in-cluster credentials when no kubeconfig is named"),
    Variable(POD_NAMESPACE, "InferencePool discovery: the pool's namespace when "
                            "discovery.inferencepool.namespace names none (set from the downward API)"),
)

VARIABLES: tuple[Variable, ...] = (*CONFIG_OVERRIDES, *ROUTING_KNOBS, *OWN_RULES)  # the one table


# -- the rules -----------------------------------------------------------------------------------

def redis_url_from_env(env: Mapping[str, str], configured: str | None) -> str | None:
    """EXTPROC_REDIS_URL, else the config's redis.url, else AIBrix's REDIS_HOST/REDIS_PORT.

    REDIS_PASSWORD (AIBrix's secret-backed variable) is added to a URL that carries none, so a
    deployment can keep the password out of its URL and config. rediss:// URLs keep TLS.
    """
    url = (env.get(REDIS_URL) or "").strip() or (configured or "").strip()
    password = env.get(REDIS_PASSWORD) or ""
    if not url:
        host = (env.get(REDIS_HOST) or "").strip()
        if not host:
            return None
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal
        port = (env.get(REDIS_PORT) or "").strip() or "6379"
        url = f"redis://{host}:{port}/0"
    if password:
        parts = urlsplit(url)
        if parts.password is None:
            user = quote(parts.username, safe="") if parts.username else ""
            netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
            url = urlunsplit(parts._replace(netloc=netloc))
    return url


_GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})  # Go's strconv.ParseBool, as AIBrix reads it


def tracing_enabled(env: Mapping[str, str]) -> bool:
    """AIBRIX_GPU_OPTIMIZER_TRACING_FLAG, read the way AIBrix reads it: anything unparsable is off."""
    return env.get(TRACING_FLAG, "false").strip() in _GO_TRUE


def api_keys(env: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(k.strip() for k in env.get(API_KEYS, "").split(",") if k.strip())


def pod_name(env: Mapping[str, str]) -> str | None:
    """AIBrix names a gateway instance by POD_NAME (the caller falls back to the hostname)."""
    return env.get(POD_NAME) or None


def pod_namespace(env: Mapping[str, str]) -> str | None:
    return env.get(POD_NAMESPACE) or None


def in_cluster(env: Mapping[str, str]) -> bool:
    return bool(env.get(IN_CLUSTER))
