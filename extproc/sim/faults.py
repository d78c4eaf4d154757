"""Fault injection: what a misbehaving replica does, as data plus pure decisions.

Durations here are wall-clock seconds (not simulated ones): faults model infrastructure trouble that a
gateway meets with wall-clock timeouts, so a stall of 2 s stays 2 s whatever the time scale.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class FaultConfig:
    error_rate: float = 0.0  # fraction of requests answered with `error_status` before any work
    error_status: int = 500  # 500 or 503
    abort_after_tokens: int | None = None  # close the connection after N streamed tokens
    abort_prob: float = 0.0  # or: each request is aborted mid-stream with this probability
    stall_after_tokens: int | None = None  # stop emitting after N tokens ...
    stall_seconds: float = 0.0  # ... for this long, then resume
    slow_start_seconds: float = 0.0  # after start: /health says 503 and steps run `slow_start_factor`x slower
    slow_start_factor: float = 5.0
    refuse_connections: str | None = None  # "refuse": nothing listens; "reset": accept and close at once
    kv_pressure: float = 0.0  # fraction of KV blocks held by a phantom tenant (usage reads >= this)

    def __post_init__(self) -> None:
        if self.error_status not in (500, 503):
            raise ValueError("error_status must be 500 or 503")
        if self.refuse_connections not in (None, "refuse", "reset"):
            raise ValueError("refuse_connections must be 'refuse' or 'reset'")
        # Rejected rather than defaulted to "stall at once": a stall with no position is more likely a
        # forgotten flag than a wish to hold every stream before its first token.
        if self.stall_seconds and self.stall_after_tokens is None:
            raise ValueError("stall_seconds needs stall_after_tokens (after how many tokens to stall)")
        if self.stall_seconds < 0 or (self.stall_after_tokens or 0) < 0:
            raise ValueError("stall_seconds and stall_after_tokens must not be negative")
        for name in ("error_rate", "abort_prob", "kv_pressure"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> FaultConfig:
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise KeyError(
                f"unknown fault fields: {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}"
            )
        return cls(**data)


@dataclass(frozen=True, slots=True)
class RequestFaults:
    """What happens to one request, decided once on arrival (seeded, so runs repeat)."""

    error_status: int | None = None
    abort_after: int | None = None  # tokens written before the connection is closed
    stall_after: int | None = None


def decide(cfg: FaultConfig, rng: random.Random, max_tokens: int) -> RequestFaults:
    if cfg.error_rate and rng.random() < cfg.error_rate:
        return RequestFaults(error_status=cfg.error_status)
    abort_after = cfg.abort_after_tokens
    if abort_after is None and cfg.abort_prob and rng.random() < cfg.abort_prob:
        abort_after = rng.randrange(0, max(1, max_tokens))
    stall_after = cfg.stall_after_tokens if cfg.stall_seconds > 0 else None
    return RequestFaults(None, abort_after, stall_after)


def in_slow_start(cfg: FaultConfig, seconds_since_start: float) -> bool:
    return seconds_since_start < cfg.slow_start_seconds
