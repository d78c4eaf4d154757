"""`slo`, our default SLO rule, on hand-built pools: each shape goes to the GPU types comparative
advantage gives it, so a shape that needs a whole pod finds one while chat is spread (packed where a
whole-pod shape shares its type); a full lane spills packed; a whole-pod shape shares a pod rather
than wait for one to empty; lanes do not block each other."""

from __future__ import annotations

import pytest

from extproc.gpu_profiles import parse_profile
from extproc.openai import Request
from extproc.pool import Pod
from extproc.routing import PodView, RoutingSettings, RoutingState, build
from extproc.routing.outcome import Queued
from extproc.slo.assignment import Mix, assign
from extproc.slo.model import Signature, build_table

CHAT, CODE = (128, 8), (4096, 8)


def profile(name: str, chat: tuple[float, float], code: tuple[float, float]):
    """(tput, e2e) for the chat shape (128 in) and the code shape (4096 in); outputs 8 and 256 alike."""
    tputs = [[chat[0], code[0]], [chat[0], code[0]]]
    e2e = [[chat[1], code[1]], [chat[1], code[1]]]
    return parse_profile({"gpu": name, "cost": 1.0, "tputs": tputs, "indexes": [[8, 256], [128, 4096]],
                          "e2e": e2e, "slos": {"percentile": 99, "e2e": 10.0}, "created": 1.0})


SMALL = profile("small", chat=(2.0, 1.0), code=(0.0, 1.0))   # chat 0.5 of a pod; cannot serve code
BIG = profile("big", chat=(8.0, 0.5), code=(0.5, 1.0))       # chat 0.25; code a whole pod (0.5 x 1 < 1)


def req(shape: tuple[int, int]) -> Request:
    return Request(model="m", path="/v1/chat/completions", prompt_tokens=shape[0], max_tokens=shape[1])


PODS = {n: Pod("m", n, f"10.0.0.{i + 1}:8000", deployment=n[:-1])
        for i, n in enumerate(("small0", "small1", "big0", "big1"))}


def views(**running: int) -> list[PodView]:
    return [PodView(p, running=running.get(n, 0)) for n, p in PODS.items()]


@pytest.fixture
def slo():
    state = RoutingState.seeded(3)
    settings = RoutingSettings()
    strategies = {n: build(n, settings, state, "m") for n in ("slo", "slo-least-load-pulling")}
    table = state.store["slo"]
    table.set_profiles("m", {"small": SMALL, "big": BIG})
    for t in range(20):  # the recent mix: chat at twice code's rate
        table.observe_arrival("m", Signature(*CHAT), t * 0.1)
        table.observe_arrival("m", Signature(*CHAT), t * 0.1)
        table.observe_arrival("m", Signature(*CODE), t * 0.1)
    return strategies, table


def test_the_split_follows_comparative_advantage():
    table = build_table({"small": SMALL, "big": BIG})
    mix = Mix()
    for _ in range(20):
        mix.observe((7, 3), 0.0)
        mix.observe((7, 3), 0.0)
        mix.observe((12, 3), 0.0)
    split = assign(table, {"small": 2, "big": 2}, mix.rates(0.0))
    # big is 4x better at chat but the only type for code: chat goes where it costs the fleet least
    assert split == {(7, 3): frozenset({"small"}), (12, 3): frozenset({"big"})}
    # with no small pods left, chat has to go to big
    assert assign(table, {"small": 0, "big": 2}, mix.rates(0.0))[(7, 3)] == frozenset({"big"})
    assert assign(table, {"small": 2, "big": 2}, {}) == {}
    # the GPU optimizer cut small to a tenth of its profile (its pods missed the SLO): big takes chat too
    cut = build_table({"small": SMALL, "big": BIG}, {"small": 0.1})
    assert "big" in assign(cut, {"small": 2, "big": 2}, mix.rates(0.0))[(7, 3)]


