"""The capacity estimator in virtual time: convergence after a step change, the idle hold, new pods."""

from __future__ import annotations

import pytest

from extproc.state.capacity import BusyClock, CapacityEstimator

A, B, C = ("m", "a", "10.0.0.1:8000"), ("m", "b", "10.0.0.2:8000"), ("m", "c", "10.0.0.3:8000")


def drive(est: CapacityEstimator, key, rate: float, start: float, end: float, step: float = 1.0) -> float:
    """Credit `rate` tokens/s at every refresh from start to end; returns the end time."""
    t = start
    while t < end:
        t += step
        est.observe(key, rate * step, t)
        est.refresh(t)
    return t


def test_converges_to_a_steady_rate():
    est = CapacityEstimator()
    est.track(A, 0.0)
    drive(est, A, 1000.0, 0.0, 30.0)
    assert est.estimate(A) == pytest.approx(1000.0, rel=0.01)


def test_step_change_shows_within_tens_of_seconds():
    est = CapacityEstimator()
    est.track(A, 0.0)
    t = drive(est, A, 1000.0, 0.0, 120.0)
    t = drive(est, A, 2000.0, t, t + 30.0)
    after_30s = est.estimate(A)
    assert 1300 < after_30s < 2000  # moving, not yet there: a ~1 minute window
    drive(est, A, 2000.0, t, t + 60.0)
    assert est.estimate(A) == pytest.approx(2000.0, rel=0.05)


def test_idle_keeps_the_previous_estimate():
    est = CapacityEstimator()
    est.track(A, 0.0)
    t = drive(est, A, 800.0, 0.0, 120.0)
    before = est.estimate(A)
    for _ in range(600):  # ten idle minutes
        t += 1.0
        est.refresh(t)
    assert est.estimate(A) == before


def test_a_new_pod_gets_the_mean_and_none_when_nobody_knows():
    est = CapacityEstimator()
    assert est.capacities([A, B]) == {A: None, B: None}
    for key, rate in ((A, 1000.0), (B, 3000.0)):
        est.track(key, 0.0)
        drive(est, key, rate, 0.0, 120.0)
    caps = est.capacities([A, B, C])
    assert caps[C] == pytest.approx((caps[A] + caps[B]) / 2)


def test_pod_identity_includes_its_address():
    est = CapacityEstimator()
    est.track(A, 0.0)
    drive(est, A, 1000.0, 0.0, 60.0)
    moved = ("m", "a", "10.0.0.9:8000")
    assert est.estimate(moved) is None
    est.forget([moved])
    assert est.estimate(A) is None


def test_long_requests_completing_in_bursts_while_busy():
    """Completions every 10 s (a long request each) while always busy: the rate, not the burst."""
    est = CapacityEstimator()
    est.track(A, 0.0)
    for t in range(1, 181):
        if t % 10 == 0:
            est.observe(A, 10_000.0, float(t))
        est.refresh(float(t), busy={A: 1.0})
    assert est.estimate(A) == pytest.approx(1000.0, rel=0.15)


def test_a_window_draining_after_traffic_stops_does_not_decay():
    est = CapacityEstimator()
    est.track(A, 0.0)
    t = drive(est, A, 500.0, 0.0, 90.0)
    steady = est.estimate(A)
    for _ in range(30):  # half the window drains out, no new tokens, nothing in flight
        t += 1.0
        est.refresh(t)
    assert est.estimate(A) == pytest.approx(steady, rel=0.01)


def learn_burst(lag: float) -> float:
    """A 3.3 s burst of 1000 tokens/s, seen `lag` seconds late (as a second gateway sees it through
    Redis): sampled every 0.1 s, refreshed every 1 s, tokens credited when the requests complete."""
    est, clock = CapacityEstimator(), BusyClock()
    est.track(A, 0.0)
    start, end = 0.35 + lag, 3.65 + lag
    credited = False
    for i in range(1, 101):
        t = i / 10
        clock.sample(t, {A} if start <= t < end else set())
        if not credited and t >= end:
            est.observe(A, 3300.0, t)
            credited = True
        if i % 10 == 0:
            est.refresh(t, clock.take())
    return est.estimate(A) or 0.0


def test_gateways_seeing_a_burst_one_sync_apart_learn_the_same_capacity():
    here, there = learn_burst(0.0), learn_burst(0.17)
    assert here == pytest.approx(1000.0, rel=0.1)
    assert there == pytest.approx(here, rel=0.05)


def test_busy_clock_counts_a_request_shorter_than_the_sample_interval():
    clock = BusyClock()
    clock.sample(0.0, set())
    clock.completed(A)  # started and finished between two samples
    clock.sample(0.1, set())
    clock.sample(0.2, set())
    assert clock.take() == {A: pytest.approx(0.1)}
    assert clock.take() == {}
