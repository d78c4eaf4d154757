"""The budgets `serve --workers N` shares without Redis: one budget across processes, exact under a race,
bounded however many subjects appear."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from extproc.ratelimit.settings import Limits
from extproc.ratelimit.worker_store import WAYS, WorkerBudgets, create_budgets

LIMITS = Limits(requests=100, tokens=10_000)


def _race(fd: int, tries: int, now: float, out) -> None:
    store = WorkerBudgets(fd)
    out.put(sum(store.take("m:key:race", LIMITS, 1, now).admitted for _ in range(tries)))


def test_processes_racing_for_one_budget_admit_exactly_what_it_holds():
    fd = create_budgets(sets=16)
    try:
        ctx = multiprocessing.get_context("fork")  # the workers inherit the segment, as serve's do
        out = ctx.Queue()
        procs = [ctx.Process(target=_race, args=(fd, 80, 0.0, out)) for _ in range(3)]
        for p in procs:
            p.start()
        admitted = [out.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        assert sum(admitted) == LIMITS.requests  # 240 tries, at a fixed instant: no refill
    finally:
        os.close(fd)


def test_a_worker_sees_what_another_took_and_charged():
    fd = create_budgets(sets=16)
    a, b = WorkerBudgets(fd), WorkerBudgets(fd)
    try:
        assert a.take("m:key:x", LIMITS, 300, now=10.0).requests == 99
        b.charge("m:key:x", LIMITS.tokens, 1_200, now=10.0)
        v = b.take("m:key:x", LIMITS, 0, now=16.0)  # 6 s: 10 requests and 1,000 tokens back
        assert v.requests == pytest.approx(100.0 - 1) and v.tokens == pytest.approx(10_000 - 1_500 + 1_000)
        assert a.take("m:key:y", LIMITS, 0, now=16.0).requests == 99  # another budget, its own
        assert len(a) == 2
    finally:
        a.close()
        b.close()
        os.close(fd)


def test_a_full_set_drops_an_idle_budget_first_then_the_least_recently_used():
    fd = create_budgets(sets=1)
    store = WorkerBudgets(fd)
    limits = Limits(requests=10)
    try:
        store.take("m:old", limits, 0, now=0.0)
        for i in range(WAYS - 1):  # each takes one at 100.0, 100.001, ...: 9 left, no time to refill
            store.take(f"m:{i}", limits, 0, now=100.0 + i / 1000)
        store.take("m:new", limits, 0, now=100.01)  # the set is full: m:old, idle a minute, dropped
        assert len(store) == WAYS
        assert store.take("m:old", limits, 0, now=100.01).requests == 9  # new again (it was full)
        # none was idle: the least recently used (m:0) gave m:old its place; the others kept theirs
        assert store.take("m:1", limits, 0, now=100.011).requests == pytest.approx(8, abs=0.01)
        assert store.take("m:0", limits, 0, now=100.012).requests == 9  # dropped: it came back full
    finally:
        store.close()
        os.close(fd)
