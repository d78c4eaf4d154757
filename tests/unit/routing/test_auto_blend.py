"""AIBrix's auto-blend: what a requested strategy routes as."""

import pytest

from extproc.routing import Profile, Router, RoutingSettings
from extproc.routing.blend import auto_blend, parse_spec
from extproc.routing.framework import MaxScorePicker
from extproc.routing.settings import AutoBlendSettings, ModelRouting
from tests.unit.routing.support import REQ, FixedScorer, registered, view

SCORING = {"load-balance", "least-request", "prefix-cache", "vtc"}
KNOWN = (SCORING | {"random", "round-robin", "slo"}).__contains__


def routed(text, **weights):
    return auto_blend(parse_spec(text, KNOWN), AutoBlendSettings(**weights), SCORING.__contains__).weighted


@pytest.mark.parametrize("asked,routes_as", [
    ("vtc", "vtc:1,load-balance:1,least-request:1"),
    ("vtc:3", "vtc:3,load-balance:1,least-request:1"),
    ("least-request", "least-request:1,load-balance:1"),          # least-request is already named
    ("prefix-cache", "prefix-cache:5,load-balance:4"),            # a bare prefix-cache: its own ratio
    ("prefix-cache:7", "prefix-cache:5,load-balance:4"),          # alone, its weight carries no meaning
    ("prefix-cache:2,vtc", "prefix-cache:2,vtc:1,load-balance:1"),  # no least-request beside prefix-cache
    ("vtc,load-balance:3", "vtc:1,load-balance:3,least-request:1"),  # named load-balance is not re-added
    ("load-balance", "load-balance"),                             # plain load-balance runs its own picker
    ("load-balance:4", "load-balance"),
    ("load-balance,least-request", "load-balance:1,least-request:1"),
    ("least-request,load-balance:0", "least-request"),            # a caller's :0 is never re-added
    ("vtc,least-request:0", "vtc:1,load-balance:1"),
    ("random", "random"),                                         # does not score pods: routes alone
    ("slo", "slo"),                                               # exclusive: routes alone
])
def test_default_weights(asked, routes_as):
    assert routed(asked) == routes_as


def test_weights_come_from_settings_and_0_turns_a_part_off():
    assert routed("vtc", load_balance_weight=3, least_request_weight=2) == "vtc:1,load-balance:3,least-request:2"
    assert routed("vtc", least_request_weight=0) == "vtc:1,load-balance:1"
    assert routed("prefix-cache", prefix_cache_weight=1, prefix_cache_load_balance_weight=2) == \
        "prefix-cache:1,load-balance:2"


def test_load_balance_weight_0_turns_auto_blend_off_altogether():
    # as in AIBrix: least-request exists in its blend only to go with load-balance
    for text in ("vtc", "prefix-cache", "least-request"):
        assert routed(text, load_balance_weight=0) == text


def test_a_blend_that_collapses_to_one_strategy_routes_as_asked():
    # AIBrix routes the original alone when the additions leave a single strategy
    assert routed("prefix-cache", prefix_cache_weight=0) == "prefix-cache"
    assert routed("prefix-cache", prefix_cache_load_balance_weight=0) == "prefix-cache"


def test_router_applies_auto_blend_per_model_and_keeps_the_requested_label():
    settings = RoutingSettings(models={"solo": ModelRouting(auto_blend=AutoBlendSettings(load_balance_weight=0))})
    r = Router(settings)
    assert r.resolve(r.parse("least-request"), "m").weighted == "least-request:1,load-balance:1"
    assert r.resolve(r.parse("least-request"), "solo").weighted == "least-request"
    blended = r.profile_for("least-request", "m")
    assert blended.name == "least-request" and len(blended.scorers) == 2
    assert len(r.profile_for("least-request", "solo").scorers) == 1


def test_auto_blended_load_balance_changes_the_choice():
    """least-request alone prefers the pod with fewer requests; blended with load-balance, the faster pod
    with one more request wins."""
    pods = [view("slow", 2, capacity=1000), view("fast", 3, capacity=3000), view("mid", 4, capacity=2000)]
    r = Router(RoutingSettings(seed=1))
    assert r.profile_for("least-request,load-balance:0", "m").pick(REQ, pods, 0.0).pod.name == "slow"
    assert r.profile_for("least-request", "m").pick(REQ, pods, 0.0).pod.name == "fast"


def test_a_registered_prefix_cache_gets_its_ratio():
    pods = [view("warm", 3), view("cold", 0)]
    factory = lambda s: Profile("prefix-cache", MaxScorePicker(s.rng),  # noqa: E731
                                scorers=[(FixedScorer({"warm": 1.0, "cold": 0.0}), 1.0)])
    with registered("prefix-cache", factory):
        r = Router(RoutingSettings(seed=1))
        assert r.resolve(r.parse("prefix-cache"), "m").weighted == "prefix-cache:5,load-balance:4"
        # 5:4 leans to the cache on an exact disagreement
        assert r.profile_for("prefix-cache", "m").pick(REQ, pods, 0.0).pod.name == "warm"
        assert r.profile_for("prefix-cache:4,load-balance:5", "m").pick(REQ, pods, 0.0).pod.name == "cold"
