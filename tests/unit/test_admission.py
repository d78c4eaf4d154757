"""extproc.admission: one table from a route's outcome to the caller's answer, and the registry's
Waiting that supplies the room, so the gateway's shells name no strategy."""

from __future__ import annotations

import ast
import pathlib

import pytest

import extproc.strategies  # noqa: F401  (the slo* family registers its Waiting)
from extproc import admission
from extproc.pool.pod import Pod
from extproc.routing.framework import waiting_for, waitings
from extproc.routing.outcome import Queued, Rejected, Routed
from extproc.slo.queue import REJECT_FULL


class Entry:
    payload: object = None


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


class Answers:
    def routed(self, decision, ctx):  # noqa: ANN001, ANN201
        return ("routed", decision.pod.name, ctx)

    def no_pod(self, ctx):  # noqa: ANN001, ANN201
        return ("no_pod", ctx)

    def waits(self, queued, ctx):  # noqa: ANN001, ANN201
        return ("waits", queued.entry.payload, ctx)

    def refused(self, rejected, ctx):  # noqa: ANN001, ANN201
        return ("refused", rejected.reason, ctx)


def test_each_outcome_gets_its_answer():
    room = FakeRoom(room_for=1)
    routed = Routed(Pod("m", "p0", "10.0.0.1:8000"), "k1")
    assert admission.answer(routed, room, Answers(), 7) == ("routed", "p0", 7)
    assert admission.answer(None, room, Answers(), 7) == ("no_pod", 7)
    refused = admission.answer(Rejected("slo_breached", 1.0), room, Answers(), 7)
    assert refused == ("refused", "slo_breached", 7)
    assert room.admitted == []  # only a held-back request reaches the room


def test_a_queued_request_is_admitted_with_its_payload_until_the_room_is_full():
    room = FakeRoom(room_for=1)
    first, second = Queued(Entry()), Queued(Entry())
    assert admission.answer(first, room, Answers(), "a", payload=3) == ("waits", 3, "a")
    assert room.admitted == [first]
    assert admission.answer(second, room, Answers(), "b", payload=4) == ("refused", REJECT_FULL, "b")


def test_a_held_back_request_without_a_room_is_a_bug():
    with pytest.raises(admission.NoRoom):
        admission.answer(Queued(Entry()), None, Answers(), None)
    with pytest.raises(admission.NoRoom):
        admission.answer(Rejected("slo_breached", 1.0), None, Answers(), None)


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