def test_chat_is_spread_over_its_own_type_and_code_finds_a_whole_pod(slo):
    s, _ = slo
    # AIBrix's least-load over every suitable pod puts chat on the idle big pods (0.25 < 0.5) ...
    pool = views(small0=1)
    assert s["slo-least-load-pulling"].pick(req(CHAT), pool, 2.0).pod.deployment == "big"
    # ... ours keeps chat on small, so both big pods stay whole for code
    assert s["slo"].pick(req(CHAT), pool, 2.0).pod.name == "small1"
    assert s["slo"].pick(req(CODE), views(small0=1, small1=1, big1=1), 2.0).pod.name == "big0"


def test_a_full_lane_spills_packed_onto_another_type(slo):
    s, _ = slo
    # both small pods full (2 x 0.5); big0 has chat already, big1 is idle: chat packs onto big0
    chosen = s["slo"].pick(req(CHAT), views(small0=2, small1=2, big0=1), 2.0)
    assert chosen.pod.name == "big0"


def test_a_whole_pod_shape_shares_a_pod_rather_than_wait_for_one_to_empty(slo):
    s, table = slo
    busy = views(small0=2, small1=2, big0=1, big1=1)
    assert s["slo"].pick(req(CODE), busy, 2.0).pod.deployment == "big"
    assert type(s["slo-least-load-pulling"].pick(req(CODE), busy, 2.0)) is Queued  # AIBrix's rule waits for an empty pod
    assert type(s["slo"].pick(req(CODE), views(small0=2, small1=2, big0=2, big1=2), 2.0)) is Queued  # beyond a pod's worth on every pod of its lane, ours waits too


def test_a_waiting_lane_does_not_hold_up_another(slo):
    s, table = slo
    full = views(small0=2, small1=2, big0=2, big1=2)
    wait = s["slo"].pick(req(CODE), full, 2.0)
    assert type(wait) is Queued
    table.queues.push(wait.entry)
    assert wait.entry.key == frozenset({"big"}) and not wait.entry.blocks_all
    # a chat request arriving while code waits is routed when its own lane has room
    assert s["slo"].pick(req(CHAT), views(small0=1, small1=2, big0=2, big1=2), 2.0).pod.name == "small0"
    # under AIBrix's rule it would queue behind the code request
    assert type(s["slo-least-load-pulling"].pick(req(CHAT), views(small0=1, small1=2, big0=2, big1=2), 2.0)) is Queued


def test_the_server_keeps_the_split_fresh_off_the_request_path(tmp_path):
    import asyncio

    from extproc.config import parse
    from extproc.server.gateway import Gateway
    from extproc.slo.refresh import SloRefresh

    cfg = {"models": {"m": {"pods": [{"name": n, "address": p.address, "deployment": p.deployment}
                                     for n, p in PODS.items()]}},
           "routing": {"default_strategy": "slo"}}
    gw = Gateway(parse(cfg, {}))
    refresh = SloRefresh(gw)
    state = refresh.state
    state.set_profiles("m", {"small": SMALL, "big": BIG})
    for _ in range(20):
        state.observe_arrival("m", Signature(*CHAT), gw.clock())
        state.observe_arrival("m", Signature(*CODE), gw.clock())
    asyncio.run(refresh.refresh_splits())
    assert state.split.elsewhere
    split = state.split.assignments["m"]
    assert split[2][(7, 3)] == frozenset({"small"}) and split[2][(12, 3)] == frozenset({"big"})
    # the request path reads that split, however old, instead of solving again
    assert state.assigned("m", Signature(*CHAT), {"small": 1}, gw.clock() + 1e3) == frozenset({"small"})
    assert state.split.assignments["m"] is split


