"""WorkerState: counts shared by the workers of one `serve --workers N` through shared memory."""

from __future__ import annotations

import os

import pytest

from extproc.pool.pod import Pod
from extproc.sharing.workers import WorkerState, create_segment
from extproc.state.accounting import Accounting

A = Pod("m", "a", "10.0.0.1:8000")
B = Pod("m", "b", "10.0.0.2:8000")


@pytest.fixture
def pair():
    fd = create_segment(2, slots=8, ring=16, inbox=4)
    one, two = WorkerState(fd, 0), WorkerState(fd, 1)
    one.listen("1.aa")
    two.listen("2.bb")
    yield one, two
    os.close(fd)


def test_each_worker_reads_the_sum_of_every_workers_count_at_once(pair):
    one, two = pair
    one.add_running(A, 1)
    one.add_running(A, 1)
    two.add_running(A, 1)
    two.track([B])
    assert one.running(A.key) == two.running(A.key) == 3
    assert (one.local_running(A.key), two.local_running(A.key)) == (2, 1)
    assert two.running(B.key) == 0
    one.add_running(A, -1)
    assert two.running(A.key) == 2


def test_peer_changes_hand_over_the_other_workers_changes_once(pair):
    one, two = pair
    two.track([A, B])
    one.add_running(A, 1)
    one.add_running(B, 1)
    one.add_running(A, -1)
    assert two.peer_changes() == [(A.key, 1), (B.key, 1), (A.key, -1)]
    assert two.peer_changes() == []
    assert one.peer_changes() == []  # its own changes are not news to it


def test_a_reader_lapped_by_the_ring_skips_to_now_and_the_sums_still_hold(pair):
    one, two = pair
    two.track([A])
    for _ in range(40):  # the ring holds 16
        one.add_running(A, 1)
    assert len(two.peer_changes()) == 16
    assert two.running(A.key) == 40


def test_tokens_are_handed_out_once_each_whichever_worker_counted_them(pair):
    one, two = pair
    two.track([A])
    one.add_tokens(A, 100)
    two.add_tokens(A, 30)
    assert one.take_token_deltas() == {A.key: 130}
    assert two.take_token_deltas() == {A.key: 130}
    assert one.take_token_deltas() == {}
    one.add_tokens(A, 5)
    assert two.take_token_deltas() == {A.key: 5}


def test_a_restarted_worker_starts_from_zero_without_negative_tokens(pair):
    one, two = pair
    one.track([A])
    two.add_tokens(A, 50)
    assert one.take_token_deltas() == {A.key: 50}
    fd = one._fd
    again = WorkerState(fd, 1)  # worker 1 replaced
    again.add_tokens(A, 7)
    assert one.take_token_deltas() == {A.key: 7}
    assert one.running(A.key) == 0


def test_records_reach_their_owner_and_nobody_else(pair):
    one, two = pair
    assert one.forward("2.bb", "2.bb.1f", 200)
    assert one.forward("2.bb", "2.bb.20", 503)
    assert not one.forward("9.zz", "9.zz.1", 200)  # no such worker (replaced)
    assert one.take_forwarded() == []
    assert two.take_forwarded() == [("2.bb.1f", 200), ("2.bb.20", 503)]
    assert two.take_forwarded() == []


def test_a_full_inbox_refuses_instead_of_overwriting(pair):
    one, two = pair
    assert all(one.forward("2.bb", f"2.bb.{n:x}", 200) for n in range(4))
    assert not one.forward("2.bb", "2.bb.ff", 200)
    assert [k for k, _ in two.take_forwarded()] == [f"2.bb.{n:x}" for n in range(4)]
    assert one.forward("2.bb", "2.bb.ff", 200)


def test_slots_of_pods_no_worker_knows_are_reused(pair):
    one, two = pair
    pods = [Pod("m", f"p{i}", f"10.1.0.{i}:8000") for i in range(8)]
    one.track(pods)
    full = Pod("m", "full", "10.3.0.1:8000")
    one.add_running(full, 1)  # no slot free: counted by this worker alone, routing goes on
    assert one.running(full.key) == 1 and two.running(full.key) == 0
    one.add_running(pods[0], 1)
    one.forget([p.key for p in pods[2:]])  # p0 still has a request in flight: kept
    newcomer = Pod("m", "new", "10.2.0.1:8000")
    two.track([newcomer])
    assert two.running(newcomer.key) == 0
    assert one.running(pods[0].key) == 1


def test_routing_views_follow_the_other_workers_choices_between_resyncs(pair):
    one, two = pair
    acc = Accounting(two)
    pods = [A, B]
    two.track(pods)
    views = acc.view_cache.routable("m", pods, now=0.0)
    assert [v.running for v in views] == [0, 0]
    one.add_running(A, 1)
    one.add_running(A, 1)
    views = acc.view_cache.routable("m", pods, now=0.001)  # well within the 50 ms resync
    assert [v.running for v in views] == [2, 0]


def test_a_pod_forgotten_and_seen_again_does_not_count_its_old_tokens_twice(pair):
    one, two = pair
    one.track([A])
    two.add_tokens(A, 40)
    assert one.take_token_deltas() == {A.key: 40}
    one.forget([])
    one.track([A])  # back, in the same slot (worker 1 still knows it)
    assert one.take_token_deltas() == {}
    two.add_tokens(A, 2)
    assert one.take_token_deltas() == {A.key: 2}
