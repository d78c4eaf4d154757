import math
from collections import Counter
from dataclasses import replace

import pytest

from extproc.routing import Router, RoutingSettings, build
from extproc.routing.load_balance import LoadBalanceScorer, load_balance_score
from extproc.routing.settings import LoadBalanceSettings, ModelRouting
from extproc.vocabulary import Speed
from tests.unit.routing.support import REQ, view

WORKED = [view("A100", 20, capacity=4000, kv_free=0.30), view("L20", 25, capacity=3000, kv_free=0.60),
          view("B100", 30, capacity=6000, kv_free=0.50)]


def scores(pods, **knobs):
    return LoadBalanceScorer(LoadBalanceSettings(**knobs)).score(REQ, pods, 0.0)


def alone(seed=1, **knobs):
    """load-balance as the gateway routes it alone (gate included), with the given knobs."""
    settings = RoutingSettings(seed=seed, load_balance=LoadBalanceSettings(**knobs))
    return Router(settings).profile_for("load-balance", "m")


def test_the_specs_worked_example():
    assert [round(s, 4) for s in scores(WORKED)] == [0.0099, 0.0110, 0.0075]
    assert alone().pick(REQ, WORKED, 0.0).pod.name == "B100"


def test_formula_with_every_knob():
    # (running + λ·queued) / capacity × (1 + α·(1 − kvFree)²)
    pod = view("p", 10, queued=4, capacity=2000, kv_free=0.4)
    (s,) = scores([pod], queued_weight=0.5, kv_pressure_alpha=3.0)
    assert s == pytest.approx((10 + 0.5 * 4) / 2000 * (1 + 3.0 * 0.6 ** 2))


def test_queued_is_ignored_at_the_default_weight_0():
    a, b = view("a", 5, queued=50, capacity=1000), view("b", 5, queued=0, capacity=1000)
    assert scores([a, b]) == [0.005, 0.005]
    assert scores([a, b], queued_weight=1.0)[0] > scores([a, b], queued_weight=1.0)[1]


def test_alpha_0_turns_the_kv_penalty_off():
    assert scores([view("a", 10, capacity=1000, kv_free=0.2)], kv_pressure_alpha=0.0) == [0.01]


def test_no_capacity_anywhere_means_equal_capacities():
    s = scores([view("a", 4), view("b", 8, kv_free=0.5)])
    # with all capacities equal (1.0) the score is load × KV penalty
    assert s == [4.0, 8 * (1 + 2 * 0.25)]


def test_a_pod_without_an_estimate_gets_the_mean_of_the_others():
    s = scores([view("a", 10, capacity=1000), view("b", 10, capacity=3000), view("new", 10)])
    assert s[2] == pytest.approx(10 / 2000)


@pytest.mark.parametrize("kv", [None, math.nan])
def test_unreported_or_nan_kv_is_fully_free_with_no_guardrail(kv):
    (s,) = scores([view("a", 10, capacity=1000, kv_free=kv)], kv_critical_free=0.5)
    assert s == pytest.approx(0.01)  # no penalty, and not +Inf despite the high guardrail


def test_below_kv_critical_scores_inf_and_is_skipped_when_routing_alone():
    # (running gaps stay under the imbalance gate's min-gap of 8 in these tests)
    pods = [view("full", 0, capacity=1000, kv_free=0.05), view("busy", 5, capacity=1000, kv_free=0.9)]
    assert scores(pods)[0] == math.inf
    assert all(alone(seed=s).pick(REQ, pods, 0.0).pod.name == "busy" for s in range(20))


def test_kv_critical_0_disables_the_guardrail():
    assert scores([view("a", 2, capacity=1000, kv_free=0.0)], kv_critical_free=0.0) == [pytest.approx(0.006)]


def test_every_pod_below_kv_critical_still_routes_to_most_kv_headroom():
    pods = [view("a", 1, kv_free=0.02, cpu=0.0), view("b", 7, kv_free=0.08, cpu=0.0),
            view("c", 0, kv_free=0.09, cpu=0.5)]
    assert all(s == math.inf for s in scores(pods))
    # combined GPU + CPU usage: a 0.98, b 0.92, c 0.91 + 0.5
    assert alone().pick(REQ, pods, 0.0).pod.name == "b"


def test_idle_pod_scores_0_whatever_its_capacity():
    pods = [view("slow-idle", 0, capacity=10), view("fast", 1, capacity=100000)]
    assert scores(pods)[0] == 0.0
    assert alone().pick(REQ, pods, 0.0).pod.name == "slow-idle"


def test_ties_go_to_least_combined_gpu_and_cpu_kv_usage():
    pods = [view("a", 0, kv_free=0.5, cpu=0.3), view("b", 0, kv_free=0.5, cpu=0.1), view("c", 0, kv_free=0.7)]
    # a 0.8, b 0.6, c 0.3 (no CPU KV reported: counts as empty)
    assert alone().pick(REQ, pods, 0.0).pod.name == "c"
    pods[2] = view("c", 0, kv_free=0.3)
    assert alone().pick(REQ, pods, 0.0).pod.name == "b"


