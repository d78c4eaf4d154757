"""The write, reap and read scripts against a real redis-server: the packed totals always equal the
totals hash, slots are given once, and a reader's map follows new slots, rebuilds and older snapshots."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from extproc.pool.pod import Pod
from extproc.sharing import redis_scripts
from extproc.sharing.packed_totals import COMPACT_SLACK, SlotMap, decode
from extproc.sharing.redis_sync import RedisState, reap_keys, write_keys
from extproc.sharing.sync_core import KEY_TTL_SECONDS, names_key, packed_key, running_key, slots_key
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]

MODEL = "llama"


@pytest.fixture
def client(tmp_path: Path) -> Iterator[redis.Redis]:
    server = RedisServer(tmp_path)
    c = redis.Redis(port=server.port)
    yield c
    c.close()
    server.stop()


def write(c: redis.Redis, gateway: str, running: dict[str, int]) -> None:
    pairs = [x for pod, n in running.items() for x in (pod, n)]
    c.eval(redis_scripts.WRITE, 8, *write_keys(MODEL, gateway), KEY_TTL_SECONDS, gateway, len(running),
           *pairs)


def reap(c: redis.Redis, gateway: str) -> None:
    c.eval(redis_scripts.REAP, 7, *reap_keys(MODEL, gateway), gateway)


def packed_view(c: redis.Redis) -> dict[str, int]:
    """Every named slot's value as the packed string holds it."""
    epoch, values = decode(c.get(packed_key(MODEL)))
    names = [n.decode() for n in c.lrange(names_key(MODEL), 0, -1)]
    assert names[0] == epoch
    padded = values.tolist() + [0] * (len(names) - 1 - len(values))
    return {name: padded[slot] for slot, name in enumerate(names[1:])}


def hash_view(c: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in c.hgetall(running_key(MODEL)).items()}


def assert_consistent(c: redis.Redis) -> None:
    packed = packed_view(c)
    assert {k: v for k, v in packed.items() if v} == hash_view(c)
    slots = {k.decode(): int(v) for k, v in c.hgetall(slots_key(MODEL)).items()}
    assert slots == {name: i for i, name in enumerate(packed)}  # one slot per pod, in order


def read(c: redis.Redis, slot_map: SlotMap, into: dict) -> list:
    packed, start, names = c.evalsha(redis_scripts.READ_SHA, 2, packed_key(MODEL), names_key(MODEL),
                                     slot_map.epoch, slot_map.known())
    names = [n.decode() for n in names]
    slot_map.extend(start, names)
    if packed is not None:
        assert slot_map.totals(packed, into)
    return names


def test_writes_and_reaps_keep_the_packed_form_equal_to_the_hash(client):
    write(client, "gw-a", {"ns/p0": 3, "ns/p1": 2})
    write(client, "gw-b", {"ns/p1": 4, "ns/p2": 1})
    assert hash_view(client) == {"ns/p0": 3, "ns/p1": 6, "ns/p2": 1}
    assert_consistent(client)
    write(client, "gw-a", {"ns/p0": 0, "ns/p1": 2})  # p0 idle: out of the hash, 0 in its slot
    assert packed_view(client)["ns/p0"] == 0
    assert_consistent(client)
    reap(client, "gw-b")
    assert hash_view(client) == {"ns/p1": 2}
    assert_consistent(client)
    write(client, "gw-a", {"ns/p0": 1})  # p0 busy again: its old slot, not a new one
    assert list(packed_view(client)) == ["ns/p0", "ns/p1", "ns/p2"]
    assert_consistent(client)


def test_keys_written_without_the_packed_form_are_rebuilt_from_the_hash(client):
    # As a version without the packed form left them (or the packed keys expired alone).
    client.hset(running_key(MODEL), mapping={"ns/old0": 5, "ns/old1": 2})
    write(client, "gw-a", {"ns/new": 1})
    assert packed_view(client) == {"ns/old0": 5, "ns/old1": 2, "ns/new": 1}
    epoch = client.lindex(names_key(MODEL), 0)
    client.delete(packed_key(MODEL))
    write(client, "gw-a", {"ns/new": 2})
    assert client.lindex(names_key(MODEL), 0) != epoch  # a new epoch: readers start afresh
    assert_consistent(client)


