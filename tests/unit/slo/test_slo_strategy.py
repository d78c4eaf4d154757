"""The slo* strategies on hand-built pools, and the gateway queue: dispatch on completion, urgency,
rejection (breached, full) with Retry-After, a cancelled wait leaving the queue at once."""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

from extproc import admission
from extproc.config import ConfigError, parse
from extproc.gpu_profiles import parse_profile
from extproc.openai import Request
from extproc.pool import Pod
from extproc.routing import PodView, RoutingSettings, RoutingState, build
from extproc.routing.outcome import Queued, Rejected
from extproc.server.gateway import Gateway
from extproc.server.processor import Stream
from extproc.server.traces import TraceHooks
from extproc.slo.live_room import RetryLater, SloRoom
from extproc.slo.waiting import SLO_WAITING
from extproc.tracing.window import TraceRecorder
from extproc.vocabulary import RequestEnd


def profile(name: str, tput: float, e2e: float, target: float = 10.0, tput_long: float | None = None):
    """2x2 grid (outputs 8, 256; inputs 128, 1024); `tput_long` for the long-output row."""
    long = tput if tput_long is None else tput_long
    return parse_profile({"gpu": name, "cost": 1.0, "tputs": [[tput, tput], [long, long]],
                          "indexes": [[8, 256], [128, 1024]], "e2e": [[e2e, e2e], [e2e, e2e]],
                          "slos": {"percentile": 99, "e2e": target}, "created": 1.0})


FAST = profile("fast", tput=10, e2e=0.5)    # consumption 0.2
SLOW = profile("slow", tput=2, e2e=1.0, tput_long=0)      # consumption 0.5; cannot serve long outputs


def pod(name: str, deployment: str) -> Pod:
    return Pod("m", name, f"10.0.0.{len(name) + hash(name) % 200 + 1}:8000", deployment=deployment)


def req(max_tokens: int = 8, prompt: int = 128) -> Request:
    return Request(model="m", path="/v1/chat/completions", prompt_tokens=prompt, max_tokens=max_tokens)


@pytest.fixture
def routing():
    state = RoutingState.seeded(1)
    settings = RoutingSettings()
    strategies = {n: build(n, settings, state, "m")
                  for n in ("slo", "slo-pack-load", "slo-least-load", "slo-least-load-pulling")}
    slo = state.store["slo"]
    slo.set_profiles("m", {"fast": FAST, "slow": SLOW})
    return strategies, slo


def views(**running) -> list[PodView]:
    pods = {"fast0": pod("fast0", "fast"), "fast1": pod("fast1", "fast"), "slow0": pod("slow0", "slow")}
    return [PodView(pods[n], running=running.get(n, 0)) for n in pods]


def test_variants_choose_by_utilization(routing):
    s, _ = routing
    pool = views(fast0=3, fast1=1)   # utilizations 0.6, 0.2, 0 (unseen requests count as this one)
    assert s["slo-least-load"].pick(req(), pool, 0).pod.name == "slow0"        # lowest utilization
    assert s["slo-pack-load"].pick(req(), pool, 0).pod.name == "fast0"         # 0.8 ≤ 1, the fullest
    assert s["slo-least-load-pulling"].pick(req(), pool, 0).pod.name == "fast1"  # lowest util + cons: 0.4


def test_unsuitable_type_is_never_chosen(routing):
    s, _ = routing
    long = req(max_tokens=256)                   # slow's tput is 0 for long outputs
    pool = views(fast0=4, fast1=4)
    for name in ("slo", "slo-pack-load", "slo-least-load", "slo-least-load-pulling"):
        assert s[name].pick(long, pool, 0).pod.deployment == "fast"


def test_nothing_fits(routing):
    s, _ = routing
    pool = views(fast0=5, fast1=5, slow0=2)      # 1.0 + 0.2 and 1.0 + 0.5: over capacity everywhere
    wait = s["slo-least-load-pulling"].pick(req(), pool, 0)
    assert type(wait) is Queued
    assert wait.entry.deadline == pytest.approx(min(60.0, 10 - 0.5))  # the most relaxed: fast
    assert s["slo-pack-load"].pick(req(), pool, 0).pod.deployment == "fast"  # least over after placing
    assert s["slo-least-load"].pick(req(), pool, 0).pod.name in ("fast0", "fast1", "slow0")


