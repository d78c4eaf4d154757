"""Columns derived once per snapshot of the views: the same choices as deriving them per request."""

from __future__ import annotations

import math
import random

import pytest

from extproc.config import parse
from extproc.pool import Pod
from extproc.routing import PodView, Router, RoutingSettings
from extproc.routing.gate import ImbalanceGate
from extproc.routing.load_balance import LoadBalanceScorer
from extproc.routing.settings import LoadBalanceSettings
from extproc.routing.snapshot import derived
from extproc.server.gateway import Gateway
from extproc.vocabulary import RequestEnd, Snapshot, Speed
from tests.unit.routing.support import REQ


def test_derived_is_built_once_per_snapshot_and_each_time_for_a_plain_list():
    calls = []
    owner = object()

    def build(pods):
        calls.append(len(pods))
        return len(pods)

    snapshot, plain = Snapshot([PodView(Pod("m", "a", "10.0.0.1:1"))]), [PodView(Pod("m", "a", "10.0.0.1:1"))]
    assert [derived(snapshot, owner, build) for _ in range(3)] == [1, 1, 1]
    assert [derived(plain, owner, build) for _ in range(3)] == [1, 1, 1]
    assert len(calls) == 4
    assert derived(snapshot, object(), build) == 1 and len(calls) == 5  # another owner, its own entry


def _fleet(rng: random.Random, n: int, speeds: bool) -> list[PodView]:
    kinds = (Speed(0.007, 0.03, 4000.0, 256), Speed(0.012, 0.02, 2500.0, 256), Speed(0.03, 0.05, 600.0, 64))
    pods = []
    for i in range(n):
        sp = rng.choice(kinds)
        pods.append(PodView(Pod("m", f"p{i}", f"10.0.{i // 250}.{i % 250}:1"), running=0,
                            queued=rng.choice((0.0, 1.0, math.nan)),
                            kv_free=rng.choice((None, math.nan, 0.02, 0.3, 0.9)),
                            capacity=rng.choice((None, sp.saturated)), speed=sp if speeds else None))
    return pods


@pytest.mark.parametrize("capacity", ["speed", "observed"])
@pytest.mark.parametrize("speeds", [True, False])
@pytest.mark.parametrize("queued_weight", [0.0, 0.5])
def test_scores_and_gate_on_a_snapshot_follow_running_counts_changed_in_place(capacity, speeds,
                                                                             queued_weight):
    """The cached columns never go stale on what does change in place (running counts): scores,
    gate firings and picks equal those over a plain list of the same views, request after request."""
    rng = random.Random(7)
    settings = LoadBalanceSettings(capacity=capacity, queued_weight=queued_weight)
    views = _fleet(rng, 60, speeds)
    snapshot = Snapshot(views)
    scorer = LoadBalanceScorer(settings)
    gates = ImbalanceGate(settings, {}), ImbalanceGate(settings, {})
    router = Router(RoutingSettings(seed=3, load_balance=settings))
    twin = Router(RoutingSettings(seed=3, load_balance=settings))
    cached, fresh = router.profile_for("load-balance", "m"), twin.profile_for("load-balance", "m")
    for _ in range(300):
        fresh_scores = scorer.score(REQ, list(views), 0.0)
        assert scorer.score(REQ, snapshot, 0.0) == pytest.approx(fresh_scores, nan_ok=True)
        kept = gates[0].filter(REQ, snapshot, 0.0)
        assert [p.pod for p in kept] == [p.pod for p in gates[1].filter(REQ, list(views), 0.0)]
        a, b = cached.pick(REQ, snapshot, 0.0), fresh.pick(REQ, list(views), 0.0)
        assert a is not None and b is not None and a.pod == b.pod
        a.running += 1
        if rng.random() < 0.4:  # a record: some request ends
            busy = [v for v in views if v.running > 0]
            rng.choice(busy).running -= 1
        if rng.random() < 0.05:  # a burst through another gateway: a hotspot the gate must see
            rng.choice(views).running += 20
    assert gates[0].counts == gates[1].counts and gates[0].counts  # the gate fired too


def test_a_pod_leaving_routing_is_left_out_at_once_not_at_the_next_rebuild():
    now = [0.0]
    config = parse({"models": {"m": {"pods": [{"name": f"p{i}", "address": f"10.0.0.{i + 1}:8000"}
                                              for i in range(3)]}},
                    "routing": {"default_strategy": "least-request"}}, {})
    gw = Gateway(config, clock=lambda: now[0])
    profile = gw.profile("least-request")
    request = REQ.__class__(model="m", path="/v1/chat/completions")
    first = gw.route(request, profile, "r0")
    assert first is not None
    gw.complete(first.key, RequestEnd(0, connect_failure=True))  # its engine refused the connection
    picked = {gw.route(request, profile, f"r{i}").pod.name for i in range(1, 30)}  # type: ignore[union-attr]
    assert first.pod.name not in picked and len(picked) == 2
    gw.accounting.health.observe_scrape(first.pod.key, ok=True, connect_refused=False, now=now[0])
    assert first.pod.name in {gw.route(request, profile, f"s{i}").pod.name  # type: ignore[union-attr]
                              for i in range(30)}
