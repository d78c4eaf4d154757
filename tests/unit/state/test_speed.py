"""The speed estimator on synthetic (batch, time-per-token) traces, the load integral, and the switch
between `capacity: speed` and AIBrix's observed rate."""

from __future__ import annotations

import random

import pytest

from extproc.config import ConfigError, parse
from extproc.openai import Request
from extproc.pool.pod import Pod
from extproc.routing.framework import PodView
from extproc.routing.load_balance import LoadBalanceScorer
from extproc.routing.settings import LoadBalanceSettings, SettingError, parse_settings
from extproc.server.gateway import Gateway
from extproc.sharing.shared import LocalState
from extproc.state.accounting import Accounting
from extproc.state.speed import LoadIntegral, SpeedEstimator
from extproc.vocabulary import RequestRecord, Speed

FAST = Pod("m", "fast", "10.0.0.1:8000", labels={"gpu": "A100"})
FAST2 = Pod("m", "fast2", "10.0.0.2:8000", labels={"gpu": "A100"})
SLOW = Pod("m", "slow", "10.0.0.3:8000", labels={"gpu": "L20"})
SLOW_BUSY = Pod("m", "slow-busy", "10.0.0.4:8000", labels={"gpu": "L20"})


def feed(est: SpeedEstimator, pod: Pod, base: float, shape: float, batches: tuple[float, float],
         start: float, end: float, rng: random.Random, every: float = 0.1) -> float:
    """Requests finishing every `every` s, each at a batch drawn from `batches`, tpot on the line
    (±2 % noise); a refresh every second. Returns the end time."""
    t, next_refresh = start, start + 1.0
    while t < end:
        t += every
        b = rng.uniform(*batches)
        est.observe(pod.key, base * (1 + shape * b) * rng.uniform(0.98, 1.02), b, 200, t)
        if t >= next_refresh:
            est.refresh([FAST, FAST2, SLOW, SLOW_BUSY], t)
            next_refresh += 1.0
    return t


def test_a_starved_replica_keeps_its_speed():
    """A slow pod that only ever ran one or two requests is valued at its speed, and its saturated
    rate uses the slope its busy siblings show, not its own flat corner of the curve."""
    rng = random.Random(1)
    est = SpeedEstimator()
    base_fast, base_slow, shape = 0.010, 0.024, 0.015
    t = 0.0
    for _ in range(120):  # interleaved: all pods report over the same two minutes
        t0 = t
        feed(est, FAST, base_fast, shape, (10, 120), t0, t0 + 1.0, rng)
        feed(est, FAST2, base_fast, shape, (10, 120), t0, t0 + 1.0, rng)
        t = feed(est, SLOW, base_slow, shape, (1, 2), t0, t0 + 1.0, rng, every=0.5)
    est.refresh([FAST, FAST2, SLOW], t)
    slow = est.speed(SLOW.key)
    assert slow is not None
    assert slow.base == pytest.approx(base_slow, rel=0.03)
    truth = 256 / (base_slow * (1 + shape * 256))
    assert slow.saturated == pytest.approx(truth, rel=0.10)
    fast = est.speed(FAST.key)
    assert fast.shape == pytest.approx(shape, rel=0.10)
    assert fast.saturated == pytest.approx(256 / (base_fast * (1 + shape * 256)), rel=0.05)


def test_a_step_change_is_followed_within_a_few_refreshes():
    rng = random.Random(2)
    est = SpeedEstimator()
    t = feed(est, FAST, 0.010, 0.01, (5, 60), 0.0, 60.0, rng)
    assert est.speed(FAST.key).base == pytest.approx(0.010, rel=0.03)
    t = feed(est, FAST, 0.020, 0.01, (5, 60), t, t + 8.0, rng)  # the pod halves its speed
    assert est.speed(FAST.key).base == pytest.approx(0.020, rel=0.15)


