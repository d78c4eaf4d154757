"""The clock-free dispatch rule (shared by the live waiting room and a virtual-time loop)."""

from __future__ import annotations

import pytest

from extproc.openai import Request
from extproc.pool import Pod
from extproc.gpu_profiles import parse_profile
from extproc.routing import PodView, RoutingSettings, RoutingState, build
from extproc.routing.slo import SloWait
from extproc.slo.dispatch import dispatch, expire

PROFILE = parse_profile({"gpu": "d", "cost": 1, "tputs": [[2.0]], "indexes": [[8], [128]],
                         "e2e": [[1.0]], "slos": {"e2e": 3.0}, "created": 1})   # consumption 0.5


def setup():
    state = RoutingState.seeded(0)
    slo = build("slo", RoutingSettings(state=state, model="m"))
    s = state.store["slo"]
    s.set_profiles("m", {"d": PROFILE})
    view = PodView(Pod("m", "p", "10.0.0.1:8000", deployment="d"), running=2)
    return slo, s, view


def test_dispatch_routes_when_capacity_frees_and_expire_removes_breached():
    slo, s, view = setup()
    r = Request(model="m", path="/v1/chat/completions", prompt_tokens=128, max_tokens=8)
    entries = []
    for t in (0.0, 0.5):
        with pytest.raises(SloWait) as w:
            slo.pick(r, [view], t)
        s.queues.push(w.value.entry)
        entries.append(w.value.entry)
    assert entries[0].deadline == pytest.approx(2.0)           # slack: target 3 - expected 1

    def route(entry):
        chosen = slo.pick(r, [view], 1.0)
        chosen.running += 1                                     # what the post-choice hook does
        return chosen

    assert dispatch(s, "m", 1.0, route) == []                  # still full: both stay, in order
    assert s.queues.length("m") == 2
    view.running = 1                                            # one finished: room for one
    left = dispatch(s, "m", 1.0, route)
    assert [e for e, _ in left] == [entries[0]] and left[0][1] is view   # the older (more urgent) first
    assert s.dispatching is False
    assert expire(s, "m", 2.4) == [] and expire(s, "m", 2.5) == [entries[1]]
    assert s.queues.length("m") == 0
