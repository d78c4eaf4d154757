"""The rate_limits section: parsed, and refused whole (naming the key) when wrong."""

from __future__ import annotations

import hashlib

import pytest

from extproc.config import ConfigError, parse
from extproc.ratelimit.settings import Limits

MODELS = {"m": {"pods": [{"name": "p0", "address": "10.0.0.1:8000"}]},
          "n": {"pods": [{"name": "q0", "address": "10.0.0.2:8000"}]}}
DIGEST = hashlib.sha256(b"sk-a").hexdigest()


def config(section):
    return parse({"models": MODELS, "rate_limits": section}, {})


def test_absent_means_off():
    assert not parse({"models": MODELS}, {}).rate_limits.enabled


def test_the_most_specific_override_wins_and_inherits_what_it_leaves_unset():
    rl = config({"requests_per_minute": 100, "tokens_per_minute": 10_000, "overrides": [
        {"api_key_sha256": DIGEST, "requests_per_minute": 5},
        {"api_key_sha256": DIGEST, "model": "n", "tokens_per_minute": 50},
        {"model": "n", "requests_per_minute": 7}]}).rate_limits
    assert rl.enabled and rl.key_by == "api_key" and rl.redis_timeout_s == 0.005
    key = "key:" + DIGEST
    assert rl.limits_for(key, "m") == (Limits(5, 10_000), "override")
    assert rl.limits_for(key, "n") == (Limits(100, 50), "override")
    assert rl.limits_for("key:other", "n") == (Limits(7, 10_000), "override")
    assert rl.limits_for("key:other", "m") == (Limits(100, 10_000), "default")


@pytest.mark.parametrize("section,named", [
    ({"requests_per_minit": 5}, "rate_limits.requests_per_minit"),
    ({"requests_per_minute": 0}, "rate_limits.requests_per_minute"),
    ({"tokens_per_minute": 1.5}, "rate_limits.tokens_per_minute"),
    ({"key_by": "ip"}, "rate_limits.key_by"),
    ({"aibrix_users": True}, "rate_limits.aibrix_users"),
    ({"redis_timeout_ms": 500}, "rate_limits.redis_timeout_ms"),
    ({"overrides": [{"api_key_sha256": "sk-a", "requests_per_minute": 1}]}, "overrides[0].api_key_sha256"),
    ({"overrides": [{"user": "alice", "requests_per_minute": 1}]}, "overrides[0].user"),
    ({"overrides": [{"model": "zz", "requests_per_minute": 1}]}, "overrides[0].model"),
    ({"overrides": [{"model": "m"}]}, "overrides[0] sets neither"),
    ({"overrides": [{"requests_per_minute": 1}]}, "overrides[0] names no"),
    ({"overrides": [{"model": "m", "requests_per_minute": 1}, {"model": "m", "tokens_per_minute": 1}]},
     "overrides[1]"),
])
def test_a_bad_section_is_refused_naming_the_key(section, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        config(section)


def test_aibrix_users_keys_by_user():
    rl = config({"key_by": "user", "aibrix_users": True,
                 "overrides": [{"user": "alice", "requests_per_minute": 2}]}).rate_limits
    assert rl.enabled and rl.aibrix_users and rl.limits_for("user:alice", "m")[0] == Limits(2, None)


def test_check_config_describes_the_section():
    from extproc.config.describe import describe

    section = {"requests_per_minute": 600, "overrides": [{"model": "n", "tokens_per_minute": 9}]}
    lines = describe(config(section))
    assert "rate limits: per api_key and model; 600 requests/min; 1 override(s); in process" in lines
    assert "rate limits: off" in describe(parse({"models": MODELS}, {}))
