import pytest

from extproc.openai import Request
from extproc.routing import Router, RoutingSettings
from extproc.routing.gate import ImbalanceGate, least_loaded, loads
from extproc.routing.settings import LoadBalanceSettings, ModelRouting
from tests.unit.routing.support import REQ, names, view


def gate(capacity_aware=True, **knobs):
    counts: dict[str, int] = {}
    return ImbalanceGate(LoadBalanceSettings(**knobs), counts, capacity_aware), counts


def test_aibrix_rule_on_equal_capacities():
    pods = [view("l1", 2), view("l2", 2), view("l3", 2), view("busy", 20)]
    g, counts = gate()
    # gap 18 >= 8 and 20 > 2 × (mean of the others 2 + 1)
    assert names(g.filter(REQ, pods, 0.0)) == ["l1", "l2", "l3"] and counts == {"m": 1}
    assert len(gate(imbalance_factor=20)[0].filter(REQ, pods, 0.0)) == 4
    assert len(gate(imbalance_min_gap=100)[0].filter(REQ, pods, 0.0)) == 4


def test_factor_uses_the_mean_of_the_others():
    # mean of all would be 6.5 and 14 <= 2 × 7.5; the others' mean is 4 and 14 > 2 × 5
    assert least_loaded([4, 4, 4, 14], 2.0, 8) == [0, 1, 2]


def test_min_gap_is_inclusive_and_two_pods_skip_the_factor():
    assert least_loaded([0, 8], 2.0, 8) == [0]
    assert least_loaded([0, 7], 2.0, 8) is None
    assert least_loaded([12, 20], 2.0, 8) == [0]  # 20 <= 2 × 13, but two pods skip the factor test


def test_keeps_every_least_loaded_pod_and_no_more():
    assert least_loaded([1, 30, 1, 2], 2.0, 8) == [0, 2]


def test_zero_settings_are_valid():
    # min-gap 0 and factor 0: any spread fires; an all-equal pool has nothing to exclude and is not counted
    g, counts = gate(imbalance_min_gap=0, imbalance_factor=0)
    assert names(g.filter(REQ, [view("a", 1), view("b", 2), view("c", 1)], 0.0)) == ["a", "c"]
    assert len(g.filter(REQ, [view("a", 3), view("b", 3)], 0.0)) == 2 and counts == {"m": 1}


def test_raw_count_gate_excludes_a_fast_pod_that_ours_keeps():
    """The spec's known limitation: three slow pods and one 4× faster pod carrying 4× their requests.
    Per unit of capacity they are equally loaded, yet the raw counts look like a hotspot."""
    pods = [view("slow1", 3, capacity=1000), view("slow2", 3, capacity=1000), view("slow3", 3, capacity=1000),
            view("fast", 12, capacity=4000)]
    raw, raw_counts = gate(capacity_aware=False)
    ours, our_counts = gate()
    assert "fast" not in names(raw.filter(REQ, pods, 0.0)) and raw_counts == {"m": 1}
    assert names(ours.filter(REQ, pods, 0.0)) == ["slow1", "slow2", "slow3", "fast"] and our_counts == {}
    # and ours still fires on a real hotspot: the fast pod at 3× its fair share
    pods[3].running = 36
    assert names(ours.filter(REQ, pods, 0.0)) == ["slow1", "slow2", "slow3"] and our_counts == {"m": 1}


def test_loads_stay_in_requests_of_a_mean_capacity_pod():
    pods = [view("a", 10, capacity=1000), view("b", 10, capacity=3000)]
    assert loads(pods) == pytest.approx([20.0, 20 / 3])
    assert loads([view("a", 4), view("b", 6)]) == [4.0, 6.0]  # no estimates: raw counts


def test_gate_runs_ahead_of_load_balance_and_is_counted_per_model():
    r = Router(RoutingSettings(seed=1, load_balance=LoadBalanceSettings(kv_pressure_alpha=20)))
    # with a strong KV penalty "busy" scores best (0.2 against 0.276), but runs 20 against 2
    pods = [view("l1", 2, capacity=100, kv_free=0.2, model="x"), view("l2", 2, capacity=100, kv_free=0.2, model="x"),
            view("l3", 2, capacity=100, kv_free=0.2, model="x"), view("busy", 20, capacity=100, model="x")]
    req = Request(model="x", path="/v1/chat/completions")
    lb = r.profile_for("load-balance", "x")
    assert min(zip(lb.totals(req, pods, 0.0), names(pods)))[1] == "busy"
    assert lb.pick(req, pods, 0.0).pod.name != "busy"
    assert r.imbalance_total == {"x": 1}
    r.profile_for("least-request", "x").pick(req, pods, 0.0)
    assert r.imbalance_total == {"x": 2}


def test_per_model_gate_settings():
    r = Router(RoutingSettings(models={"lax": ModelRouting(LoadBalanceSettings(imbalance_min_gap=100))}))
    pods = [view("a", 0, model="lax"), view("b", 50, model="lax")]
    assert len(r.profile_for("random", "lax").candidates(REQ, pods, 0.0)) == 2
    assert len(r.profile_for("random", "m").candidates(REQ, pods, 0.0)) == 1