def test_full_by_the_profiles_but_not_by_measurement_routes_instead_of_waiting(slo):
    from extproc.vocabulary import Speed

    s, _ = slo

    def tpot_profile(name: str, chat: tuple[float, float], code: tuple[float, float]):
        raw = {"gpu": name, "cost": 1.0, "tputs": [[chat[0], code[0]]] * 2, "e2e": [[chat[1], code[1]]] * 2,
               "indexes": [[8, 256], [128, 4096]], "slos": {"percentile": 99, "tpot": 0.05}, "created": 1.0}
        return parse_profile(raw)

    s["slo"].policy.state.set_profiles("m", {"small": tpot_profile("small", (10.0, 0.2), (0.0, 1.0)),
                                              "big": tpot_profile("big", (40.0, 0.1), (0.5, 1.0))})
    full = views(small0=2, small1=2, big0=4, big1=4)  # chat holds 0.5 of a small pod: all full
    assert type(s["slo"].pick(req(CHAT), full, 2.0)) is Queued
    quick = Speed(base=0.01, shape=0.2, saturated=1000.0, batch=64)  # 2 in flight + 1: 16 ms per token
    slow = Speed(base=0.025, shape=0.3, saturated=500.0, batch=64)   # 2 + 1: 48 ms, too close to 50
    measured = [PodView(v.pod, running=v.running, speed=quick if v.pod.name == "small0" else slow)
                for v in full]
    assert s["slo"].pick(req(CHAT), measured, 2.0).pod.name == "small0"
    queueing = [PodView(v.pod, running=v.running, speed=v.speed, queued=1.0) for v in measured]
    assert type(s["slo"].pick(req(CHAT), queueing, 2.0)) is Queued  # the engine already queues: no room whatever the line says


def test_a_speed_line_that_never_saw_the_load_does_not_admit_past_what_the_profile_measured(slo):
    from extproc.gpu_profiles import BUDGET_MARGIN
    from extproc.vocabulary import Speed

    s, _ = slo

    def tpot_profile(name: str, chat: tuple[float, float]):
        raw = {"gpu": name, "cost": 1.0, "tputs": [[chat[0], 0.0]] * 2, "e2e": [[chat[1], 1.0]] * 2,
               "indexes": [[8, 256], [128, 4096]], "slos": {"percentile": 99, "tpot": 0.05}, "created": 1.0}
        return parse_profile(raw)

    s["slo"].policy.state.set_profiles("m", {"small": tpot_profile("small", (10.0, 0.2)),
                                              "big": tpot_profile("big", (10.0, 0.2))})
    # A line fitted before any slope was seen (shape 0: the prior) calls every batch as fast as one
    # request: on its word alone a pod would take requests without end (issue 43's engine model:
    # 21x the profile's budget, P99 TPOT 0.5 s against a 50 ms SLO).
    flat = Speed(base=0.01, shape=0.0, saturated=1000.0, batch=256)
    per_pod = 2 * BUDGET_MARGIN  # chat holds 0.5 of a pod: BUDGET_MARGIN budgets, beyond the measured
    within = [PodView(v.pod, running=v.running, speed=flat)
              for v in views(small0=per_pod - 1, small1=per_pod - 1, big0=per_pod - 1, big1=per_pod - 1)]
    assert type(s["slo"].pick(req(CHAT), within, 2.0)) is not Queued  # past the budget, inside the margin
    beyond = [PodView(v.pod, running=v.running, speed=flat)
              for v in views(small0=5 * per_pod, small1=5 * per_pod, big0=5 * per_pod, big1=5 * per_pod)]
    assert type(s["slo"].pick(req(CHAT), beyond, 2.0)) is Queued


