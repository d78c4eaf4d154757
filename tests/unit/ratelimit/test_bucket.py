"""The token bucket: refill, admission, owed output tokens, what the headers and Retry-After say."""

from __future__ import annotations

import pytest

from extproc.ratelimit.bucket import charge, duration, headers, retry_after, take
from extproc.ratelimit.settings import Limits


def test_a_fresh_budget_admits_up_to_its_limit_then_refuses_requests():
    limits, b = Limits(requests=3), None
    verdicts = []
    for _ in range(4):
        b, v = take(b, limits, 10, now=0.0)
        verdicts.append(v)
    assert [v.admitted for v in verdicts] == [True, True, True, False]
    assert verdicts[-1].exceeded == "requests"
    assert retry_after(limits, verdicts[-1]) == pytest.approx(20.0)  # 60 s / 3 per request


def test_the_budget_refills_at_its_rate_and_never_above_the_limit():
    limits = Limits(requests=60)
    b = None
    for _ in range(60):
        b, v = take(b, limits, 0, now=0.0)
    b, v = take(b, limits, 0, now=0.5)
    assert not v.admitted  # half a request back
    b, v = take(b, limits, 0, now=1.0)
    assert v.admitted
    b, v = take(b, limits, 0, now=1000.0)
    assert v.admitted and v.requests == pytest.approx(59.0)  # full (60), one taken


def test_tokens_refuse_a_prompt_the_budget_cannot_cover_and_output_is_owed():
    limits = Limits(tokens=1000)
    b, v = take(None, limits, 600, now=0.0)
    assert v.admitted and v.tokens == 400
    b = charge(b, 1000, 500, now=0.0)  # the output counted when it ended
    assert b.tokens == -100
    b, v = take(b, limits, 1, now=0.0)
    assert not v.admitted and v.exceeded == "tokens"
    assert retry_after(limits, v) == pytest.approx(101 * 60 / 1000)


def test_a_prompt_above_the_whole_limit_waits_a_full_window():
    limits = Limits(tokens=100)
    _, v = take(None, limits, 500, now=0.0)
    assert not v.admitted and retry_after(limits, v) == 60.0


def test_headers_follow_openai_and_cover_only_the_limits_set():
    limits = Limits(requests=10, tokens=1000)
    _, v = take(None, limits, 100, now=0.0)
    h = dict(headers(limits, v))
    assert h == {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "9",
                 "x-ratelimit-reset-requests": "6s", "x-ratelimit-limit-tokens": "1000",
                 "x-ratelimit-remaining-tokens": "900", "x-ratelimit-reset-tokens": "6s"}
    assert [k for k, _ in headers(Limits(requests=5), v)] == [
        "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"]


@pytest.mark.parametrize("seconds,text", [(0.02, "20ms"), (0.0, "0s"), (1.5, "1.5s"), (360, "6m0s"),
                                          (61.25, "1m1.25s")])
def test_durations_are_spelled_as_openai_does(seconds, text):
    assert duration(seconds) == text


def test_a_full_budget_resets_in_0s_as_openai_writes_it():
    limits = Limits(tokens=1000)
    _, v = take(None, limits, 0, now=0.0)  # nothing taken: still full
    assert dict(headers(limits, v))["x-ratelimit-reset-tokens"] == "0s"


def test_a_budget_in_debt_shows_0_remaining_and_a_reset_that_counts_the_debt():
    limits = Limits(tokens=1200)
    b, _ = take(None, limits, 200, now=0.0)
    b = charge(b, 1200, 1400, now=0.0)  # owed: 200 + 1,400 of 1,200
    _, v = take(b, Limits(tokens=1200), 0, now=0.0)
    h = dict(headers(limits, v))
    assert v.tokens == -400
    # never a negative count; full again after 1,600 tokens at 20 a second: 80 s, spelled as Go does
    assert h["x-ratelimit-remaining-tokens"] == "0" and h["x-ratelimit-reset-tokens"] == "1m20s"