def test_a_new_pod_competes_as_an_average_replica_of_its_type():
    rng = random.Random(3)
    est = SpeedEstimator()
    t = feed(est, SLOW_BUSY, 0.024, 0.01, (5, 40), 0.0, 30.0, rng)
    feed(est, FAST, 0.010, 0.01, (5, 40), 0.0, 30.0, rng)
    est.refresh([FAST, SLOW_BUSY, SLOW], t)
    assert est.speed(SLOW.key).base == pytest.approx(est.speed(SLOW_BUSY.key).base, rel=1e-3)  # its type's
    assert est.speed(SLOW.key).spread > est.speed(SLOW_BUSY.key).spread  # known only through its sibling


def test_the_kv_cache_caps_the_saturated_batch():
    rng = random.Random(4)
    est = SpeedEstimator()
    t = feed(est, FAST, 0.010, 0.01, (5, 40), 0.0, 30.0, rng)
    for i in range(30):
        est.observe_kv(FAST.key, 20, 0.40, t + i)  # 2 % of the cache per request: 50 fit
    est.refresh([FAST], t + 30)
    assert est.speed(FAST.key).batch == pytest.approx(50, rel=0.01)


def test_nothing_observed_means_no_speed():
    est = SpeedEstimator()
    est.observe(FAST.key, float("nan"), 3, 100, 1.0)
    est.observe(FAST.key, 0.01, 0, 100, 1.0)
    est.refresh([FAST], 2.0)
    assert est.speed(FAST.key) is None


def test_load_integral_gives_the_mean_in_flight_count():
    li = LoadIntegral()
    k = FAST.key
    a = li.advance(k, 0.0, 2)
    li.advance(k, 1.0, 4)
    b = li.advance(k, 3.0, 0)
    assert (b - a) / 3.0 == pytest.approx((2 * 1 + 4 * 2) / 3)


def record(pod: Pod, request: Request, ttfb: float, e2e: float, out: int, stream: bool = True):
    return RequestRecord("r", "m", pod, "load-balance", 200, 10, out, "usage", ttfb, e2e, stream=stream,
                         request=request)


def test_accounting_learns_time_per_token_against_the_batch_each_request_saw():
    acc = Accounting(LocalState())
    view = PodView(FAST)
    reqs = [Request("m", "/v1/chat/completions", stream=True) for _ in range(3)]
    for r in reqs:  # three requests in flight from t=0 to t=2: batch 3
        acc.post_choice(r, view, 0.0)
    for r in reqs:
        acc.post_response(record(FAST, r, ttfb=0.1, e2e=2.0, out=96), 2.0)
    acc.refresh([FAST], 2.0)
    speed = acc.speed.speed(FAST.key)
    assert speed is not None
    assert speed.tpot(3) == pytest.approx(1.9 / 95, rel=0.01)
    # non-streamed: the whole time per token, prefill included
    acc2 = Accounting(LocalState())
    r = Request("m", "/v1/chat/completions")
    acc2.post_choice(r, view, 0.0)
    acc2.post_response(record(FAST, r, ttfb=1.9, e2e=2.0, out=100, stream=False), 2.0)
    acc2.refresh([FAST], 2.0)
    assert acc2.speed.speed(FAST.key).tpot(1) == pytest.approx(0.02, rel=0.01)


def views(slow_running: int, fast_running: int) -> list[PodView]:
    return [PodView(SLOW, running=slow_running, capacity=100.0, speed=Speed(0.024, 0.01, 0.0, 256)),
            PodView(FAST, running=fast_running, capacity=3000.0, speed=Speed(0.010, 0.01, 0.0, 256))]


def best(scorer: LoadBalanceScorer, pods: list[PodView]) -> str:
    scores = scorer.score(Request("m", "/v1/chat/completions"), pods, 0.0)
    return pods[scores.index(min(scores))].pod.name


def test_speed_scores_the_time_per_token_the_request_would_get():
    speed = LoadBalanceScorer(LoadBalanceSettings())
    # fast pod with 50 in flight: 10 ms × 1.51 = 15.1 ms beats an idle slow pod's 24.2 ms
    assert best(speed, views(0, 50)) == "fast"
    # ...but not with 200: 10 ms × 3.01 = 30.1 ms
    assert best(speed, views(0, 200)) == "slow"
    scores = speed.score(Request("m", "/v1/chat/completions"), views(0, 50), 0.0)
    assert scores == pytest.approx([0.024 * 1.01, 0.010 * 1.51])


