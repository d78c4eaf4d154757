"""A key with both a requests and a tokens limit: charging the output (tokens only) must not cost the
requests budget the refill it earned while the response streamed (the issue's numbers)."""

from __future__ import annotations

from extproc.openai import Request
from extproc.ratelimit import RateLimiter
from extproc.ratelimit.bucket import charge, take
from extproc.ratelimit.limiter import RateLimited
from extproc.ratelimit.settings import Limits, RateLimitSettings

RPM, TPM, REPLY = 60, 100_000, 1_500


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_steady_30_rpm_against_60_with_1500_token_replies_is_never_refused():
    clock = Clock()
    limits = Limits(RPM, TPM)
    limiter = RateLimiter(RateLimitSettings(enabled=True, default=limits), clock=clock)
    request = Request(model="m", path="/v1/chat/completions", prompt_tokens=20)
    refused, remaining = 0, []
    for i in range(20):  # 40 s at one request every 2 s; each reply's tokens charged 1.9 s later
        clock.now = 2.0 * i
        try:
            admission = limiter.admit_here(limiter.budget("Bearer sk-a", request), request)
        except RateLimited:
            refused += 1
            continue
        remaining.append(int(admission.headers()[1][1]))  # x-ratelimit-remaining-requests
        clock.now += 1.9
        limiter.charge(admission.bucket_id, TPM, REPLY)
    # each request takes one and the 2 s between them give one back: the budget stays nearly full
    # (with the refill lost to each charge it fell by 0.95 a request: 59, 58, ..., 41)
    assert refused == 0
    assert min(remaining) >= RPM - 2, remaining


def test_a_charge_refills_every_dimension_the_bucket_holds():
    limits = Limits(requests=60, tokens=6000)
    b, _ = take(None, limits, 100, now=0.0)
    for _ in range(59):
        b, _ = take(b, limits, 0, now=0.0)
    assert b.requests == 0
    b = charge(b, 6000, 500, now=30.0)  # half a minute later: 30 requests earned, kept
    assert b.requests == 30 and b.tokens == 6000 - 500
    b, v = take(b, limits, 0, now=30.0)
    assert v.admitted and v.requests == 29


def test_a_dimension_a_bucket_did_not_hold_starts_full():
    b = charge(None, 1000, 200, now=0.0)  # charged first (its admission's bucket was dropped)
    b, v = take(b, Limits(requests=10, tokens=1000), 0, now=1.0)
    assert v.admitted and v.requests == 9  # not the 0 a bucket without a requests limit keeps
