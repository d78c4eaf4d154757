"""prefix-cache, session-affinity, power-of-two, least-latency, least-kv-cache and throughput on
hand-built snapshots."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import replace

import pytest

from extproc.openai import parse_request
from extproc.pool import Pod
from extproc.routing import PodView, Router, RoutingSettings, build
from extproc.routing.least_latency import LatencyModel
from extproc.routing.prefix_cache import (
    ENTRY_BYTES,
    HOLDER_BYTES,
    PrefixCacheSettings,
    PrefixTable,
    block_hashes,
)
from extproc.routing.session_affinity import rendezvous
from extproc.routing.settings import SettingError, parse_settings
from extproc.routing.store import RoutingState
from extproc.routing.throughput import RecentTokens
from extproc.vocabulary import RequestRecord
from tests.unit.routing.support import REQ, view

CHAT = "/v1/chat/completions"
LONG = "You are a careful assistant. " * 200  # ~1,400 tokens of shared system prompt


def chat(*messages: str, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": m} for m in messages], **extra}
    return parse_request(CHAT, json.dumps(body).encode())


def profile(name: str, state: RoutingState | None = None, **settings):
    return build(name, RoutingSettings(**settings), state or RoutingState.seeded(0), "m")


# -- prefix-cache ------------------------------------------------------------------------------------

def test_block_hashes_follow_the_rendered_prompt_not_how_it_was_split():
    whole = chat(LONG + "\nquestion one")
    split = chat(LONG, "question one")  # the same text as two messages
    parts = parse_request(CHAT, json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": LONG}, {"type": "text", "text": "question one"}]}]}).encode())
    hashes = [block_hashes(r.prompt, 64, 512) for r in (whole, split, parts)]
    assert hashes[0] == hashes[1] == hashes[2] and len(hashes[0]) == len(LONG + "\nquestion one") // 256
    other = block_hashes(chat(LONG + "\nquestion two, longer than the first one").prompt, 64, 512)
    assert other[:len(hashes[0]) - 1] == hashes[0][:-1]  # a shared prefix shares its leading blocks
    assert block_hashes("short", 64, 512) == []  # no full block: nothing to cache
    assert len(block_hashes(LONG * 10, 16, 8)) == 8  # bounded per prompt


def test_table_matches_unbroken_prefixes_and_evicts_least_recently_used():
    table = PrefixTable(6 * ENTRY_BYTES + 2 * HOLDER_BYTES)  # six blocks, two of them held twice
    a, b = ("m", "a", "10.0.0.1:1"), ("m", "b", "10.0.0.2:1")
    table.insert([1, 2, 3], a, 0.0)
    table.insert([1, 2, 9], b, 1.0)
    assert table.match([1, 2, 3, 4]) == {a: 3, b: 2}
    assert table.match([5, 1]) == {}
    table.match([1, 2, 3])  # touched: most recently used
    table.insert([7, 8, 10], a, 2.0)  # over the cap by one block: the oldest untouched one (9) goes
    assert len(table) == 6 and table.match([1, 2, 9]) == {a: 2, b: 2}
    table.forget_pods({a})
    assert table.match([1, 2]) == {a: 2}


def test_table_size_estimate_bounds_the_real_memory_however_many_pods_hold_a_block():
    for holders in (1, 4, 16):
        pods = [("m", f"p{i}", f"10.0.0.{i}:1") for i in range(holders)]
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            table = PrefixTable(1 << 40)
            for pod in pods:
                for start in range(0, 20_000, 100):
                    table.insert(range(start, start + 100), pod, float(start))
            used = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert used <= table.size_bytes, f"{holders} holders: {used} bytes, estimated {table.size_bytes}"


def test_table_memory_stays_under_its_cap_over_a_million_prompts():
    # Each prompt: a system prompt every pod serves, then its own block. The size estimate is checked
    # against tracemalloc above; here, that the cap holds it and LRU keeps the hot block.
    cap = 4 * 1024 * 1024
    table = PrefixTable(cap)
    pods = [("m", f"p{i}", f"10.0.0.{i}:1") for i in range(4)]
    system = -1
    for i in range(1_000_000):
        table.insert((system, i), pods[i & 3], 0.0)
        assert table.size_bytes <= cap
    assert table.size_bytes <= cap
    assert len(table) >= (cap - 3 * HOLDER_BYTES) // ENTRY_BYTES - 1  # full, not over-evicted
    assert table.match([system]) == {p: 1 for p in pods} and table.match([999_999]) == {pods[3]: 1}
    assert table.match([0]) == {}  # the oldest prompts are gone


def test_prefix_affinity_under_light_load_and_yields_when_the_affine_pod_is_overloaded():
    state = RoutingState.seeded(1)
    p = profile("prefix-cache", state)
    pods = [view("a", 1), view("b", 0), view("c", 2)]
    first = p.pick(chat(LONG + "q1"), pods, 0.0)
    p.hooks_of[0].post_choice(chat(LONG + "q1"), first, 0.0)
    for i in range(5):  # same long prefix: same pod, while its load stays ordinary
        request = chat(LONG + f"q{i}")
        assert p.pick(request, pods, 1.0).pod.name == first.pod.name
    busy = [replace(v, running=20 if v.pod.name == first.pod.name else 1) for v in pods]
    request = chat(LONG + "q9")
    elsewhere = p.pick(request, busy, 2.0)
    assert elsewhere.pod.name != first.pod.name
    p.hooks_of[0].post_choice(request, elsewhere, 2.0)  # ...which becomes affine too
    matched = p.hooks_of[0].table("m").match(p.hooks_of[0].hashes(chat(LONG + "q9")))
    assert {k[1] for k in matched} == {first.pod.name, elsewhere.pod.name}
    assert state.store["prefix-cache"].lookups["m"] == [6, 1]  # [matched (yielded or not), unmatched]


def test_prefix_cache_settings_are_validated():
    settings = parse_settings({"prefix_cache": {"block_tokens": 16}})
    assert settings.params["prefix_cache"] == PrefixCacheSettings(block_tokens=16)
    for bad in ({"block_tokens": 0}, {"table_bytes": "lots"}, {"blocks": 4}):
        with pytest.raises(SettingError, match="routing.prefix_cache"):
            parse_settings({"prefix_cache": bad})


def test_prefix_table_survives_a_reload():
    state = RoutingState.seeded(0)
    Router(RoutingSettings(), state).profile_for("prefix-cache", "m")
    cache = state.store["prefix-cache"]
    table = cache.table("m")
    table.insert([1, 2], ("m", "a", "10.0.0.1:1"), 0.0)
    Router(parse_settings({"prefix_cache": {"table_bytes": 1 << 20}}), state).profile_for("prefix-cache", "m")
    assert state.store["prefix-cache"] is cache and cache.table("m") is table
    assert table.max_bytes == 1 << 20 and len(table) == 2  # the new cap, the learned blocks kept


def test_a_pod_leaving_the_pool_leaves_the_prefix_table():
    from extproc.config import parse
    from extproc.server.gateway import Gateway

    def config(*names: str):
        pods = [{"name": n, "address": f"10.0.0.{i + 1}:8000"} for i, n in enumerate(names)]
        return parse({"models": {"m": {"pods": pods}}}, {})

    gw = Gateway(config("a", "b"))
    views = [PodView(pod) for pod in gw.pool.ready_pods("m")]
    request = chat(LONG + "q")
    cache = gw.router.state.store["prefix-cache"]
    gw.profile("prefix-cache", "m")  # a request asked for prefix-cache: its hooks are live
    cache.table("m")  # prefix-cache has routed this model: its hook records every later choice
    for chosen in views:  # both pods served the prefix
        gw.hooks.post_choice(request, chosen, 0.0)
    hashes = cache.hashes(request)
    assert set(cache.table("m").match(hashes)) == {v.pod.key for v in views}
    gw.apply(config("a"))
    assert set(cache.table("m").match(hashes)) == {views[0].pod.key}


# -- session-affinity --------------------------------------------------------------------------------

def test_a_session_keeps_its_pod_and_only_a_removed_pods_sessions_move():
    p = profile("session-affinity")
    pods = [view(f"p{i}") for i in range(8)]
    sessions = [f"user-{i}" for i in range(400)]
    before = {s: p.pick(replace(REQ, session_key=s), pods, 0.0).pod.name for s in sessions}
    assert all(p.pick(replace(REQ, session_key=s), pods, 1.0).pod.name == before[s] for s in sessions[:50])
    assert len(set(before.values())) == 8  # sessions spread over every pod
    fewer = [v for v in pods if v.pod.name != "p3"]  # gone or unhealthy: not a candidate
    after = {s: p.pick(replace(REQ, session_key=s), fewer, 2.0).pod.name for s in sessions}
    moved = [s for s in sessions if after[s] != before[s]]
    assert moved and all(before[s] == "p3" for s in moved)
    assert rendezvous("k", "p0") == rendezvous("k", "p0")  # the same on every gateway replica


def test_without_a_session_key_it_routes_as_load_balance():
    p = profile("session-affinity")
    pods = [view("slow", 4, capacity=1000.0), view("fast", 4, capacity=3000.0)]
    assert p.pick(REQ, pods, 0.0).pod.name == "fast"


def test_a_session_keeps_its_pod_as_the_header_routes_it_when_loads_differ():
    # A bare `session-affinity` header is auto-blended with load-balance and least-request: the pin
    # must hold although the session's pod is not the least loaded (loads below the imbalance gate).
    router = Router(RoutingSettings(), RoutingState.seeded(0))
    p = router.profile_for("session-affinity", "m")
    idle = [view("a"), view("b"), view("c")]
    busy = [view("a", 0), view("b", 2, kv_free=0.3), view("c", 4)]
    sessions = [f"user-{i}" for i in range(60)]
    pinned = {s: p.pick(replace(REQ, session_key=s), idle, 0.0).pod.name for s in sessions}
    assert set(pinned.values()) == {"a", "b", "c"}
    assert all(p.pick(replace(REQ, session_key=s), busy, 1.0).pod.name == pinned[s] for s in sessions)
    assert p.pick(REQ, busy, 1.0).pod.name == "a"  # no session: the load-aware choice


# -- power-of-two, least-kv-cache -------------------------------------------------------------------

@pytest.mark.parametrize("how", ["alone", "as the header routes it (auto-blended)"])
def test_power_of_two_takes_the_less_loaded_of_two_random_pods(how: str):
    if how == "alone":
        p = profile("power-of-two")
    else:
        p = Router(RoutingSettings(), RoutingState.seeded(0)).profile_for("power-of-two", "m")
    pods = [view("busy", 9, capacity=1000.0), view("idle", 0, capacity=1000.0)]
    assert {p.pick(REQ, pods, 0.0).pod.name for _ in range(50)} == {"idle"}
    many = [view(f"p{i}", i, capacity=1000.0) for i in range(10)]  # below the imbalance gate
    picks = [p.pick(REQ, many, 0.0).pod.name for _ in range(2000)]
    assert "p9" not in picks  # the most loaded pod never wins a pair
    # p_k wins the (9 - k) of the 45 pairs that hold a more loaded pod: 2000 x (9 - k)/45 expected
    # (400, 178, 44); bounds at ~4 standard deviations
    assert 330 < picks.count("p0") < 470 and 125 < picks.count("p5") < 230 and 15 < picks.count("p8") < 80


def test_power_of_two_draws_kv_critical_pods_only_when_little_else_is_left():
    p = profile("power-of-two")
    full = [view(f"full{i}", 0, kv_free=0.05) for i in range(6)]  # idle, but under kv_critical_free
    pods = [*full, view("ok1", 5), view("ok2", 6, kv_free=0.5)]
    assert {p.pick(REQ, pods, 0.0).pod.name for _ in range(50)} == {"ok1"}  # the better of the usable two
    assert {p.pick(REQ, pods[:6] + pods[7:], 0.0).pod.name for _ in range(20)} == {"ok2"}
    assert len({p.pick(REQ, pods[:6], 0.0).pod.name for _ in range(50)}) > 1  # all critical: still routes


def test_least_kv_cache_prefers_free_kv_and_fills_unreported():
    p = profile("least-kv-cache")
    assert p.pick(REQ, [view("full", kv_free=0.1), view("free", kv_free=0.8)], 0.0).pod.name == "free"
    assert p.pick(REQ, [view("quiet"), view("half", kv_free=0.5), view("most", kv_free=0.9)], 0.0).pod.name \
        == "most"


# -- least-latency, throughput ------------------------------------------------------------------------

def record(pod: Pod, ttfb: float, e2e: float, out: int, stream: bool = True) -> RequestRecord:
    return RequestRecord("r", "m", pod, "x", 200, 10, out, "usage", ttfb, e2e, stream=stream)


def test_least_latency_explores_then_prefers_the_fastest_for_the_shape():
    state = RoutingState.seeded(0)
    p = profile("least-latency", state)
    fast_ttft, fast_tpot = view("fast-start"), view("fast-decode")
    pods = [fast_ttft, fast_tpot, view("new")]
    model: LatencyModel = state.store["least-latency"]
    model.post_response(record(fast_ttft.pod, 0.05, 0.05 + 0.05 * 99, 100), 0.0)  # ttft .05, tpot .05
    model.post_response(record(fast_tpot.pod, 0.50, 0.50 + 0.02 * 99, 100), 0.0)  # ttft .5, tpot .02
    assert p.pick(REQ, pods, 0.0).pod.name == "new"  # never observed: tried first
    # ...while idle; once it has a request in flight it is an average pod, so traffic does not herd
    # onto it until its first answer arrives
    busy_new = [*pods[:2], view("new", 1)]
    assert p.pick(replace(REQ, max_tokens=4), busy_new, 0.0).pod.name == "fast-start"
    known = pods[:2]
    assert p.pick(replace(REQ, max_tokens=4), known, 0.0).pod.name == "fast-start"
    assert p.pick(replace(REQ, max_tokens=1000), known, 0.0).pod.name == "fast-decode"
    model.post_response(replace(record(fast_ttft.pod, 9.0, 9.0, 5), status=500), 0.0)  # failures: ignored
    assert model.ttft[fast_ttft.pod.key] == pytest.approx(0.05)


def test_throughput_prefers_the_pod_with_the_fewest_recent_tokens():
    state = RoutingState.seeded(0)
    p = profile("throughput", state)
    a, b = view("a"), view("b")
    recent = state.store["throughput"]
    recent.post_response(record(a.pod, 0.1, 1.0, 500), 0.0)
    recent.post_response(record(b.pod, 0.1, 1.0, 100), 0.0)
    assert p.pick(REQ, [a, b], 1.0).pod.name == "b"
    recent.post_response(record(b.pod, 0.1, 1.0, 1000), 9.0)
    assert p.pick(REQ, [a, b], 9.5).pod.name == "a"
    assert recent.rate(a.pod.key, 11.0) == 0.0  # out of the 10 s window


def test_throughput_window_stays_bounded_when_nobody_routes_by_it():
    recent = RecentTokens()
    pod = view("a").pod
    for i in range(10_000):  # 100 answers/s for 100 s, and never a throughput decision
        recent.post_response(record(pod, 0.1, 1.0, 10), i / 100)
    assert len(recent) <= 1001  # the last 10 s only
    assert recent.rate(pod.key, 99.99) == pytest.approx(100 * 10)


def test_every_new_strategy_blends_and_survives_validation():
    router = Router(RoutingSettings(), RoutingState.seeded(0))
    router.validate(["m"])
    pods = [view("a", 1, kv_free=0.5, capacity=100.0), view("b", 0, kv_free=0.9, capacity=200.0)]
    for name in ("prefix-cache", "session-affinity", "power-of-two", "least-latency", "least-kv-cache",
                 "throughput"):
        assert router.profile_for(f"{name}:3,load-balance:1", "m").pick(REQ, pods, 0.0) is not None


def test_requests_of_models_prefix_cache_never_scored_are_not_hashed():
    state = RoutingState.seeded(0)
    p = profile("prefix-cache", state)
    cache = state.store["prefix-cache"]
    request, pods = chat(LONG + "q"), [view("a"), view("b")]
    cache.post_choice(request, pods[0], 0.0)  # routed by another strategy before prefix-cache ran
    assert cache.tables == {} and cache._last[0] is None
    p.pick(request, pods, 1.0)
    cache.post_choice(request, pods[0], 1.0)
    assert len(cache.tables["m"]) > 0
