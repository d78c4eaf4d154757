"""The token-bucket math, pure: a budget refills continuously at its per-minute limit and holds at most
one minute's worth. The in-process store runs it; the Redis store's Lua script (redis_store.py) is the
same rule, so both answer alike. Also what a verdict tells the client: OpenAI's x-ratelimit-* headers and
Retry-After."""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.envoy_contract import RATE_LIMIT_HEADERS
from extproc.ratelimit.settings import Limits

WINDOW_S = 60.0  # limits are per minute; an idle budget is full again after this long

# OpenAI's rate-limit headers (named in envoy_contract: Envoy adds them to routed responses).
(LIMIT_REQUESTS, REMAINING_REQUESTS, RESET_REQUESTS,
 LIMIT_TOKENS, REMAINING_TOKENS, RESET_TOKENS) = RATE_LIMIT_HEADERS


@dataclass(slots=True)
class Bucket:
    requests: float  # available now (a limit that is unset keeps 0 here, unread)
    tokens: float    # may go below zero: output tokens counted after admission are owed
    stamp: float     # when these were last brought up to date
    limits: Limits   # the rates it refills at: those of its last admission


@dataclass(slots=True, frozen=True)
class Verdict:
    admitted: bool
    exceeded: str | None   # "requests" or "tokens" when refused
    requests: float        # what is left after this request (before it, when refused)
    tokens: float
    cost: int              # the tokens this request was charged on admission


def refill(bucket: Bucket | None, limits: Limits, now: float) -> Bucket:
    """Every dimension `limits` sets brought up to `now` (the stamp moves for all of them at once, so
    none may be skipped); a dimension the bucket did not hold yet starts full."""
    if bucket is None:
        return Bucket(float(limits.requests or 0), float(limits.tokens or 0), now, limits)
    elapsed = max(0.0, now - bucket.stamp)
    held = bucket.limits
    if limits.requests:
        bucket.requests = (min(float(limits.requests), bucket.requests + elapsed * limits.requests / WINDOW_S)
                           if held.requests else float(limits.requests))
    if limits.tokens:
        bucket.tokens = (min(float(limits.tokens), bucket.tokens + elapsed * limits.tokens / WINDOW_S)
                         if held.tokens else float(limits.tokens))
    bucket.stamp = now
    bucket.limits = limits
    return bucket


def take(bucket: Bucket | None, limits: Limits, cost: int, now: float) -> tuple[Bucket, Verdict]:
    """Admit one request costing `cost` tokens (the prompt as estimated), or say which limit refuses it."""
    b = refill(bucket, limits, now)
    exceeded = None
    if limits.requests and b.requests < 1:
        exceeded = "requests"
    elif limits.tokens and b.tokens < cost:
        exceeded = "tokens"
    if exceeded is None:
        b.requests -= 1 if limits.requests else 0
        b.tokens -= cost if limits.tokens else 0
    return b, Verdict(exceeded is None, exceeded, b.requests, b.tokens, cost)


def charge(bucket: Bucket | None, tokens_limit: int, tokens: int, now: float) -> Bucket:
    """Tokens counted after admission (the output): owed by the budget, whatever is left. Every
    dimension the bucket holds refills first, at its own rate: a requests budget keeps what it earned
    while the response streamed."""
    held = bucket.limits if bucket is not None else Limits()
    b = refill(bucket, Limits(held.requests, tokens_limit or held.tokens), now)
    if b.limits.tokens:
        b.tokens -= tokens
    return b


def headers(limits: Limits, v: Verdict) -> list[tuple[str, str]]:
    """OpenAI's x-ratelimit-* headers for the limits that apply (reset: until the budget is full)."""
    out = []
    if limits.requests:
        out += [(LIMIT_REQUESTS, str(limits.requests)), (REMAINING_REQUESTS, str(max(0, int(v.requests)))),
                (RESET_REQUESTS, duration(_refill_time(limits.requests - v.requests, limits.requests)))]
    if limits.tokens:
        out += [(LIMIT_TOKENS, str(limits.tokens)), (REMAINING_TOKENS, str(max(0, int(v.tokens)))),
                (RESET_TOKENS, duration(_refill_time(limits.tokens - v.tokens, limits.tokens)))]
    return out


def retry_after(limits: Limits, v: Verdict) -> float:
    """Seconds until a refused request would be admitted (a prompt above the whole token limit: a
    full window, after which it is still refused, which the error message says)."""
    if v.exceeded == "requests" and limits.requests:
        return _refill_time(1 - v.requests, limits.requests)
    if v.exceeded == "tokens" and limits.tokens:
        if v.cost > limits.tokens:
            return WINDOW_S
        return _refill_time(v.cost - v.tokens, limits.tokens)
    return 0.0


def _refill_time(missing: float, per_minute: int) -> float:
    return max(0.0, missing) * WINDOW_S / per_minute


def duration(seconds: float) -> str:
    """OpenAI's (Go's time.Duration) spelling: 0s, 20ms, 1.5s, 6m0s."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    return f"{int(minutes)}m{rest:g}s" if minutes else f"{rest:g}s"