def test_a_pod_admits_past_its_budget_only_within_its_profiles_budget_margin(slo):
    from extproc.vocabulary import Speed

    s, _ = slo

    def tpot_profile(name: str, margin: float):
        raw = {"gpu": name, "cost": 1.0, "tputs": [[10.0, 0.0]] * 2, "e2e": [[0.2, 1.0]] * 2,
               "indexes": [[8, 256], [128, 4096]], "slos": {"percentile": 99, "tpot": 0.05}, "created": 1.0,
               "tputs_admitted": [[10.0, 0.0]] * 2, "concurrency_admitted": [[2.0, 1.0]] * 2,
               "budget_margin": margin}
        return parse_profile(raw)

    fast = Speed(base=0.01, shape=0.0, saturated=1000.0, batch=256)
    full = [PodView(v.pod, running=v.running, speed=fast)  # every pod at its budget: 2 chats
            for v in views(small0=2, small1=2, big0=2, big1=2)]
    for margin, admits in ((2.0, True), (1.5, True), (1.0, False)):  # one more chat: 1.5 budgets
        s["slo"].policy.state.set_profiles("m", {"small": tpot_profile("small", margin),
                                                  "big": tpot_profile("big", margin)})
        assert (type(s["slo"].pick(req(CHAT), full, 2.0)) is not Queued) is admits, margin


def test_a_lane_both_shapes_share_is_packed_so_a_long_prompt_finds_an_empty_pod(slo):
    s, table = slo
    table.set_profiles("m", {"big": BIG})  # one type: chat and code share its lane
    # chat joins the pod that already has chat (0.25 + 0.25), not the empty one: spread over both, a
    # code request (a pod's worth) would find no empty pod and its prefill would stall chat's decodes
    assert s["slo"].pick(req(CHAT), views(big0=1), 2.0).pod.name == "big0"
    assert s["slo"].pick(req(CODE), views(big0=2), 2.0).pod.name == "big1"
    assert table.whole_hosts("m") == frozenset({"big"})
    # with small pods beside them, code has big to itself and chat small: chat is spread (above)


def test_a_shape_takes_a_whole_pod_where_the_longest_prompt_it_held_does():
    """A shape spans half a doubling either side of its representative (2,896-5,792 prompt tokens for
    4,096), and a profile measured at 6,144 tokens puts the longer of them in that cell: judged at
    4,096 alone, a type whose 6,144 cell takes a whole pod was left spread and those prefills stalled
    its chat (docs/slo-routing.md, item 5). Judged also at the longest prompt the shape held."""
    from extproc.slo.split import Split

    def fine(last_e2e: float):
        """Chat at 128 tokens, half a pod at 4,096, and at 6,144 `last_e2e` s at 0.5 req/s."""
        return parse_profile({"gpu": "fine", "cost": 1.0, "tputs": [[8.0, 1.0, 0.5]] * 2,
                              "e2e": [[0.5, 2.0, last_e2e]] * 2, "indexes": [[8, 256], [128, 4096, 6144]],
                              "slos": {"percentile": 99, "e2e": 10.0}, "created": 1.0})

    # 1 / (0.5 x 1.5) > 1: the 6,144 cell takes a whole pod; at 4.0 s half of one
    for longest, last_e2e, whole in ((5500, 1.5, True), (4000, 1.5, False), (5500, 4.0, False)):
        split = Split()
        for tokens in (3000, longest, 3500):  # all of shape (12, 3): 4,096 in, 8 out
            split.observe_arrival("m", Signature(tokens, 8), 0.0)
        split.store("m", (("fine", 2),), 0.0, {(12, 3): frozenset({"fine"})})
        hosts = split.whole_hosts("m", build_table({"fine": fine(last_e2e)}))
        assert (hosts == {"fine"}) is whole, (longest, last_e2e)


def test_the_mix_forgets_a_shapes_longest_prompt_with_the_shape():
    mix = Mix(tau_s=10.0)
    mix.observe((12, 3), 0.0, 5500)
    mix.observe((12, 3), 1.0, 3000)
    assert mix.longest == {(12, 3): 5500}  # the longest, not the last
    mix.observe((5, 3), 200.0)  # 20 time constants later (12, 3) has left the mix; no prompt counted
    assert mix.longest == {} and (12, 3) not in mix.rates(200.0)
    mix.observe((7, 3), 201.0, 150)
    assert mix.longest == {(7, 3): 150}