def test_breached_on_arrival_is_rejected(routing):
    s, slo = routing
    slo.set_profiles("m", {"fast": profile("fast", 10, 0.5, target=0.4)})   # expected 0.5 > target
    rej = s["slo-least-load-pulling"].pick(req(), views(fast0=5, fast1=5), 0)
    assert type(rej) is Rejected
    assert rej.reason == "slo_breached"
    assert rej.deployments == {"fast"}  # the deployment that could have served it: a miss of its plan


def test_a_tpat_slo_waits_its_slack_over_every_token_of_the_request(routing):
    # TPAT 2 ms, e2e 0.5 s: a 1,024-token prompt with an 8-token answer expects 0.5 / 1032 a token, so
    # it may wait (2 ms - 0.48 ms) x 1032 tokens; read per output token (62 ms) it was refused at once
    s, slo = routing
    tpat = parse_profile({"gpu": "fast", "cost": 1.0, "tputs": [[10, 10], [10, 10]],
                          "indexes": [[8, 256], [128, 1024]], "e2e": [[0.5, 0.5], [0.5, 0.5]],
                          "slos": {"percentile": 99, "tpat": 0.002}, "created": 1.0})
    slo.set_profiles("m", {"fast": tpat})
    wait = s["slo-least-load-pulling"].pick(req(prompt=1024), views(fast0=5, fast1=5), 0)
    assert type(wait) is Queued
    assert wait.entry.deadline == pytest.approx((0.002 - 0.5 / 1032) * 1032)


def test_without_profiles_load_balance_routes(routing):
    s, slo = routing
    slo.tables.clear()
    for name in s:
        assert s[name].pick(req(), views(fast0=2, slow0=1), 0).pod.name == "fast1"


def test_predictor_fed_by_completions_changes_the_cell(routing):
    s, slo = routing
    pool = views()
    chosen = s["slo-least-load-pulling"].pick(req(max_tokens=None), pool, 0)
    assert slo.signature(req(max_tokens=None), 0).output_tokens == 256   # default, no history
    from extproc.vocabulary import RequestRecord
    for _ in range(3):
        slo.post_response(RequestRecord("r", "m", chosen.pod, "slo", 200, 128, 8, "usage", 0.1, 0.5), 1.0)
    assert slo.signature(req(max_tokens=None), 2.0).output_tokens == 8


def test_a_shape_a_pod_serves_only_alone_takes_an_idle_pod(routing):
    s, slo = routing
    # tput x e2e = 0.25 x 2 = 0.5 < 1: at the SLO rate a pod holds such requests one at a time
    slo.set_profiles("m", {"fast": profile("fast", tput=0.25, e2e=2.0)})
    assert slo.consumption(req(), pod("fast0", "fast"), 0) == 1.0
    assert s["slo-least-load-pulling"].pick(req(), views(fast0=1), 0).pod.name == "fast1"  # idle, not a wait
    assert type(s["slo-least-load-pulling"].pick(req(), views(fast0=1, fast1=1), 0)) is Queued


def test_the_request_that_finishes_takes_its_own_consumption_away(routing):
    from extproc.vocabulary import RequestRecord
    _, slo = routing
    fast0 = pod("fast0", "fast")
    long, short = req(max_tokens=256), req(max_tokens=8)
    slo.set_profiles("m", {"fast": profile("fast", tput=10, e2e=0.5, tput_long=4)})  # 0.2, 0.5
    slo.post_choice(long, PodView(fast0), 0)    # routed first, finishes last
    slo.post_choice(short, PodView(fast0), 0)
    assert slo.utilization(fast0, 2, 0.0) == pytest.approx(0.7)
    slo.post_response(RequestRecord("s", "m", fast0, "slo", 200, 128, 8, "usage", 0.1, 0.5, request=short), 1)
    assert slo.utilization(fast0, 1, 0.0) == pytest.approx(0.5)  # the long one's, not the short one's


def test_config_validates_slo_keys():
    with pytest.raises(ConfigError, match="routing.slo.max_queuee"):
        parse({"models": {"m": {"pods": []}}, "routing": {"slo": {"max_queuee": 1}}}, {})
    with pytest.raises(ConfigError, match="max_wait_seconds"):
        parse({"models": {"m": {"pods": []}}, "routing": {"slo": {"max_wait_seconds": 10_000}}}, {})


# -- the live queue ------------------------------------------------------------------------------