def test_observed_mode_is_the_spec_score():
    observed = LoadBalanceScorer(LoadBalanceSettings(capacity="observed"))
    assert best(observed, views(0, 50)) == "slow"  # idle scores 0 whatever its speed
    assert observed.score(Request("m", "/"), views(2, 30), 0.0) == pytest.approx([2 / 100, 30 / 3000])


def test_speed_mode_without_any_fit_falls_back_to_the_spec_score():
    scorer = LoadBalanceScorer(LoadBalanceSettings())
    pods = [PodView(SLOW, running=0, capacity=100.0), PodView(FAST, running=4, capacity=3000.0)]
    assert scorer.score(Request("m", "/"), pods, 0.0) == [0.0, 4 / 3000]


def test_the_capacity_setting_is_checked_and_reaches_the_views():
    assert parse_settings({"load_balance": {"capacity": "observed"}}).load_balance.capacity == "observed"
    with pytest.raises(SettingError, match=r"routing.load_balance.capacity"):
        parse_settings({"load_balance": {"capacity": "fast"}})
    per_model = parse_settings({}, {"m": {"loadBalance": {"capacity": "observed"}}})
    assert per_model.for_model("m").load_balance.capacity == "observed"
    raw = {"models": {"m": {"pods": [{"name": "fast", "address": "10.0.0.1:8000"}]}}}
    gw = Gateway(parse(raw, env={}))
    assert gw.view_cache.default_mode == "speed"
    with pytest.raises(ConfigError):
        gw.apply(parse({**raw, "routing": {"load_balance": {"capacity": 3}}}, env={}))
    gw.apply(parse({**raw, "routing": {"load_balance": {"capacity": "observed"}}}, env={}))
    assert gw.view_cache.default_mode == "observed"


def test_a_prompt_heavy_mix_is_valued_at_its_prefill_cost():
    # Seen only at a batch of ~1 (no slope): the decode line alone would value the pod at
    # 256 / tpot(1) ~ 25,000 tokens/s. Prefill is compute-bound, 0.1 ms per prompt token, and the mix
    # is ~11 prompt tokens per output token, so kept full it makes at most 1 / (12 x 0.1 ms) tokens/s.
    rng = random.Random(5)
    est = SpeedEstimator()
    t = 0.0
    for _ in range(400):
        t += 0.25
        prompt = rng.uniform(100, 1000)
        est.observe(FAST.key, 0.010, 1.0, 49, t)
        est.observe_prefill(FAST.key, 0.002 + 0.0001 * prompt, prompt, 50, t)
    est.refresh([FAST], t)
    assert est.speed(FAST.key).saturated == pytest.approx(1 / (0.0001 * (1 + 550 / 50)), rel=0.05)


def test_without_spread_in_prompts_prefill_is_bounded_by_time_to_first_token():
    est = SpeedEstimator()
    for i in range(100):
        est.observe(FAST.key, 0.010, 1.0, 49, i * 0.1)
        est.observe_prefill(FAST.key, 0.050, 500, 50, i * 0.1)  # 0.1 ms per prompt token, fixed cost included
    est.refresh([FAST], 10.0)
    assert est.speed(FAST.key).saturated == pytest.approx(1 / (0.0001 * (1 + 10)), rel=0.01)


def test_a_starved_pod_is_valued_on_its_siblings_mix():
    est = SpeedEstimator()
    for i in range(100):
        est.observe(FAST.key, 0.010, 1.0, 49, i * 0.1)
        est.observe_prefill(FAST.key, 0.050, 500, 50, i * 0.1)
    est.observe(FAST2.key, 0.010, 1.0, 60, 9.9)  # speed seen, no mix of its own
    est.refresh([FAST, FAST2], 10.0)
    assert est.speed(FAST2.key).saturated == pytest.approx(est.speed(FAST.key).saturated, rel=0.01)
