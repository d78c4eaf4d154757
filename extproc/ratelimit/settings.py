"""The `rate_limits:` section: who a budget belongs to, the default limits and the overrides.

    rate_limits:
      key_by: api_key            # api_key (the Authorization bearer, hashed) or user (the body's `user`)
      requests_per_minute: 600   # absent: no request limit
      tokens_per_minute: 200000  # absent: no token limit
      overrides:                 # most specific first: subject+model, subject, model, the default
        - {api_key_sha256: 9f86d0..., requests_per_minute: 60}
        - {user: alice, model: llama2-7b, tokens_per_minute: 50000}
        - {model: llama2-70b, requests_per_minute: 100}
      aibrix_users: false        # per-user rpm/tpm from AIBrix's `aibrix-users/<user>` records in Redis
      redis_timeout_ms: 5        # the most a request waits on Redis for its budget (then: admitted)

A budget is kept per subject and per model. Parsed and checked whole by the config loader.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KEY_BY = ("api_key", "user")
SECTION_KEYS = frozenset({"key_by", "requests_per_minute", "tokens_per_minute", "overrides",
                          "aibrix_users", "redis_timeout_ms"})
OVERRIDE_KEYS = frozenset({"api_key_sha256", "user", "model", "requests_per_minute", "tokens_per_minute"})
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MAX_REDIS_TIMEOUT_MS = 100  # a request path wait on Redis beyond this is not "a few milliseconds"


class RateLimitError(ValueError):
    """A bad `rate_limits` section; the message names the key."""


@dataclass(slots=True, frozen=True)
class Limits:
    """Per minute; None: that dimension is not limited."""
    requests: int | None = None
    tokens: int | None = None

    @property
    def any(self) -> bool:
        return self.requests is not None or self.tokens is not None

    def over(self, other: Limits) -> Limits:
        """These limits, with what they leave unset taken from `other`."""
        return Limits(self.requests if self.requests is not None else other.requests,
                      self.tokens if self.tokens is not None else other.tokens)


@dataclass(slots=True, frozen=True)
class RateLimitSettings:
    enabled: bool = False
    key_by: str = "api_key"
    default: Limits = Limits()
    # (subject, model) -> limits; subject is "key:<sha256 hex>", "user:<name>" or "" (any), model "" (any)
    overrides: Mapping[tuple[str, str], Limits] = field(default_factory=dict)
    aibrix_users: bool = False
    redis_timeout_s: float = 0.005
    # Whether whose request it is can change its limits (else the model alone decides, and a request
    # no limit applies to costs no hashing of its key)
    by_subject: bool = False

    def limits_for(self, subject: str, model: str) -> tuple[Limits, str]:
        """The subject's limits on the model, and its class for metrics ("override" or "default")."""
        overrides = self.overrides
        if overrides:
            found = (overrides.get((subject, model)) or overrides.get((subject, ""))
                     or overrides.get(("", model)))
            if found is not None:
                return found.over(self.default), "override"
        return self.default, "default"


def parse_rate_limits(raw: Any, models: tuple[str, ...]) -> RateLimitSettings:
    if raw is None:
        return RateLimitSettings()
    if not isinstance(raw, dict):
        raise RateLimitError("rate_limits must be a mapping")
    _known("rate_limits", raw, SECTION_KEYS)
    key_by = raw.get("key_by", "api_key")
    if key_by not in KEY_BY:
        raise RateLimitError(f"rate_limits.key_by must be one of {', '.join(KEY_BY)}, not {key_by!r}")
    default = _limits("rate_limits", raw)
    aibrix = raw.get("aibrix_users", False)
    if not isinstance(aibrix, bool):
        raise RateLimitError(f"rate_limits.aibrix_users must be true or false, not {aibrix!r}")
    if aibrix and key_by != "user":
        raise RateLimitError("rate_limits.aibrix_users needs key_by: user (AIBrix keeps limits per user)")
    timeout = raw.get("redis_timeout_ms", 5)
    if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
            or not 0 < timeout <= MAX_REDIS_TIMEOUT_MS):
        raise RateLimitError(f"rate_limits.redis_timeout_ms must be a number in (0, {MAX_REDIS_TIMEOUT_MS}], "
                             f"not {timeout!r}")
    entries = raw.get("overrides") or []
    if not isinstance(entries, list):
        raise RateLimitError("rate_limits.overrides must be a list")
    overrides: dict[tuple[str, str], Limits] = {}
    for i, entry in enumerate(entries):
        where = f"rate_limits.overrides[{i}]"
        probe = _override_target(where, entry, key_by, models)
        if probe in overrides:
            raise RateLimitError(f"{where}: a second override for the same key and model")
        limits = _limits(where, entry)
        if not limits.any:
            raise RateLimitError(f"{where} sets neither requests_per_minute nor tokens_per_minute")
        overrides[probe] = limits
    return RateLimitSettings(enabled=default.any or bool(overrides) or aibrix, key_by=key_by,
                             default=default, overrides=overrides, aibrix_users=aibrix,
                             redis_timeout_s=timeout / 1000,
                             by_subject=aibrix or any(subject for subject, _ in overrides))


def _override_target(where: str, entry: Any, key_by: str, models: tuple[str, ...]) -> tuple[str, str]:
    if not isinstance(entry, dict):
        raise RateLimitError(f"{where} must be a mapping")
    _known(where, entry, OVERRIDE_KEYS)
    subject = ""
    if "api_key_sha256" in entry:
        digest = entry["api_key_sha256"]
        if key_by != "api_key":
            raise RateLimitError(f"{where}.api_key_sha256: budgets are kept per user (key_by: user)")
        if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest.lower()):
            raise RateLimitError(f"{where}.api_key_sha256 must be a SHA-256 digest in hex (64 characters)")
        subject = "key:" + digest.lower()
    if "user" in entry:
        user = entry["user"]
        if key_by != "user":
            raise RateLimitError(f"{where}.user: budgets are kept per API key (key_by: api_key)")
        if not isinstance(user, str) or not user:
            raise RateLimitError(f"{where}.user must be a non-empty string")
        subject = "user:" + user
    model = entry.get("model", "")
    if model and (not isinstance(model, str) or model not in models):
        raise RateLimitError(f"{where}.model {model!r} is not a configured model")
    if not subject and not model:
        raise RateLimitError(f"{where} names no api_key_sha256, user or model")
    return subject, model


def _limits(where: str, section: Mapping[str, Any]) -> Limits:
    values = []
    for key in ("requests_per_minute", "tokens_per_minute"):
        value = section.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RateLimitError(f"{where}.{key} must be a whole number >= 1, not {value!r}")
        values.append(value)
    return Limits(*values)


def _known(where: str, mapping: Mapping[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(str(k) for k in mapping if k not in allowed)
    if unknown:
        raise RateLimitError(f"unknown key {where}.{unknown[0]} (known: {', '.join(sorted(allowed))})")
