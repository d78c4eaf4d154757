import pytest

from extproc.routing import Router, RoutingSettings, StrategySpecError, UnknownStrategy
from extproc.routing.settings import LoadBalanceSettings
from tests.unit.routing.support import REQ, view


def test_no_header_routes_with_the_default_strategy():
    r = Router()
    assert r.parse(None) is r.parse("  ") is r.default
    assert r.default.names == ("load-balance",)
    assert Router(RoutingSettings(default_strategy="least-request:2,random:0")).default.names == ("least-request",)


def test_compiled_profiles_are_cached_per_header_value_and_model():
    r = Router()
    p = r.profile_for("least-request", "m")
    assert r.profile_for("least-request", "m") is p
    assert r.profile_for(r.parse("Least-Request:1"), "m") is p  # same canonical spec
    assert r.profile_for("least-request", "other") is not p
    assert r.profile_for("least-request,load-balance:0", "m") is not p  # routes differently: no auto-blend


def test_caches_are_bounded_because_clients_choose_header_values():
    r = Router(RoutingSettings(cache_size=8))
    for w in range(1, 200):
        r.profile_for(f"least-request:{w},load-balance:1", "m")
    assert len(r._specs) <= 8 and len(r._compiled) <= 8
    assert len(r._members) == 2  # members are shared by every blend


def test_profile_name_is_a_bounded_label():
    r = Router()
    assert r.profile_for("load-balance:7,least-request:3", "m").name == "least-request,load-balance"
    assert r.profile_for("least-request", "m").name == "least-request"  # auto-blend stays invisible


def test_errors_surface_at_parse_time():
    r = Router()
    with pytest.raises(UnknownStrategy):
        r.parse("fastest")
    with pytest.raises(StrategySpecError, match="weight 0"):
        r.profile_for("load-balance:0", "m")


def test_members_are_shared_and_their_hooks_reported_once():
    seen: list[object] = []
    r = Router(on_plugin=seen.append)
    r.profile_for("least-request", "m")
    r.profile_for("least-request:3,load-balance:1", "m")
    r.profile_for("load-balance", "m")
    assert len(seen) == len(set(map(id, seen))) == len(list(r.plugins()))
    blended = r.profile_for("least-request", "m")
    assert set(map(id, r.member("load-balance", "m").plugins())) <= set(map(id, blended.plugins()))


def test_reconfigured_router_keeps_state_and_uses_new_settings():
    r = Router(RoutingSettings(seed=3))
    pods = [view("a", 0, kv_free=0.5), view("b", 5, kv_free=1.0)]
    assert r.profile_for("load-balance", "m").pick(REQ, pods, 0.0).pod.name == "a"
    strict = r.reconfigured(RoutingSettings(load_balance=LoadBalanceSettings(kv_critical_free=0.6)))
    assert strict.state is r.state
    assert strict.profile_for("load-balance", "m").pick(REQ, pods, 0.0).pod.name == "b"


def test_validate_builds_everything_for_every_model():
    Router().validate(["m", "n"])
    with pytest.raises(UnknownStrategy):
        Router(RoutingSettings(default_strategy="nope")).validate(["m"])


def test_seeded_routers_decide_alike():
    pods = [view(n, 1) for n in "abcdef"]
    runs = [[Router(RoutingSettings(seed=9)).profile_for("load-balance", "m").pick(REQ, pods, 0.0).pod.name
             for _ in range(3)] for _ in range(2)]
    assert runs[0] == runs[1]
    one = Router(RoutingSettings(seed=9)).profile_for("load-balance", "m")
    assert len({one.pick(REQ, pods, 0.0).pod.name for _ in range(60)}) > 1


def test_learners_join_when_a_profile_first_routes_by_their_strategy_and_stay_across_reloads():
    seen: list[object] = []
    r = Router(on_plugin=seen.append)
    r.validate(["m"])  # builds every strategy; only the default (load-balance) routes
    latency = r.member("least-latency", "m").plugins()
    assert not set(map(id, latency)) & set(map(id, seen))
    assert {id(p) for p in r.member("load-balance", "m").plugins()} <= set(map(id, seen))
    r.profile_for("least-latency", "m")  # a request asks for it (auto-blended with least-request)
    assert {id(p) for p in latency} <= set(map(id, seen))
    assert {id(p) for p in r.member("least-request", "m").plugins()} <= set(map(id, seen))
    again = r.reconfigured(RoutingSettings(seed=4))
    again.validate(["m"])
    assert {id(p) for p in again.member("least-latency", "m").plugins()} <= set(map(id, again.plugins()))
    assert not {id(p) for p in again.member("throughput", "m").plugins()} & set(map(id, again.plugins()))
