from extproc.openai import Request
from extproc.routing import Router, RoutingSettings
from tests.unit.routing.support import REQ, view


def test_exact_alternation_per_model():
    r = Router()
    profile = r.profile_for("round-robin", "m")
    pods = [view("a"), view("b"), view("c")]
    assert [profile.pick(REQ, pods, 0.0).pod.name for _ in range(7)] == list("abcabca")
    other = [view("x", model="n"), view("y", model="n")]
    other_req = Request(model="n", path="/v1/completions")
    # another model has its own position, and does not disturb this one
    assert r.profile_for("round-robin", "n").pick(other_req, other, 0.0).pod.name == "x"
    assert profile.pick(REQ, pods, 0.0).pod.name == "b"


def test_equal_counts_whatever_the_load_or_speed():
    # exclusive: no imbalance gate, no auto-blend; a 40-request gap does not move it
    r = Router()
    profile = r.profile_for("round-robin", "m")
    pods = [view("slow", 40, capacity=100), view("fast", 0, capacity=10000)]
    picks = [profile.pick(REQ, pods, 0.0).pod.name for _ in range(10)]
    assert picks.count("slow") == picks.count("fast") == 5 and r.imbalance_total == {}
    assert profile.exclusive and profile.filters == []


def test_position_survives_a_config_reload():
    r = Router(RoutingSettings(seed=1))
    pods = [view("a"), view("b")]
    assert r.profile_for("round-robin", "m").pick(REQ, pods, 0.0).pod.name == "a"
    reloaded = r.reconfigured(RoutingSettings(seed=2))
    assert reloaded.profile_for("round-robin", "m").pick(REQ, pods, 0.0).pod.name == "b"