def gateway(max_queue: int = 4, max_wait: float = 5.0) -> tuple[Gateway, SloRoom]:
    cfg = {"models": {"m": {"pods": [{"name": "fast0", "address": "10.0.0.1:8000", "deployment": "fast"}]}},
           "routing": {"default_strategy": "slo",
                       "slo": {"max_queue": max_queue, "max_wait_seconds": max_wait}}}
    gw = Gateway(parse(cfg, {}))
    room = SloRoom(gw)
    room.state.set_profiles("m", {"fast": profile("fast", tput=2, e2e=1.0)})   # consumption 0.5
    return gw, room


async def admitted_wait(room: SloRoom, request, profile_, request_id: str, queued: Queued):
    """What the stream does with a Queued outcome: admission, then wait or a 429."""
    admitted = admission.admit(queued, room)
    if isinstance(admitted, Rejected):
        raise room.reject(request.model, admitted)
    return await room.wait(request, profile_, request_id, admitted)


async def poll(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_queued_request_is_dispatched_when_a_completion_frees_capacity():
    async def main():
        gw, room = gateway()
        profile_ = gw.profile(None, "m")
        d1 = gw.route(req(), profile_, "r1")
        gw.route(req(), profile_, "r2")                        # utilization 1.0 now
        wait = gw.route(req(), profile_, "r3")
        assert type(wait) is Queued
        task = asyncio.create_task(admitted_wait(room, req(), profile_, "r3", wait))
        await poll(lambda: room.state.queues.length("m") == 1)
        assert not task.done()
        # a new arrival queues behind it, it does not overtake
        assert type(gw.route(req(), profile_, "r4")) is Queued
        gw.complete(d1.key, RequestEnd(200, prompt_tokens=128, output_tokens=8))
        decision = await asyncio.wait_for(task, 5)
        assert decision.pod.name == "fast0" and room.state.queues.length("m") == 0
        assert len(gw.open) == 2
        assert gw.registry.get_sample_value("extproc_slo_queue_wait_seconds_count",
                                            {"model": "m", "outcome": "dispatched"}) == 1
    asyncio.run(main())


def test_most_urgent_is_dispatched_first():
    async def main():
        gw, room = gateway()
        p = gw.profile(None, "m")
        d1 = gw.route(req(), p, "r1")
        gw.route(req(), p, "r2")
        entries = []
        for rid, r in (("relaxed", req(max_tokens=8)), ("urgent", req(max_tokens=8))):
            w = p.pick(r, gw.views("m", gw.clock()), gw.clock())
            assert type(w) is Queued
            entries.append((rid, r, w))
        entries[1][2].entry.slack = -100.0    # the second arrival is far more urgent (own sub-queue)
        entries[1][2].entry.key = "other"
        tasks = {rid: asyncio.create_task(admitted_wait(room, r, p, rid, e)) for rid, r, e in entries}
        await poll(lambda: room.state.queues.length("m") == 2)
        gw.complete(d1.key, RequestEnd(200, prompt_tokens=128, output_tokens=8))
        await poll(lambda: any(t.done() for t in tasks.values()))
        assert tasks["urgent"].done() and not tasks["relaxed"].done()
        tasks["relaxed"].cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    asyncio.run(main())


def test_breached_while_waiting_and_full_queue_get_429():
    async def main():
        gw, room = gateway(max_queue=1, max_wait=0.2)
        recorder = TraceRecorder()
        gw.add_hook(TraceHooks(recorder, lambda: 1_700_000_005.0))  # the optimizer's traces hear of them
        p = gw.profile(None, "m")
        gw.route(req(), p, "r1")
        gw.route(req(), p, "r2")
        w1 = gw.route(req(), p, "r3")
        assert type(w1) is Queued
        first = asyncio.create_task(admitted_wait(room, req(), p, "r3", w1))
        await poll(lambda: room.state.queues.length("m") == 1)
        w2 = gw.route(req(), p, "r4")
        assert type(w2) is Queued
        with pytest.raises(RetryLater) as full:
            await admitted_wait(room, req(), p, "r4", w2)
        assert full.value.status == 429 and full.value.code == "queue_full" and full.value.retry_after >= 1
        with pytest.raises(RetryLater) as breached:
            await asyncio.wait_for(first, 5)
        assert breached.value.code == "slo_breached"
        assert room.state.queues.length("m") == 0
        for reason in ("queue_full", "slo_breached"):
            assert gw.registry.get_sample_value("extproc_slo_rejections_total",
                                                {"model": "m", "reason": reason}) == 1
        [(_, raw)] = recorder.due(1_700_000_010.0)
        assert json.loads(raw)["meta_rejected"] == {"fast": 2}  # both refusals, the deployment's misses
        assert json.loads(raw)["meta_total_reqs"] == 4  # the refused arrived too: offered load
    asyncio.run(main())


def test_a_held_request_counts_as_arriving_once_when_it_arrived():
    """The optimizer's traces count a request held in the SLO queue in the window it arrived in, not
    again nor later when it leaves the queue: a queue draining onto new replicas is not more load."""
    async def main():
        gw, room = gateway()
        recorder = TraceRecorder()
        wall = [1_700_000_005.0]
        gw.add_hook(TraceHooks(recorder, lambda: wall[0]))
        p = gw.profile(None, "m")
        d1 = gw.route(req(), p, "r1")
        gw.route(req(), p, "r2")
        w = gw.route(req(), p, "r3")
        assert type(w) is Queued
        task = asyncio.create_task(admitted_wait(room, req(), p, "r3", w))
        await poll(lambda: room.state.queues.length("m") == 1)
        wall[0] = 1_700_000_015.0  # the next window: r1 ends, r3 leaves the queue
        gw.complete(d1.key, RequestEnd(200, prompt_tokens=128, output_tokens=8))
        await asyncio.wait_for(task, 5)
        windows = {key: json.loads(raw) for key, raw in recorder.due(1_700_000_020.0)}
        assert [w["meta_total_reqs"] for _, w in sorted(windows.items())] == [3, 0]
    asyncio.run(main())


def test_cancelled_wait_leaves_the_queue_at_once():
    async def main():
        gw, room = gateway()
        p = gw.profile(None, "m")
        gw.route(req(), p, "r1")
        gw.route(req(), p, "r2")
        w = gw.route(req(), p, "r3")
        assert type(w) is Queued
        task = asyncio.create_task(admitted_wait(room, req(), p, "r3", w))
        await poll(lambda: room.state.queues.length("m") == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert room.state.queues.length("m") == 0
        assert gw.registry.get_sample_value("extproc_slo_queue_length", {"model": "m"}) == 0
        assert len(gw.open) == 2   # nothing routed for the cancelled one
    asyncio.run(main())


def _headers() -> ProcessingRequest:
    pairs = {":path": "/v1/chat/completions", ":method": "POST", "x-request-id": "q"}
    return ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])))


