import math
import random

import pytest

from extproc.openai import Request
from extproc.pool.pod import Pod
from extproc.routing import Router, RoutingSettings
from extproc.routing.framework import PodView
from extproc.routing.gate import ImbalanceGate, least_loaded
from extproc.routing.load_math import loads
from extproc.routing.settings import LoadBalanceSettings, ModelRouting
from extproc.vocabulary import Speed
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


# -- KV-critical pods (free KV below load-balance's kvCritical, 0.10 by default) ----------------------

def load_balance(model="m"):
    r = Router(RoutingSettings(seed=1))
    return r, r.profile_for("load-balance", model)


def test_an_idle_pod_out_of_kv_does_not_win_over_a_busy_healthy_one():
    """The issue: the gate compared the idle nearly-full pod with the busy one, kept only the full one,
    and load-balance then had to route to 5 % free KV although 60 % was free next door."""
    r, lb = load_balance()
    pods = [view("full", 0, capacity=1000, kv_free=0.05), view("healthy", 20, capacity=1000, kv_free=0.6)]
    assert lb.pick(REQ, pods, 0.0).pod.name == "healthy"
    assert r.imbalance_total == {}  # one healthy pod: nothing to compare it with, the gate does not fire


def test_a_critical_idle_pod_does_not_make_the_gate_fire():
    # over all pods 22 > 2 × (mean of the others 9 + 1) fires; the healthy pods alone are 4 apart
    r, lb = load_balance()
    pods = [view("full", 0, kv_free=0.05), view("h1", 22, kv_free=0.6), view("h2", 18, kv_free=0.6)]
    assert names(lb.candidates(REQ, pods, 0.0)) == ["full", "h1", "h2"]
    assert lb.pick(REQ, pods, 0.0).pod.name == "h2" and r.imbalance_total == {}


def test_the_gate_keeps_only_healthy_pods_when_it_fires():
    g, counts = gate()
    pods = [view("c1", 0, kv_free=0.05), view("c2", 0, kv_free=0.01), view("h1", 20, kv_free=0.6),
            view("h2", 2, kv_free=0.5), view("h3", 3)]  # h3 does not report KV: fully free
    assert names(g.filter(REQ, pods, 0.0)) == ["h2"] and counts == {"m": 1}


def test_the_gate_never_leaves_only_critical_pods_when_a_healthy_one_exists():
    rng = random.Random(7)
    r, lb = load_balance()
    for _ in range(500):
        pods = [view(f"p{i}", rng.choice((0, 1, 2, 5, 20, 40)), capacity=rng.choice((None, 1000.0, 3000.0)),
                     kv_free=rng.choice((None, math.nan, 0.0, 0.05, 0.099, 0.1, 0.6, 1.0)))
                for i in range(rng.randint(2, 6))]
        kept = lb.candidates(REQ, pods, 0.0)
        healthy = [p for p in pods if p.kv_free is None or not p.kv_free < 0.1]  # NaN: healthy
        assert kept and (not healthy or any(p in healthy for p in kept)), names(pods)
        if len(kept) < len(pods):  # the gate fired: what it kept is healthy
            assert all(p in healthy for p in kept), names(pods)


def test_all_critical_the_most_kv_headroom_wins_even_when_busiest():
    r, lb = load_balance()
    two = [view("idle", 0, kv_free=0.02), view("busy", 20, kv_free=0.08)]
    assert lb.pick(REQ, two, 0.0).pod.name == "busy"
    many = [view("c1", 1, kv_free=0.03), view("c2", 1, kv_free=0.04), view("c3", 30, kv_free=0.09)]
    assert lb.pick(REQ, many, 0.0).pod.name == "c3"
    assert r.imbalance_total == {}  # the gate stood aside: not counted


def test_unreported_or_nan_kv_counts_as_healthy():
    g, counts = gate()
    pods = [view("nan", 0, kv_free=math.nan), view("none", 0), view("busy", 20, kv_free=0.6)]
    assert names(g.filter(REQ, pods, 0.0)) == ["nan", "none"] and counts == {"m": 1}
    pods = [view("busy", 20, kv_free=math.nan), view("idle", 0, kv_free=0.5)]  # a NaN first, for min()
    assert names(g.filter(REQ, pods, 0.0)) == ["idle"]


def test_under_speed_the_gate_keeps_the_quickest_pods_not_idle_slow_ones():
    """A hot fast pod beside idle pods of a GPU that is slower idle than the fast ones loaded: the
    gate fires (raw load is skewed) and keeps the pod that gives the lowest time per token."""

    fast = Speed(0.010, 0.01, 5000.0, 256)
    slow = Speed(0.070, 0.01, 400.0, 64)
    pods = [PodView(Pod("m", "hot", "10.0.0.1:1"), running=60, capacity=5000.0, speed=fast),
            PodView(Pod("m", "warm", "10.0.0.2:1"), running=20, capacity=5000.0, speed=fast),
            PodView(Pod("m", "l4-0", "10.0.0.3:1"), running=0, capacity=400.0, speed=slow),
            PodView(Pod("m", "l4-1", "10.0.0.4:1"), running=0, capacity=400.0, speed=slow)]
    request = Request("m", "/v1/chat/completions")
    speed = ImbalanceGate(LoadBalanceSettings(), {}).filter(request, pods, 0.0)
    assert [p.pod.name for p in speed] == ["warm"]
    observed = ImbalanceGate(LoadBalanceSettings(capacity="observed"), {}).filter(request, pods, 0.0)
    assert {p.pod.name for p in observed} == {"l4-0", "l4-1"}  # the least loaded by count
