"""The packed running totals: decoding Redis's string, and a gateway's map of which pod is in which slot."""

from __future__ import annotations

from extproc.sharing.packed_totals import HEADER_BYTES, SlotMap, as_bytes, decode, encode

EPOCH = "1764972000123456"
OTHER = "1764972999000000"


def test_encode_decode_round_trip_little_endian_int32():
    packed = encode(EPOCH, [0, 7, 2**31 - 1])
    assert len(packed) == HEADER_BYTES + 12
    assert packed[HEADER_BYTES + 4:HEADER_BYTES + 8] == b"\x07\x00\x00\x00"
    epoch, values = decode(packed)
    assert epoch == EPOCH and values.tolist() == [0, 7, 2**31 - 1]


def test_decode_of_a_string_without_slots():
    epoch, values = decode(EPOCH.encode())
    assert epoch == EPOCH and values.tolist() == []


def test_surrogateescape_reply_round_trips_to_the_bytes_sent():
    packed = encode(EPOCH, [255, 128, -1 & 0x7FFFFFFF])
    assert as_bytes(packed.decode("utf-8", "surrogateescape")) == packed


def test_totals_of_the_tracked_pods_by_slot():
    slots = SlotMap()
    slots.track({"ns/b": "kb", "ns/c": "kc"})
    slots.extend(0, [EPOCH, "ns/a", "ns/b", "ns/c"])
    assert slots.known() == 4
    into: dict = {}
    assert slots.totals(encode(EPOCH, [5, 0, 3]), into)
    assert into == {"kb": 0, "kc": 3}  # ns/a is not tracked here


def test_new_slots_are_appended_and_bound():
    slots = SlotMap()
    slots.track({"ns/a": "ka", "ns/d": "kd"})
    slots.extend(0, [EPOCH, "ns/a"])
    slots.extend(2, ["ns/b", "ns/d"])
    assert slots.names == ["ns/a", "ns/b", "ns/d"] and slots.known() == 4
    into: dict = {}
    assert slots.totals(encode(EPOCH, [1, 2, 4]), into)
    assert into == {"ka": 1, "kd": 4}


def test_a_slot_past_the_string_reads_zero():
    slots = SlotMap()
    slots.track({"ns/a": "ka", "ns/b": "kb"})
    slots.extend(0, [EPOCH, "ns/a", "ns/b"])
    into: dict = {}
    assert slots.totals(encode(EPOCH, [6]), into)
    assert into == {"ka": 6, "kb": 0}


def test_another_epoch_reads_nothing():
    slots = SlotMap()
    slots.track({"ns/a": "ka"})
    slots.extend(0, [EPOCH, "ns/a"])
    into: dict = {}
    assert not slots.totals(encode(OTHER, [9]), into)
    assert into == {}


def test_a_read_afresh_replaces_the_map():
    slots = SlotMap()
    slots.track({"ns/a": "ka", "ns/b": "kb"})
    slots.extend(0, [EPOCH, "ns/a", "ns/b"])
    slots.extend(0, [OTHER, "ns/b"])
    assert slots.epoch == OTHER and slots.names == ["ns/b"]
    into: dict = {}
    assert slots.totals(encode(OTHER, [3]), into)
    assert into == {"kb": 3}


def test_reset_and_track_rebind():
    slots = SlotMap()
    slots.extend(0, [EPOCH, "ns/a"])
    into: dict = {}
    assert slots.totals(encode(EPOCH, [2]), into) and into == {}  # nothing tracked yet
    slots.track({"ns/a": "ka"})
    assert slots.totals(encode(EPOCH, [2]), into) and into == {"ka": 2}
    slots.reset()
    assert slots.known() == 0 and slots.epoch == ""
    into = {}
    assert not slots.totals(encode(EPOCH, [2]), into)


def test_no_names_returned_keeps_the_map():
    slots = SlotMap()
    slots.track({"ns/a": "ka"})
    slots.extend(0, [EPOCH, "ns/a"])
    slots.extend(2, [])
    assert slots.names == ["ns/a"] and slots.epoch == EPOCH
