"""The pure waiting room: admit, dispatch, expire (shared by the live shell and a virtual-time loop)."""

from __future__ import annotations

import pytest

from extproc.gpu_profiles import parse_profile
from extproc.openai import Request
from extproc.pool import Pod
from extproc.routing import PodView, RoutingSettings, RoutingState, build
from extproc.routing.outcome import Queued, Rejected
from extproc.slo.queue import Entry, Queues
from extproc.slo.room import Room

PROFILE = parse_profile({"gpu": "d", "cost": 1, "tputs": [[2.0]], "indexes": [[8], [128]],
                         "e2e": [[1.0]], "slos": {"e2e": 3.0}, "created": 1})   # consumption 0.5


def setup():
    state = RoutingState.seeded(0)
    slo = build("slo", RoutingSettings(), state, "m")
    s = state.store["slo"]
    s.set_profiles("m", {"d": PROFILE})
    view = PodView(Pod("m", "p", "10.0.0.1:8000", deployment="d"), running=2)
    return slo, s, view


def test_dispatch_routes_when_capacity_frees_and_expire_removes_breached():
    slo, s, view = setup()
    r = Request(model="m", path="/v1/chat/completions", prompt_tokens=128, max_tokens=8)
    entries = []
    room = Room(s.queues)
    for t in (0.0, 0.5):
        w = slo.pick(r, [view], t)
        assert type(w) is Queued
        assert room.admit(w) is w
        entries.append(w.entry)
    assert entries[0].deadline == pytest.approx(2.0)           # slack: target 3 - expected 1

    def route(entry):
        chosen = slo.pick(r, [view], 1.0, queued=True)
        if type(chosen) is PodView:
            chosen.running += 1                                 # what the post-choice hook does
        return chosen

    assert room.dispatch("m", 1.0, route) == []                  # still full: both stay, in order
    assert s.queues.length("m") == 2
    view.running = 1                                            # one finished: room for one
    left = room.dispatch("m", 1.0, route)
    assert [e for e, _ in left] == [entries[0]] and left[0][1] is view   # the older (more urgent) first
    assert room.expire("m", 2.4) == []
    # the refusal names the deployments that could have served it (the optimizer counts it theirs)
    assert room.expire("m", 2.5) == [(entries[1], Rejected("slo_breached", entries[1].retry_after,
                                                          frozenset({"d"})))]
    assert s.queues.length("m") == 0


def test_a_full_room_refuses_and_a_breach_is_told_once():
    room = Room(Queues(max_length=1))
    first, second = (Entry("m", "k", 0.0, 1.0, 1.0, 5.0, retry_after=3.0) for _ in range(2))
    assert type(room.admit(Queued(first))) is Queued
    assert room.admit(Queued(second)) == Rejected("queue_full", 3.0)
    assert room.breach(first) == Rejected("slo_breached", 3.0)
    assert room.breach(first) is None and room.queues.length("m") == 0