def _body() -> ProcessingRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return ProcessingRequest(request_body=HttpBody(body=json.dumps(body).encode(), end_of_stream=True))


def test_stream_waits_then_gets_429_with_retry_after():
    async def main():
        gw, room = gateway(max_wait=0.1)
        p = gw.profile(None, "m")
        gw.route(req(), p, "r1")
        gw.route(req(), p, "r2")
        stream = Stream(gw, {SLO_WAITING: room})
        stream.handle(_headers())
        assert stream.handle(_body()) is None and stream.queued
        reply = await asyncio.wait_for(stream.wait_queued(), 5)
        imm = reply.immediate_response
        headers = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
        assert imm.status.code == 429 and headers["retry-after"] == "1"
        assert json.loads(imm.body)["error"]["code"] == "slo_breached"
        assert stream.finished
    asyncio.run(main())


def test_stream_matches_admission_full_room_429_and_no_room_500():
    async def main():
        gw, room = gateway(max_queue=1)
        p = gw.profile(None, "m")
        gw.route(req(), p, "r1")
        gw.route(req(), p, "r2")  # both pods busy: the next requests are held back
        first = Stream(gw, {SLO_WAITING: room})
        first.handle(_headers())
        assert first.handle(_body()) is None and first.queued  # admitted: the queue holds one
        second = Stream(gw, {SLO_WAITING: room})
        second.handle(_headers())
        imm = second.handle(_body()).immediate_response  # refused by the room at once, no wait
        assert imm.status.code == 429 and json.loads(imm.body)["error"]["code"] == "queue_full"
        assert not second.queued and second.finished
        lost = Stream(gw, {})  # a strategy that holds requests back, and nobody built its room
        lost.handle(_headers())
        imm = lost.handle(_body()).immediate_response
        assert imm.status.code == 500 and json.loads(imm.body)["error"]["type"] == "server_error"
    asyncio.run(main())
