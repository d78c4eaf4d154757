"""The in-process budgets stay bounded however many subjects clients invent."""

from __future__ import annotations

import pytest

from extproc.ratelimit.local_store import LocalStore
from extproc.ratelimit.settings import Limits


def test_idle_full_budgets_go_first_then_the_least_recently_used():
    store = LocalStore(max_buckets=3)
    limits = Limits(requests=10)
    store.take("m:old", limits, 0, now=0.0)
    store.take("m:a", limits, 0, now=100.0)
    store.take("m:b", limits, 0, now=100.0)
    store.take("m:c", limits, 0, now=101.0)  # over the cap: m:old idle a full minute, dropped
    assert set(store._buckets) == {"m:a", "m:b", "m:c"}
    store.take("m:a", limits, 0, now=102.0)  # used again: the most recent
    store.take("m:d", limits, 0, now=102.0)  # none idle: the least recently used (m:b) goes
    assert set(store._buckets) == {"m:a", "m:c", "m:d"} and len(store) == 3
    # its budget kept: 10 - 3 taken, plus 2 s of refill since the first
    assert store.take("m:a", limits, 0, now=102.0).requests == pytest.approx(7 + 2 * 10 / 60)