def test_a_reader_fetches_only_new_names_and_starts_afresh_on_a_new_epoch(client):
    client.script_load(redis_scripts.READ)
    slot_map = SlotMap()
    slot_map.track({"ns/p0": "k0", "ns/p1": "k1", "ns/p2": "k2"})
    into: dict = {}
    assert read(client, slot_map, into) == [] and into == {}  # nothing written yet
    write(client, "gw-a", {"ns/p0": 3, "ns/p1": 1})
    assert len(read(client, slot_map, into)) == 3  # the epoch and two pods
    assert into == {"k0": 3, "k1": 1}
    write(client, "gw-a", {"ns/p1": 0, "ns/p2": 7})
    into = {}
    assert read(client, slot_map, into) == ["ns/p2"]  # only the new slot's name
    assert into == {"k0": 3, "k1": 0, "k2": 7}
    into = {}
    assert read(client, slot_map, into) == [] and into == {"k0": 3, "k1": 0, "k2": 7}
    for key in (packed_key(MODEL), names_key(MODEL), slots_key(MODEL)):
        client.delete(key)
    write(client, "gw-a", {"ns/p0": 1})  # rebuilt: p0 first now, p2 from the hash
    into = {}
    names = read(client, slot_map, into)
    assert names[0] == slot_map.epoch and set(names[1:]) == {"ns/p0", "ns/p2"}
    assert into == {"k0": 1, "k2": 7}


def test_a_shorter_names_list_starts_the_reader_afresh(client):
    """Redis back from an older snapshot: same epoch, fewer slots; the reader must not keep slots that
    name other pods now."""
    client.script_load(redis_scripts.READ)
    write(client, "gw-a", {"ns/p0": 1, "ns/p1": 1, "ns/p2": 1})
    slot_map = SlotMap()
    slot_map.track({"ns/p0": "k0", "ns/p1": "k1", "ns/p2": "k2"})
    read(client, slot_map, {})
    client.ltrim(names_key(MODEL), 0, 1)  # what an older snapshot holds: the epoch and p0
    names = read(client, slot_map, {})
    assert names == [slot_map.epoch, "ns/p0"] and slot_map.names == ["ns/p0"]


def test_slots_of_pods_gone_are_compacted_under_a_new_epoch(client):
    """Pods replaced over time: once the slots outnumber twice the busy pods by COMPACT_SLACK, the
    next write rebuilds the packed form from the busy pods alone."""
    churned = {f"ns/old{i}": 1 for i in range(COMPACT_SLACK + 10)}
    write(client, "gw-a", churned)
    write(client, "gw-a", {pod: 0 for pod in churned} | {"ns/live": 2})  # all gone, one busy pod
    epoch = client.lindex(names_key(MODEL), 0)
    assert client.llen(names_key(MODEL)) == COMPACT_SLACK + 12  # not yet: compacted by the next write
    write(client, "gw-a", {"ns/live": 3})
    assert client.lindex(names_key(MODEL), 0) != epoch
    assert packed_view(client) == {"ns/live": 3}
    assert_consistent(client)


async def test_gateways_read_each_other_through_the_packed_totals_across_a_rebuild(client):
    """RedisState end to end: a reader follows a pod's new slot, and the keys rebuilt under a new
    epoch (expired, or cleared by hand) without a failed turn."""
    url = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
    first = [Pod(MODEL, f"p{i}", f"127.0.0.1:{10 + i}", namespace="ns") for i in range(3)]
    late = Pod(MODEL, "late", "127.0.0.1:20", namespace="ns")
    a, b = RedisState(url, "gw-a"), RedisState(url, "gw-b")
    try:
        for state in (a, b):
            state.track(first)
        b.add_running(first[1], 2)
        b.add_running(first[2], 1)
        await b.sync_once()
        await a.sync_once()
        assert [a.running(p.key) for p in first] == [0, 2, 1]
        for state in (a, b):
            state.track([*first, late])
        b.add_running(late, 4)
        await b.sync_once()
        await a.sync_once()
        assert a.running(late.key) == 4 and a.running(first[1].key) == 2
        for key in (packed_key(MODEL), names_key(MODEL), slots_key(MODEL)):
            client.delete(key)
        b.add_running(first[1], 1)
        await b.sync_once()  # rebuilt from the totals hash, under a new epoch
        await a.sync_once()
        assert [a.running(p.key) for p in (*first, late)] == [0, 3, 1, 4]
        assert a.up
    finally:
        await a.close()
        await b.close()
