"""The simulated Redis sync: own counts exact, others' as of the last sync, tokens shared or not."""

from __future__ import annotations

from extproc.fleetsim.shared import SimSharedState, SyncHub
from extproc.pool.pod import Pod

POD = Pod("m", "p0", "10.0.0.1:8000")


def pair(share_tokens: bool = True) -> tuple[SimSharedState, SimSharedState]:
    hub = SyncHub(share_tokens)
    a, b = SimSharedState(hub, "a"), SimSharedState(hub, "b")
    for s in (a, b):
        s.track([POD])
    return a, b


def test_running_counts_reach_the_other_gateway_at_its_next_sync():
    a, b = pair()
    a.sync(0.0)
    b.sync(0.05)
    a.add_running(POD, 3)
    assert a.running(POD.key) == 3 and b.running(POD.key) == 0  # not synced yet
    b.sync(0.1)
    assert b.running(POD.key) == 0  # a has not published yet
    a.sync(0.15)
    b.sync(0.2)
    assert b.running(POD.key) == 3 and b.local_running(POD.key) == 0
    b.add_running(POD, 1)
    assert b.running(POD.key) == 4  # own share at once


def test_tokens_are_shared_once_each():
    a, b = pair()
    for s, t in ((a, 0.0), (b, 0.0)):
        s.sync(t)
    a.add_tokens(POD, 100)
    b.add_tokens(POD, 10)
    a.sync(0.1)
    b.sync(0.1)
    a.sync(0.2)
    # Token totals are read once a heartbeat (1 s), running counts every sync.
    assert not a.take_token_deltas() and not b.take_token_deltas()
    # ... and written once a heartbeat: a gateway whose heartbeat read comes before the other's write
    # gets them with its next one.
    got_a = got_b = 0
    for t in (1.0, 2.0):
        a.sync(t)
        b.sync(t)
        got_a += sum(a.take_token_deltas().values())
        got_b += sum(b.take_token_deltas().values())
    assert got_a == 110 and got_b == 110
    for t in (2.1, 3.0, 4.0):
        a.sync(t)
        b.sync(t)
    assert not a.take_token_deltas() and not b.take_token_deltas()


def test_without_token_sharing_each_gateway_sees_only_its_own_tokens():
    a, b = pair(share_tokens=False)
    for s in (a, b):
        s.sync(0.0)
    a.add_tokens(POD, 100)
    b.add_tokens(POD, 10)
    a.add_running(POD, 2)
    for t in (0.1, 1.0):
        a.sync(t)
        b.sync(t)
    assert sum(a.take_token_deltas().values()) == 100
    assert sum(b.take_token_deltas().values()) == 10
    assert b.running(POD.key) == 2  # running counts are still shared
