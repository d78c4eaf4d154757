"""Where a profile goes: a file, stdout, or AIBrix's Redis key `aibrix:profile_<model>_<deployment>`."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

from extproc.gpu_profiles import profile_index_key, profile_key


class OutputError(ValueError):
    """A bad -o target or a failed write; messages never carry a password."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    host: str
    port: int
    db: int
    model: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    url: str = field(default="", repr=False)  # as given, less its ?model= (credentials, TLS, db)

    def key(self, deployment: str) -> str:
        return profile_key(self.model, deployment)

    def public(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/{self.db}"


def parse_redis_url(url: str) -> RedisTarget:
    """redis://[user:pass@]host[:port][/db]?model=MODEL, as aibrix_gen_profile takes it."""
    parts = urlsplit(url)
    try:
        port = parts.port or 6379
    except ValueError:
        raise OutputError("bad port in the redis URL") from None
    db_text = parts.path.strip("/") or "0"
    if not db_text.isdigit():
        raise OutputError(f"redis database must be a number, not {db_text!r}")
    model = parse_qs(parts.query).get("model", [""])[0]
    if not model:
        raise OutputError('the redis URL needs "?model=MODEL": the profile is stored under '
                          "aibrix:profile_<model>_<deployment>")
    return RedisTarget(parts.hostname or "localhost", port, int(db_text), model,
                       unquote(parts.username) if parts.username else None,
                       unquote(parts.password) if parts.password else None, parts.scheme == "rediss",
                       urlunsplit(parts._replace(query="", fragment="")))


def is_redis_url(target: str) -> bool:
    return target.startswith(("redis://", "rediss://"))


def store_redis(target: RedisTarget, deployment: str, profile: dict[str, Any]) -> str:
    import os

    import redis

    from extproc import redis_connect

    # Redis Cluster or Sentinel: EXTPROC_REDIS_MODE / _NODES / _MASTER_NAME, the URL's credentials.
    try:
        where = redis_connect.target_from_env(os.environ, target.url)
    except redis_connect.RedisTargetError as exc:
        raise OutputError(str(exc)) from None
    client = redis_connect.open_sync(where or target.url, timeout=10)
    key = target.key(deployment)
    try:
        # The key, and its place in the model's index: one transaction, but on a cluster they lie on
        # two shards (a reader finds the key by its deployment name meanwhile).
        with redis_connect.pipeline(client, transaction=True) as pipe:
            pipe.set(key, json.dumps(profile))
            pipe.sadd(profile_index_key(target.model), key)
            pipe.execute()
    except redis.RedisError as exc:
        message = str(exc)
        if target.password:
            message = message.replace(target.password, "***")
        raise OutputError(f"cannot store the profile in {target.public()}: {message}") from None
    finally:
        client.close()
    return key


def write_profile(profile: dict[str, Any], deployment: str, target: str | None,
                  stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> None:
    if target is None:
        stdout.write(json.dumps(profile) + "\n")
    elif is_redis_url(target):
        redis_target = parse_redis_url(target)
        key = store_redis(redis_target, deployment, profile)
        stderr.write(f"profile stored in Redis {redis_target.public()} as {key}\n")
    else:
        try:
            Path(target).write_text(json.dumps(profile) + "\n", encoding="utf-8")
        except OSError as exc:
            raise OutputError(f"cannot write {target}: {exc.strerror}") from None
        stderr.write(f"profile written to {target}\n")
