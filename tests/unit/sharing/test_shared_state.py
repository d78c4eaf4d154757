"""Shared state without a network: LocalState, the pure sync core (batching, liveness, overlay,
token deltas across outages) and the Redis URL rules."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry

from extproc.config import parse
from extproc.environment import redis_url_from_env
from extproc.fleetsim.shared import SimSharedState, SyncHub
from extproc.pool.pod import Pod
from extproc.redact import redact_url
from extproc.sharing import speed_sums
from extproc.sharing.redis_sync import RedisState
from extproc.sharing.shared import LocalCounts, LocalState
from extproc.sharing.sync_core import SharedSnapshot, SyncCore

POD = Pod("llama", "pod-a", "10.0.0.1:8000", namespace="team")
OTHER = Pod("llama", "pod-b", "10.0.0.2:8000", namespace="team")
ME = "gw-me:1"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def core(**kw) -> SyncCore:
    counts = LocalCounts()
    counts.track([POD, OTHER])
    return SyncCore(ME, counts, **kw)


def snap(now: float, gateways: dict[str, float], running: dict | None = None, tokens: dict | None = None,
         aibrix: dict | None = None, members: dict | None = None) -> SharedSnapshot:
    return SharedSnapshot(server_now=now, gateways=gateways, running=running or {}, tokens=tokens or {},
                          aibrix=aibrix or {}, members=members)


# -- LocalState ------------------------------------------------------------------------------------

def test_local_state_counts_balance_and_clamp_at_zero():
    s = LocalState()
    s.add_running(POD, 1)
    s.add_running(POD, 1)
    s.add_running(POD, -1)
    assert s.running(POD.key) == s.local_running(POD.key) == 1
    s.add_running(POD, -1)
    s.add_running(POD, -1)  # a stray decrement: clamped, so the next request still counts
    s.add_running(POD, 1)
    assert s.running(POD.key) == 1
    assert s.running(OTHER.key) == 0
    assert s.up is False


def test_local_state_token_deltas_count_each_token_once():
    s = LocalState()
    s.add_tokens(POD, 10)
    s.add_tokens(POD, 5)
    s.add_tokens(OTHER, 0)
    assert s.take_token_deltas() == {POD.key: 15}
    assert s.take_token_deltas() == {}
    s.add_tokens(POD, 3)
    assert s.take_token_deltas() == {POD.key: 3}


def test_forget_keeps_pods_with_requests_in_flight():
    s = LocalState()
    s.add_running(POD, 1)
    s.add_tokens(OTHER, 4)
    s.forget([])
    assert s.running(POD.key) == 1            # still in flight: kept
    assert s.take_token_deltas() == {}         # OTHER dropped with its counts
    s.add_running(POD, -1)
    s.forget([])
    assert POD.key not in s.counts.pods


# -- batching --------------------------------------------------------------------------------------

def test_only_net_changes_are_sent_between_heartbeats():
    c = core(heartbeat_interval=1.0, aibrix_snapshots=False)  # AIBrix rows: their own test
    c.counts.add_running(POD, 1)
    c.counts.add_running(POD, 1)
    c.counts.add_running(POD, -1)
    first = c.plan(0.0)
    assert first.heartbeat and first.running == {POD.key: 1}
    c.confirm(first, 0.0)
    c.counts.add_running(POD, 1)
    c.counts.add_running(POD, -1)  # net zero since the last write: nothing to send
    quiet = c.plan(0.1)
    assert quiet.running == {} and not quiet.heartbeat and not quiet
    c.counts.add_running(OTHER, 2)
    c.counts.add_tokens(OTHER, 40)
    b = c.plan(0.2)
    assert b.running == {OTHER.key: 2} and b.tokens == {}  # tokens go with the heartbeat (read then)
    assert b.heartbeat  # any batch writing fields carries the heartbeat, so readers see us alive
    c.confirm(b, 0.2)
    beat = c.plan(1.3)  # heartbeat: the tokens; nothing resent (the ledger holds it)
    assert beat.heartbeat and beat.due and beat.read_tokens and beat.running == {}
    assert beat.tokens == {OTHER.key: 40}
    c.confirm(beat, 1.3)
    assert c.plan(2.4).tokens == {}  # unchanged since: not sent again
    c.lost_ledger()  # Redis answered that our ledger was gone: every own value again
    full = c.plan(1.4)
    assert full.reassert and full.running == {POD.key: 1, OTHER.key: 2} and full.tokens == {OTHER.key: 40}


def test_unconfirmed_batch_is_sent_again_after_a_failure():
    c = core()
    c.counts.add_running(POD, 3)
    b = c.plan(0.0)
    c.failed()  # reply lost: maybe applied, maybe not; absolute values make resending harmless
    again = c.plan(0.05)
    assert again.running == {POD.key: 3}
    c.confirm(again, 0.05)
    c.counts.add_running(POD, -3)
    assert c.plan(0.1).running == {POD.key: 0}  # back to idle is written too
    assert b.running == {POD.key: 3}


def test_aibrix_rows_are_rewritten_before_they_expire_and_deleted_once_idle():
    c = core(aibrix_snapshots=True)
    c.counts.add_running(POD, 2)
    b = c.plan(0.0)
    assert b.aibrix == {POD.key: 2}
    c.confirm(b, 0.0)
    assert c.plan(0.1).aibrix == {}  # unchanged and far from its 500 ms expiry
    b = c.plan(0.3)
    assert b.aibrix == {POD.key: 2}  # unchanged, but would expire before long
    c.confirm(b, 0.3)
    c.counts.add_running(POD, 1)
    b = c.plan(0.4)
    assert b.aibrix == {POD.key: 3}  # changed
    c.confirm(b, 0.4)
    c.counts.add_running(POD, -3)
    b = c.plan(0.5)
    assert b.aibrix == {POD.key: 0}
    c.confirm(b, 0.5)
    assert c.plan(0.6).aibrix == {}
    c2 = core()  # off by default
    c2.counts.add_running(POD, 1)
    assert c2.plan(0.0).aibrix == {}


# -- snapshot: liveness and overlay ----------------------------------------------------------------

def test_running_is_the_total_less_own_share_plus_own_count():
    c = core(gateway_ttl=3.0)
    c.counts.add_running(POD, 2)
    c.confirm(c.plan(4999.9), 4999.9)  # our 2 written: the total holds them
    now = 5000.0
    c.apply(snap(now, {"gw-live:1": now - 1.0, ME: now}, running={POD.key: 2 + 4}))
    assert c.up
    assert c.running(POD.key) == 2 + 4 and c.running(OTHER.key) == 0
    c.counts.add_running(POD, 1)          # own changes show at once, before any sync
    assert c.running(POD.key) == 7
    c.failed()
    assert c.running(POD.key) == 3        # Redis gone: the local view


def test_aibrix_gateways_are_added_and_a_total_below_own_share_counts_nothing():
    c = core()
    c.counts.add_running(POD, 5)
    c.confirm(c.plan(9.9), 9.9)
    now = 10.0
    c.apply(snap(now, {"gw-x:1": now}, running={POD.key: 3}, aibrix={"team/pod-a": 3, "team/pod-b": 1}))
    assert c.running(POD.key) == 5 + 3    # total 3 < own 5 (we were reaped): no negative others
    assert c.running(OTHER.key) == 1


def test_silent_gateways_are_reaped_once_per_model_and_again_after_they_return():
    c = core(gateway_ttl=3.0)
    now = 10.0
    members = {"llama": {"gw-x:1", "gw-y:1", "gw-gone:1", ME}, "other": {"gw-y:1"}}
    # gw-gone:1 left the heartbeat set (past the retention) without being reaped: reaped all the same
    c.apply(snap(now, {"gw-x:1": now - 100, "gw-y:1": now, ME: now}, members=members))
    b = c.plan(now)
    assert b.reap == [("llama", "gw-gone:1"), ("llama", "gw-x:1")]
    c.confirm(b, now)
    c.apply(snap(now + 0.1, {"gw-x:1": now - 100, "gw-y:1": now, ME: now}))  # members as last read
    assert c.plan(now + 0.1).reap == []   # once
    c.apply(snap(now + 0.2, {"gw-x:1": now + 0.2, "gw-y:1": now, ME: now}, members=members))  # back
    c.apply(snap(now + 9, {"gw-x:1": now + 0.2, "gw-y:1": now + 9, ME: now}))  # silent again
    assert ("llama", "gw-x:1") in c.plan(now + 9).reap
    c.failed()  # Redis may come back from a snapshot holding their shares again
    c.apply(snap(now + 10, {"gw-x:1": now - 100, "gw-y:1": now + 10, ME: now}, members=members))
    assert c.plan(now + 10).reap == [("llama", "gw-gone:1"), ("llama", "gw-x:1")]


# -- token deltas ----------------------------------------------------------------------------------

def test_shared_token_deltas_baseline_then_deltas():
    c = core()
    t = 100.0
    c.apply(snap(t, {}, tokens={POD.key: 500}))
    assert c.take_token_deltas() == {}  # first read: baseline, not the pod's whole history
    c.apply(snap(t, {}, tokens={POD.key: 530}))
    c.apply(snap(t, {}, tokens={POD.key: 567}))
    assert c.take_token_deltas() == {POD.key: 67}
    c.apply(snap(t, {}, tokens={}))  # Redis restarted empty
    c.apply(snap(t, {}, tokens={POD.key: 567}))  # the gateways wrote their cumulative values again
    assert c.take_token_deltas() == {}
    c.apply(snap(t, {}, tokens={POD.key: 577}))
    assert c.take_token_deltas() == {POD.key: 10}


def test_own_tokens_counted_once_across_an_outage():
    c = core()
    c.counts.add_tokens(POD, 100)
    c.confirm(c.plan(0.9), 0.9)
    c.apply(snap(1.0, {}, tokens={POD.key: 100}))
    assert c.take_token_deltas() == {POD.key: 100}
    c.counts.add_tokens(POD, 20)            # pushed, read back with the next heartbeat ...
    beat = c.plan(1.95)
    assert beat.tokens == {POD.key: 120}   # own tokens go out in the turn that reads the totals
    c.confirm(beat, 1.95)
    c.apply(snap(2.0, {}, tokens={POD.key: 120}))
    c.failed()                              # ... then Redis goes away
    c.counts.add_tokens(POD, 5)
    assert c.take_token_deltas() == {POD.key: 20 + 5}  # pending shared + own local, no overlap
    c.counts.add_tokens(POD, 1)
    assert c.take_token_deltas() == {POD.key: 1}
    # Back: our ledger catches up to 126 and gw-b did 40 meanwhile; nothing twice.
    c.confirm(c.plan(4.9), 4.9)
    c.apply(snap(5.0, {}, tokens={POD.key: 126 + 40}))
    assert c.take_token_deltas() == {POD.key: 40}


def test_own_tokens_before_the_first_snapshot_are_not_lost():
    c = core()
    c.counts.add_tokens(POD, 9)
    c.confirm(c.plan(0.9), 0.9)
    c.apply(snap(1.0, {}, tokens={POD.key: 9}))
    assert c.take_token_deltas() == {POD.key: 9}


# -- RedisState without a network ------------------------------------------------------------------

def test_redis_state_works_locally_before_any_sync():
    registry = CollectorRegistry()
    # POD_NAME names the instance, as `serve` passes it from the config (Config.redis_instance)
    config = parse({"models": {"m": {}}}, {"POD_NAME": "gateway-7", "REDIS_HOST": "127.0.0.1",
                                          "REDIS_PORT": "1"})
    s = RedisState(config.redis_url, config.redis_instance, registry=registry, clock=FakeClock())
    assert re.fullmatch(r"gateway-7:\d{19}", s.field)
    s.track([POD])
    s.add_running(POD, 1)
    s.add_tokens(POD, 12)
    assert (s.up, s.running(POD.key), s.local_running(POD.key)) == (False, 1, 1)
    assert s.take_token_deltas() == {POD.key: 12}
    assert registry.get_sample_value("extproc_redis_up") == 0


def test_two_states_in_one_process_get_distinct_fields():
    assert RedisState("redis://x", "gw").field != RedisState("redis://x", "gw").field


# -- where Redis is ----------------------------------------------------------------------------------

@pytest.mark.parametrize("env, configured, expected", [
    ({}, None, None),
    ({"EXTPROC_REDIS_URL": "redis://a:1/2"}, "redis://b:1/0", "redis://a:1/2"),
    ({}, "rediss://b:6380/0", "rediss://b:6380/0"),
    ({"REDIS_HOST": "redis.aibrix-system"}, None, "redis://redis.aibrix-system:6379/0"),
    ({"REDIS_HOST": "r", "REDIS_PORT": "7000", "REDIS_PASSWORD": "p@ss:w/rd"}, None,
     "redis://:p%40ss%3Aw%2Frd@r:7000/0"),
    ({"REDIS_HOST": "::1"}, None, "redis://[::1]:6379/0"),
    ({"REDIS_PASSWORD": "s3"}, "rediss://user@h:1/0", "rediss://user:s3@h:1/0"),
    ({"REDIS_PASSWORD": "other"}, "redis://:mine@h:1/0", "redis://:mine@h:1/0"),
    ({"EXTPROC_REDIS_URL": "  ", "REDIS_HOST": "h"}, None, "redis://h:6379/0"),
])
def test_redis_url_from_env(env, configured, expected):
    assert redis_url_from_env(env, configured) == expected


def test_redact_url_hides_only_the_password():
    assert redact_url("rediss://user:s3cret@h:1/0") == "rediss://user:***@h:1/0"
    assert redact_url("redis://:s3cret@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_routing_echoes_own_starts_per_peer_until_the_next_snapshot():
    """Between syncs each start here stands for one at every live peer (they see the same counts and
    choose alike); the echo is routing's alone, and a snapshot replaces it with the peers' real counts."""
    pod = Pod("m", "p", "10.0.0.1:8000")
    hub = SyncHub()
    gws = [SimSharedState(hub, f"gw-{i}") for i in range(3)]
    for g in gws:
        g.track([pod])
    for g in gws:
        g.sync(0.0)
    for g in gws:
        g.sync(0.1)  # every gateway now sees two live peers
    a, b = gws[0], gws[1]
    assert a.peers == 2
    a.add_running(pod, 1)
    a.add_running(pod, 1)
    assert a.running(pod.key) == 2  # what /metrics shows: the truth as known
    assert a.routing_running(pod.key) == 2 + 2 * 2  # what routing counts until the next snapshot
    b.add_running(pod, 1)
    for g in (a, b):
        g.sync(0.2)
    a.sync(0.3)
    assert a.routing_running(pod.key) == a.running(pod.key) == 3
    local = LocalState()  # nothing to echo in one process: routing counts what runs
    local.add_running(pod, 1)
    assert local.routing_running(pod.key) == local.running(pod.key) == 1 and local.peers == 0


def test_after_an_outage_every_own_field_is_written_again_zeros_included():
    # Redis may come back from an older RDB snapshot holding our count from then: a pod now idle
    # would keep its stale count there unless the zero is written again.
    c = core(aibrix_snapshots=False)
    c.counts.add_running(POD, 5)
    c.confirm(c.plan(0.0), 0.0)
    c.counts.add_running(POD, -5)
    c.confirm(c.plan(0.1), 0.1)  # 0 written
    assert c.plan(0.2).running == {}  # nothing changed: nothing to send
    c.failed()
    assert c.plan(0.3).running == {POD.key: 0}
    c.confirm(c.plan(0.3), 0.3)
    assert c.plan(0.4).running == {}  # once


def test_a_record_for_another_gateway_is_forwarded_until_sent():
    c = core(aibrix_snapshots=False)
    c.forward("owner-1", "owner-1.a", 200)
    c.forward("owner-1", "owner-1.b", 0)
    batch = c.plan(0.0)
    assert batch.forwards == {"owner-1": ["owner-1.a 200", "owner-1.b 0"]}
    c.unsent(batch)  # the pipeline failed: sent again with the next batch
    again = c.plan(0.1)
    assert again.forwards == batch.forwards
    c.confirm(again, 0.1)
    assert c.plan(0.2).forwards == {}


def test_forwarded_records_are_received_once():
    c = core()
    c.receive(["me.1 200", "me.2 503", "garbage"])
    assert c.take_forwarded() == [("me.1", 200), ("me.2", 503), ("garbage", 0)]
    assert c.take_forwarded() == []


def test_the_outbox_is_bounded_while_redis_is_away():
    from extproc.sharing.sync_core import MAX_FORWARDS
    c = core()
    for i in range(MAX_FORWARDS + 10):
        c.forward("o", f"o.{i}", 200)
    assert sum(len(v) for v in c.plan(0.0).forwards.values()) == MAX_FORWARDS


def test_retries_while_redis_is_down_are_at_most_about_a_second_apart():
    from extproc.sharing.redis_sync import retry_pause
    pauses = [retry_pause(n, 0.1, 1.2) for n in range(1, 12)]
    assert pauses == sorted(pauses) and pauses[0] < 0.5
    assert max(pauses) <= 1.2  # Redis back: each gateway tries again within this, converging within 2 s


def evidence(t: float, n: float = 4.0) -> list[float]:
    """An `export` vector: measured, then four groups (t, w, x, y, xx, xy, yy, n)."""
    return [t, *(v for _ in range(4) for v in (t, 100.0, 800.0, 2.0, 9000.0, 20.0, 0.05, n))]


def test_speed_share_is_sent_when_records_arrive_in_its_turn_and_the_others_are_the_sums_less_it():
    from extproc.sharing.sync_core import SPEED_READ_HEARTBEATS, SPEED_WRITE_HEARTBEATS
    c = core(heartbeat_interval=1.0)
    c.speed_out[POD.key] = evidence(10.0)
    first = c.plan(10.0)
    assert first.read_speed and speed_sums.decode(first.speed[POD.key]) == evidence(10.0)
    c.confirm(first, 10.0)
    assert not c.plan(10.1).read_speed and not c.plan(10.1).speed  # between heartbeats: counts only
    sent, read = [], []
    for beat in range(1, 2 * SPEED_WRITE_HEARTBEATS + 1):
        now = 10.0 + beat
        c.speed_out[POD.key] = evidence(now, n=4.0 + beat)  # a record every heartbeat
        batch = c.plan(now)
        sent.append(POD.key in batch.speed)
        read.append(batch.read_speed)
        c.confirm(batch, now)
    assert sum(sent) == 2  # at most once in SPEED_WRITE_HEARTBEATS heartbeats
    assert sum(read) == 2 * SPEED_WRITE_HEARTBEATS // SPEED_READ_HEARTBEATS  # the others', every other beat
    c.speed_out[POD.key] = evidence(40.0, n=0.0)  # only decayed since: nothing new to say
    assert not any(POD.key in c.plan(30.0 + b).speed for b in range(SPEED_WRITE_HEARTBEATS))
    own = c._written_speed[POD.key]
    theirs = evidence(own[1], n=3.0)
    total = speed_sums.move(None, None, own)
    total = speed_sums.move(total, None, theirs)
    c.apply(SharedSnapshot(server_now=50.0, gateways={ME: 50.0}, running={}, tokens={},
                     speed={POD.key: speed_sums.encode(total), OTHER.key: b"garbage"}))
    (got,) = c.peer_speed[POD.key]
    assert got == pytest.approx(theirs) and OTHER.key not in c.peer_speed
    beat = c.plan(55.0)
    c.confirm(beat, 55.0)
    assert beat.read_speed != c.plan(56.0).read_speed  # every other heartbeat ...
    c.failed()
    assert c.peer_speed == {}  # Redis gone: each gateway on its own records
    assert c.plan(60.0).read_speed and c.plan(61.0).read_speed  # ... but at once after an outage
    assert POD.key in c.plan(60.0).speed  # ... and its share written again once it is back


def test_a_forgotten_pods_share_is_withdrawn_and_a_lost_ledger_keeps_what_the_batch_wrote():
    c = core(heartbeat_interval=1.0)
    c.speed_out[POD.key] = evidence(10.0)
    c.speed_out[OTHER.key] = evidence(10.0)
    batch = c.plan(10.0)
    c.confirm(batch, 10.0)
    c.lost_ledger(batch)  # made afresh in the same pipeline: this batch's shares are in the sums
    assert set(c._written_speed) == {POD.key, OTHER.key}
    c.forget([POD.key])
    batch = c.plan(11.0)
    assert batch.speed[OTHER.key] == b"" and batch.speed_sent[OTHER.key] is None
    assert c.pod(OTHER.key) == OTHER
    c.confirm(batch, 11.0)
    assert OTHER.key not in c._written_speed and OTHER.key not in c.plan(12.0).speed


def test_speed_sums_add_and_remove_shares_decayed_to_a_common_time():
    a, b = evidence(100.0), evidence(105.0, n=2.0)
    total = speed_sums.move(speed_sums.move(None, None, a), None, b)
    assert total is not None and total[0] == 105.0 and total[1] == 105.0
    base_f, shape_f = math.exp(-5.0 / 5.0), math.exp(-5.0 / 120.0)
    assert total[2] == pytest.approx(100.0 * base_f + 100.0)  # w of the base group, a decayed 5 s
    assert total[9 + 1] == pytest.approx(100.0 * shape_f + 100.0)  # w of the slope group
    theirs = speed_sums.others(total, b)  # a, as of 105 s
    assert theirs is not None and theirs[2] == pytest.approx(100.0 * base_f)
    assert theirs[8] == pytest.approx(4.0 * base_f) and theirs[10] == pytest.approx(100.0 * shape_f)
    left = speed_sums.others(total, a)
    assert left is not None and left[2] == pytest.approx(100.0) and left[8] == pytest.approx(2.0)
    assert speed_sums.move(total, a, None) == pytest.approx(left)
    assert speed_sums.move(speed_sums.move(None, None, a), a, None) is None  # nothing left: no field
    assert speed_sums.decode(speed_sums.encode(total)) == total
    assert speed_sums.decode(b"1,2") is None and speed_sums.decode("x") is None
    assert speed_sums.decode(speed_sums.encode([math.nan] * len(total))) is None
    assert speed_sums.shifted(a, 7.0)[:2] == [107.0, 107.0] and speed_sums.shifted(a, 7.0)[2] == 100.0
    assert speed_sums.new_records(evidence(110.0, n=4.0 * math.exp(-10 / 5.0)), a) is False
    assert speed_sums.new_records(evidence(110.0, n=1.0 + 4.0 * math.exp(-10 / 5.0)), a) is True


def test_workers_share_speed_evidence_through_the_segment():
    from extproc.sharing.speed_sums import SPEED_VALUES
    from extproc.sharing.workers import WorkerState, create_segment
    fd = create_segment(2, slots=8, ring=16, inbox=8)
    one, two = WorkerState(fd, 0), WorkerState(fd, 1)
    one.track([POD])
    two.track([POD])
    assert two.peer_speed() == {}
    evidence = [float(i) for i in range(SPEED_VALUES)]
    one.share_speed(POD.key, evidence)
    assert two.peer_speed() == {POD.key: [evidence]} and one.peer_speed() == {}
    WorkerState(fd, 0)  # worker 0 restarted: its predecessor's evidence is gone with it
    assert two.peer_speed() == {}


def test_the_others_of_many_pods_at_once_are_each_pods_own():
    a, b = evidence(100.0), evidence(104.0, n=2.0)
    both = speed_sums.move(speed_sums.move(None, None, a), None, b)
    totals = [speed_sums.encode(both), speed_sums.encode(a), b"short", speed_sums.encode(a)]
    owns = [speed_sums.encode(b), speed_sums.encode(a), None, None]
    got = speed_sums.others_many([totals[0].decode("utf-8", "surrogateescape"), *totals[1:]], owns)
    assert got[0] == pytest.approx(speed_sums.others(both, b))
    assert got[1] is None and got[2] is None  # nothing left; not a vector
    assert got[3] == pytest.approx(a)


def test_a_gateway_hands_over_a_pods_speed_evidence_only_when_it_moved_and_folds_a_read_in_once():
    from extproc.state.accounting import Accounting

    class Counting(LocalState):
        __slots__ = ("shared", "peers")

        def __init__(self) -> None:
            super().__init__()
            self.shared: list = []
            self.peers: dict = {}

        def share_speed(self, key, evidence) -> None:  # noqa: ANN001
            self.shared.append(key)

        def peer_speed(self) -> dict:
            return self.peers

    state = Counting()
    accounting = Accounting(state, wall=lambda: 0.0)
    pods = [Pod("m", f"p{i}", f"10.0.0.{i}:8000") for i in range(3)]
    accounting._tracked = pods
    for pod in pods[:2]:
        accounting.speed.observe(pod.key, 0.02, 4.0, 100, 0.0)
    accounting._share_speed(1.0)
    assert state.shared == [pods[0].key, pods[1].key]  # the third has no evidence
    accounting._share_speed(2.0)
    assert len(state.shared) == 2  # nothing moved: the state already holds it
    accounting.speed.observe(pods[1].key, 0.02, 4.0, 100, 2.5)
    accounting._share_speed(3.0)
    assert state.shared[2:] == [pods[1].key]
    other = accounting.speed.export(pods[0].key)
    state.peers = {pods[0].key: [other]}
    accounting._share_speed(4.0)
    folded = accounting.speed._peers[pods[0].key]
    accounting._share_speed(5.0)  # the same read: the estimator keeps what it folded (and its merge)
    assert accounting.speed._peers[pods[0].key] is folded
    state.peers = {pods[0].key: [list(other)]}  # a new read
    accounting._share_speed(6.0)
    assert accounting.speed._peers[pods[0].key] is not folded


def test_the_others_counts_from_packed_totals_are_those_the_dict_gives():
    """RedisState hands the totals as arrays aligned with the packed slots; the core works the others'
    counts out on arrays and touches only the dict: turn after turn (own writes moving, a model not
    read, the slots bound anew, AIBrix rows), every pod reads as from the totals as a dict."""
    import numpy as np

    pods = [Pod(("llama", "qwen")[i % 2], f"p{i}", f"10.0.0.{i}:8000") for i in range(8)]

    def fresh() -> SyncCore:
        counts = LocalCounts()
        counts.track(pods)
        return SyncCore(ME, counts)

    packed_core, dict_core = fresh(), fresh()
    rng = np.random.default_rng(3)
    keys = {m: [p.key for p in pods if p.model == m] for m in ("llama", "qwen")}
    for turn in range(12):
        now = 100.0 + turn * 0.1
        for c in (packed_core, dict_core):  # the same own counts, written alike
            for i, p in enumerate(pods):
                c.counts.running[p.key] = int((turn + i) % 3)
                c.counts.changed.add(p.key)
            c.confirm(c.plan(now), now)
        if turn == 6:  # the slot map bound anew: a new list, one pod without a slot yet
            keys = {m: list(k) for m, k in keys.items()}
            keys["qwen"] = keys["qwen"][:-1]
        totals = {m: rng.integers(0, 6, len(k)).astype(np.int32) for m, k in keys.items()}
        packed = {m: (keys[m], totals[m]) for m in keys if not (turn == 4 and m == "qwen")}
        running = {k: int(n) for m, (ks, values) in packed.items() for k, n in zip(ks, values)}
        aibrix = {"default/p1": 2} if turn == 9 else {}
        packed_core.apply(SharedSnapshot(server_now=now, gateways={ME: now}, running={}, packed=packed,
                                         aibrix=aibrix))
        dict_core.apply(SharedSnapshot(server_now=now, gateways={ME: now}, running=running, aibrix=aibrix))
        assert [packed_core.running(p.key) for p in pods] == [dict_core.running(p.key) for p in pods], turn


def test_token_deltas_keep_their_baselines_when_the_tracked_pods_change():
    c = core()
    c.apply(snap(1.0, {}, tokens={POD.key: 500, OTHER.key: 70}))
    assert c.take_token_deltas() == {}
    late = Pod("llama", "pod-c", "10.0.0.3:8000", namespace="team")
    c.counts.track([late])  # a pod joins: the arrays are laid out anew, the baselines stay
    c.apply(snap(2.0, {}, tokens={POD.key: 510, OTHER.key: 70, late.key: 900}))
    assert c.take_token_deltas() == {POD.key: 10}  # the newcomer's first read is its baseline
    c.apply(snap(3.0, {}, tokens={POD.key: 510, OTHER.key: 75, late.key: 903}))
    assert c.take_token_deltas() == {OTHER.key: 5, late.key: 3}