def test_full_ties_are_broken_at_random():
    pods = [view(n, 2, capacity=1000, kv_free=0.5, cpu=0.1) for n in ("a", "b", "c")]
    profile = alone(seed=7)
    picks = Counter(profile.pick(REQ, pods, 0.0).pod.name for _ in range(600))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 120


def test_faster_pod_takes_proportionally_more_requests():
    """Route 300 requests into an empty pool that never drains: load ends up ∝ capacity."""
    pods = [view("slow", 0, capacity=1000), view("fast", 0, capacity=3000)]
    profile = alone(seed=3)
    for _ in range(300):
        profile.pick(REQ, pods, 0.0).running += 1
    assert 70 <= pods[0].running <= 80 and 220 <= pods[1].running <= 230


def test_per_model_knobs():
    settings = RoutingSettings(models={"strict": ModelRouting(LoadBalanceSettings(kv_critical_free=0.6))})
    router = Router(settings)
    pods = [view("half-full", 0, kv_free=0.5, model="strict"), view("busy", 5, kv_free=1.0, model="strict")]
    strict = router.profile_for("load-balance", "strict")
    assert strict.pick(REQ, pods, 0.0).pod.name == "busy"  # 0.5 < 0.6: skipped
    assert router.profile_for("load-balance", "m").pick(REQ, pods, 0.0).pod.name == "half-full"


def test_score_function_edge_values():
    assert load_balance_score(0, 0.0, None, 2.0, 0.1) == 0.0  # idle with a zero capacity: no 0/0
    assert load_balance_score(5, 100.0, 0.1, 2.0, 0.1) < math.inf  # exactly at kvCritical: not below
    assert build("load-balance").scorers[0][0].lower_is_better


def test_the_scorer_agrees_with_the_formula_function():
    import random
    rng = random.Random(4)
    knobs = LoadBalanceSettings(queued_weight=0.3, kv_pressure_alpha=1.7, kv_critical_free=0.2)
    pods = [view(f"p{i}", rng.choice((0, 0, 3, 17)), queued=rng.choice((0.0, 2.0, math.nan)),
                 kv_free=rng.choice((None, math.nan, 0.0, 0.15, 0.2, 0.6, 1.0)), capacity=rng.choice((None, 500.0, 4000.0)))
            for i in range(200)]
    got = LoadBalanceScorer(knobs).score(REQ, pods, 0.0)
    known = [p.capacity for p in pods if p.capacity]
    caps = [p.capacity or sum(known) / len(known) for p in pods]
    want = [load_balance_score(p.running + (0.3 * p.queued if p.queued == p.queued else 0), c, p.kv_free, 1.7, 0.2)
            for p, c in zip(pods, caps)]
    assert got == pytest.approx(want)


def test_a_pod_that_would_queue_in_its_engine_ranks_below_every_pod_with_a_free_slot():
    # The fast pod's score is far lower, but it runs max_num_seqs already: the request would wait in
    # its engine queue while the slow pod has free slots (issue 43's burst).
    fast, slow = view("fast", 8, capacity=1000), view("slow", 7, capacity=500)
    assert scores([fast, slow], max_num_seqs=0)[0] < scores([fast, slow], max_num_seqs=0)[1]
    full, free = scores([fast, slow], max_num_seqs=8)
    assert full > free
    assert alone(max_num_seqs=8).pick(REQ, [fast, slow], 0.0).pod.name == "slow"
    # every pod full: the formula's order stands, the request still routes
    assert alone(max_num_seqs=7).pick(REQ, [fast, slow], 0.0).pod.name == "fast"


def test_the_kv_cache_batch_from_the_speed_fit_is_a_limit_too():
    fast = replace(view("fast", 40), speed=Speed(0.005, 0.01, 3000.0, 40.0, 0.0))  # KV holds 40
    slow = replace(view("slow", 10), speed=Speed(0.030, 0.01, 500.0, 256.0, 0.0))
    s_fast, s_slow = scores([fast, slow], max_num_seqs=256)
    assert s_fast > s_slow
    s_fast, s_slow = scores([fast, slow], max_num_seqs=0)  # the rule off: the formula alone
    assert s_fast < s_slow


def test_full_pods_keep_their_order_among_themselves():
    pods = [view("a", 4, capacity=1000), view("b", 4, capacity=2000), view("c", 1, capacity=10)]
    a, b, c = scores(pods, max_num_seqs=4)
    assert c < b < a


def test_the_imbalance_gate_never_keeps_only_full_pods_while_another_has_a_free_slot():
    # capacity-normalised, the slow pod looks like the hotspot and the gate would keep the fast one,
    # whose engine is full
    fast, slow = view("fast", 8, capacity=10_000), view("slow", 7, capacity=100)
    assert alone(max_num_seqs=0).pick(REQ, [fast, slow], 0.0).pod.name == "fast"
    assert alone(max_num_seqs=8).pick(REQ, [fast, slow], 0.0).pod.name == "slow"
