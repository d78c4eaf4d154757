"""extproc.admission: a route's outcome, once admitted, as a value the caller matches on, and the
registry's Waiting that supplies the room, so the gateway's shells name no strategy."""

from __future__ import annotations

import ast
import pathlib

import pytest

import extproc.strategies  # noqa: F401  (the slo* family registers its Waiting)
from extproc import admission
from extproc.pool.pod import Pod
from extproc.routing.framework import waiting_for, waitings
from extproc.routing.outcome import Queued, Rejected, Routed
from extproc.slo.queue import REJECT_FULL, Entry, Queues
from extproc.slo.room import Room


class FakeRoom:
    """Admits until full."""

    def __init__(self, room_for: int) -> None:
        self.room_for = room_for
        self.admitted: list[Queued] = []

    def admit(self, queued: Queued) -> Queued | Rejected:
        if len(self.admitted) >= self.room_for:
            return Rejected(REJECT_FULL, 2.0)
        self.admitted.append(queued)
        return queued


def entry() -> Entry[int]:
    return Entry("m", "k", 0.0, 1.0, 1.0, 5.0)


def test_routed_no_pod_and_a_strategys_refusal_pass_through_unchanged():
    room = FakeRoom(room_for=1)
    routed = Routed(Pod("m", "p0", "10.0.0.1:8000"), "k1")
    refused = Rejected("slo_breached", 1.0)
    assert admission.admit(routed, room) is routed
    assert admission.admit(None, room) is None
    assert admission.admit(refused, room) is refused
    assert room.admitted == []  # only a held-back request reaches the room
    assert admission.admit(routed, None) is routed and admission.admit(None, None) is None  # no room needed


def test_a_queued_request_waits_until_the_room_is_full():
    room = FakeRoom(room_for=1)
    first, second = Queued(entry()), Queued(entry())
    assert admission.admit(first, room) is first
    assert room.admitted == [first]
    refused = admission.admit(second, room)
    assert isinstance(refused, Rejected) and refused.reason == REJECT_FULL


def test_the_pure_room_keeps_its_owners_payload():
    room: Room[int] = Room(Queues(max_length=1))
    first, second = Queued(entry()), Queued(entry())
    first.entry.payload = 7
    assert admission.admit(first, room) is first and room.length("m") == 1
    assert isinstance(admission.admit(second, room), Rejected)  # the queue holds one
    (left, rejected), = room.expire("m", 6.0)  # past its deadline
    assert left.payload == 7 and rejected.reason == "slo_breached" and room.length("m") == 0


def test_a_held_back_request_without_a_room_is_a_bug():
    with pytest.raises(admission.NoRoom):
        admission.admit(Queued(entry()), None)
    with pytest.raises(admission.NoRoom):
        admission.admit(Rejected("slo_breached", 1.0), None)


def test_the_slo_family_registers_one_shared_waiting():
    names = ("slo", "slo-pack-load", "slo-least-load", "slo-least-load-pulling")
    rooms = {waiting_for(name) for name in names}
    assert len(rooms) == 1 and None not in rooms
    (slo,) = rooms
    assert slo in waitings() and slo.refresh is not None
    assert waiting_for("load-balance") is None


def test_the_gateway_shell_imports_no_strategy_package():
    server = pathlib.Path(admission.__file__).parent / "server"
    for path in server.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("extproc.slo") for n in names), path.name
