"""Every Redis connection the product opens: one instance, a Redis Cluster, or a master found through
Redis Sentinel (`redis.mode`, `redis.nodes`, `redis.master_name`; env EXTPROC_REDIS_MODE,
EXTPROC_REDIS_NODES, EXTPROC_REDIS_MASTER_NAME).

The URL (`redis.url`, EXTPROC_REDIS_URL, AIBrix's REDIS_HOST) always carries the credentials, the
database and TLS (rediss://); in `single` mode also the address. In `cluster` mode `redis.nodes` are
the seed nodes (any reachable one yields the cluster's layout; list several so that one down does not
stop a start), in `sentinel` mode the sentinels, asked for `master_name`'s current master.

On a cluster every multi-key command and script must name keys of one hash slot: the shared state's
keys of a model carry the `{<model>}` hash tag (sharing/sync_core.py), and the readers of AIBrix's
untagged keys (profiles, traces) read them key by key in a pipeline, never with MGET.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from extproc.redact import redact_url

SINGLE, CLUSTER, SENTINEL = "single", "cluster", "sentinel"
MODES = (SINGLE, CLUSTER, SENTINEL)
MODE_ENV, NODES_ENV, MASTER_NAME_ENV = ("EXTPROC_REDIS_MODE", "EXTPROC_REDIS_NODES",
                                        "EXTPROC_REDIS_MASTER_NAME")  # environment.CONFIG_OVERRIDES


class RedisTargetError(ValueError):
    """A bad redis.mode / redis.nodes / redis.master_name; the message names the key."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    url: str = field(repr=False)  # may carry a password
    mode: str = SINGLE
    nodes: tuple[tuple[str, int], ...] = ()
    master_name: str | None = None

    @property
    def cluster(self) -> bool:
        return self.mode == CLUSTER

    def describe(self) -> str:
        """For logs: never the password."""
        if self.mode == SINGLE:
            return redact_url(self.url)
        nodes = ",".join(f"{h}:{p}" for h, p in self.nodes)
        extra = f" master {self.master_name}" if self.mode == SENTINEL else ""
        return f"{self.mode} {nodes}{extra}"


def parse_nodes(value: Any, key: str = "redis.nodes") -> tuple[tuple[str, int], ...]:
    """["host:port", ...] or "host:port,host:port" into (host, port) pairs; [::1]:7000 for IPv6."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not items:
        raise RedisTargetError(f"{key} must be a list of host:port, not {value!r}")
    nodes = []
    for item in items:
        text = item.strip() if isinstance(item, str) else ""
        host, sep, port = text.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RedisTargetError(f"{key} entries must be host:port, not {item!r}")
        nodes.append((host, int(port)))
    return tuple(nodes)


def target(url: str | None, mode: Any = SINGLE, nodes: Any = None, master_name: Any = None,
           where: str = "redis") -> RedisTarget | None:
    """The validated target; None when there is no Redis (no URL and no nodes)."""
    if mode is None:
        mode = SINGLE
    if mode not in MODES:
        raise RedisTargetError(f"{where}.mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == SINGLE:
        if nodes:
            raise RedisTargetError(f"{where}.nodes is for mode cluster or sentinel; single takes redis.url")
        if master_name:
            raise RedisTargetError(f"{where}.master_name is for mode sentinel")
        return RedisTarget(url) if url else None
    if not nodes:
        raise RedisTargetError(f"{where}.nodes is required with {where}.mode {mode}")
    parsed = parse_nodes(nodes, f"{where}.nodes")
    if mode == SENTINEL:
        if not isinstance(master_name, str) or not master_name.strip():
            raise RedisTargetError(f"{where}.master_name is required with {where}.mode sentinel")
        master_name = master_name.strip()
    elif master_name:
        raise RedisTargetError(f"{where}.master_name is for mode sentinel")
    host, port = parsed[0]
    url = url or f"redis://{f'[{host}]' if ':' in host else host}:{port}/0"
    parts = urlsplit(url)
    if mode == CLUSTER and parts.path.strip("/") not in ("", "0"):
        raise RedisTargetError(f"{where}.url: a Redis Cluster has only database 0")
    if mode == SENTINEL and parts.scheme == "rediss":
        raise RedisTargetError(f"{where}.url: TLS (rediss://) is not supported with {where}.mode sentinel")
    return RedisTarget(url, mode, parsed, master_name if mode == SENTINEL else None)


def target_from_env(env: Mapping[str, str], url: str | None, mode: Any = None, nodes: Any = None,
                    master_name: Any = None) -> RedisTarget | None:
    """The config's values, each overridden by its EXTPROC_REDIS_* variable when set."""
    return target(url, env.get(MODE_ENV) or mode, env.get(NODES_ENV) or nodes,
                  env.get(MASTER_NAME_ENV) or master_name)


def _credentials(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    db = parts.path.strip("/") or "0"
    return {"username": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password else None,
            "db": int(db) if db.isdigit() else 0, "ssl": parts.scheme == "rediss"}


def open_async(where: RedisTarget | str, *, timeout: float, decode_responses: bool = False,
               **options: Any) -> Any:
    """An asyncio client (redis.asyncio.Redis, or RedisCluster) for the target; options go to every
    connection (retry, encoding_errors, health_check_interval ...)."""
    import redis.asyncio as aioredis

    spec = where if isinstance(where, RedisTarget) else RedisTarget(where)
    common = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
              "decode_responses": decode_responses, **options}
    if spec.mode == SINGLE:
        return aioredis.from_url(spec.url, **common)
    creds = _credentials(spec.url)
    if spec.mode == CLUSTER:
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        creds.pop("db")
        ssl = creds.pop("ssl")
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in spec.nodes], ssl=ssl,
                            **creds, **common)
    from redis.asyncio.sentinel import Sentinel

    creds.pop("ssl")  # refused with sentinel (`target`)
    sentinel = Sentinel(list(spec.nodes), sentinel_kwargs={"socket_timeout": timeout,
                                                            "socket_connect_timeout": timeout},
                        **creds, **common)
    return sentinel.master_for(spec.master_name)


def open_sync(where: RedisTarget | str, *, timeout: float, **options: Any) -> Any:
    """The blocking twin of `open_async` (gen-profile's one write)."""
    import redis

    spec = where if isinstance(where, RedisTarget) else RedisTarget(where)
    common = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **options}
    if spec.mode == SINGLE:
        return redis.Redis.from_url(spec.url, **common)
    creds = _credentials(spec.url)
    if spec.mode == CLUSTER:
        from redis.cluster import ClusterNode, RedisCluster

        creds.pop("db")
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in spec.nodes], **creds, **common)
    from redis.sentinel import Sentinel

    creds.pop("ssl")
    sentinel = Sentinel(list(spec.nodes), sentinel_kwargs={"socket_timeout": timeout,
                                                            "socket_connect_timeout": timeout},
                        **creds, **common)
    return sentinel.master_for(spec.master_name)


def pipeline(client: Any, transaction: bool = False) -> Any:
    """A pipeline; a cluster's never a transaction (its keys may live on several shards)."""
    if type(client).__name__ == "RedisCluster":
        return client.pipeline()
    return client.pipeline(transaction=transaction)
