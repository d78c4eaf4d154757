"""EngineDriver: the virtual-time interface a fleet simulation uses."""

from __future__ import annotations

import pytest

from extproc.sim.driver import EngineDriver
from extproc.sim.replica import build_engine
from extproc.sim.sequences import SimRequest
from extproc.sim.virtual import run_closed_loop


def test_advance_to_returns_steps_that_ended_and_keeps_one_in_flight() -> None:
    d = EngineDriver(build_engine("A100-40GB", "llama3-8b"))
    assert d.next_event_time() is None
    d.add(SimRequest("a", 1024, 4), now=1.0)
    assert d.next_event_time() == 1.0
    assert d.advance_to(1.0) == []  # the prefill step started at 1.0 but has not ended
    first_end = d.next_event_time()
    assert first_end is not None and first_end > 1.0
    steps = d.advance_to(first_end)
    assert [s.emitted for s in steps] == [["a"]]
    steps = d.advance_to(100.0)
    assert sum(len(s.emitted) for s in steps) == 3 and steps[-1].finished[0].request_id == "a"
    assert d.next_event_time() is None and d.clock == 100.0


def test_arrival_during_a_step_joins_the_next_one() -> None:
    d = EngineDriver(build_engine("A100-80GB", "llama2-7b"))
    d.add(SimRequest("a", 16, 10), now=0.0)
    d.advance_to(0.0)
    in_flight = d.pending
    assert in_flight is not None
    d.add(SimRequest("b", 16, 10), now=in_flight.end / 2)
    (step,) = d.advance_to(in_flight.end)
    assert step.emitted == ["a"]
    nxt = d.advance_to(d.next_event_time())  # type: ignore[arg-type]
    assert nxt[0].start == pytest.approx(in_flight.end) and set(nxt[0].emitted) == {"a", "b"}


def test_driver_matches_the_direct_step_loop() -> None:
    """Same model, same workload: stepping by hand and advancing by time give the same schedule."""
    direct = run_closed_loop(build_engine("L4", "llama3-8b"), 1, 300, 50, 1)
    d = EngineDriver(build_engine("L4", "llama3-8b"))
    d.add(SimRequest("r0", 300, 50), 0.0)
    finished = []
    while (t := d.next_event_time()) is not None:
        for res in d.advance_to(t):
            finished += res.finished
    assert finished[0].finish_time == pytest.approx(direct.finished[0].finish_time)


def test_kv_pressure_raised_mid_run_fails_what_no_longer_fits_and_drains() -> None:
    engine = build_engine("A100-40GB", "llama3-8b")
    d = EngineDriver(engine)
    d.add(SimRequest("long", 1024, 7000), now=0.0)  # fits 8792 blocks, not the 88 left at 0.99
    d.add(SimRequest("short", 64, 16), now=0.0)
    d.advance_to(0.0)
    engine.set_kv_pressure(0.99)
    failed, finished = [], []
    for _ in range(10_000):  # bounded: a wedged driver fails here instead of hanging
        t = d.next_event_time()
        if t is None:
            break
        for res in d.advance_to(t):
            failed += [s.request_id for s in res.failed]
            finished += [s.request_id for s in res.finished]
    assert d.next_event_time() is None
    assert failed == ["long"] and finished == ["short"]
