"""Through real Envoy: Envoy SIGKILLed with streams open and started again. Its access-log records of
those streams never come; the gateway holds its count against the engine's own and releases them
within seconds, not after gateway.request_timeout_seconds (an hour). And Envoy restarted gracefully
(drained, then SIGTERM): every record arrives, nothing needs releasing, the tally is exact. And
Envoy killed and back within half a second while clients keep streaming, with one gateway or two
sharing counts through Redis: counts true again within seconds."""

from __future__ import annotations

import asyncio
import signal
import statistics
import time
from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.localstack import LocalStack, http_get, wait_until
from tests.integration.sim_fixtures import start_sim
from tests.support.redis_server import RedisServer
from tests.support.stack import envoy_in_front_of, start_envoy_at
from tests.support.traffic import Load, chat, engine_tokens, request

MODEL = "llama2-7b"
STREAMS = 10


@pytest.fixture
def stack(tmp_path) -> Iterator[tuple[LocalStack, object]]:
    sim = start_sim(["--gpu", "A100-80GB", "--model", MODEL], tmp_path)
    s = LocalStack(config_path=tmp_path / "gateway.yaml", log_dir=tmp_path)
    s.write_config({"models": {MODEL: {"pods": [
        {"name": "a100-0", "address": f"127.0.0.1:{sim.port}", "labels": {"gpu": "A100"}}]}},
        "telemetry": {"refresh_seconds": 0.5}})
    s.start_gateway()
    s.start_envoy()
    yield s, sim
    s.stop()
    sim.stop()


async def test_envoy_sigkill_with_streams_open_releases_the_lost_counts_within_seconds(stack):
    s, sim = stack
    tallied, generated = s.sample("extproc_output_tokens_total"), engine_tokens([sim.url])
    body = chat(MODEL, 600, stream=True)
    async with aiohttp.ClientSession() as session:
        responses = [await session.post(s.url + "/v1/chat/completions", json=body) for _ in range(STREAMS)]
        for resp in responses:
            assert resp.status == 200
            await resp.content.readline()  # streaming: the engine holds it
        wait_until(lambda: s.running(MODEL, "a100-0") == STREAMS, what="ten streams counted")
        s.envoy.stop(signal.SIGKILL)
        for resp in responses:  # the client sees its stream cut
            with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                                aiohttp.ClientConnectionError)):
                await asyncio.wait_for(resp.read(), 30)
    killed = time.monotonic()
    s.start_envoy()
    wait_until(lambda: s.running(MODEL, "a100-0") == 0, timeout=20, what="phantom streams released")
    took = time.monotonic() - killed
    # the bound: the truth within 5 s (3 s grace, then three scrapes 0.5 s apart)
    assert took < 5, f"counts back to the truth {took:.1f} s after the kill"
    print(f"counts back to the truth {took:.1f} s after the kill")
    assert s.sample("extproc_released_requests_total", cause="engine_count") == STREAMS
    # Tally: the lost records' tokens are missing, nothing is counted twice.
    assert s.sample("extproc_output_tokens_total") - tallied < engine_tokens([sim.url]) - generated
    # The new Envoy routes, and its requests are counted and released as usual.
    async with aiohttp.ClientSession() as session:
        tallied, generated = s.sample("extproc_output_tokens_total"), engine_tokens([sim.url])
        resp = await session.post(s.url + "/v1/chat/completions",
                                  json={**body, "stream": False, "max_tokens": 5})
        assert resp.status == 200
    wait_until(lambda: s.running(MODEL, "a100-0") == 0, what="the new request released by its record")
    wait_until(lambda: tally(s) - tallied == engine_tokens([sim.url]) - generated, what="its tokens tallied")


async def test_envoy_graceful_restart_loses_no_record(stack):
    """Drain (as a rollout's preStop does), the streams finish while load goes on, the load moves away,
    SIGTERM, start again: every request's record arrives; nothing is left to release."""
    s, sim = stack
    tallied, generated = s.sample("extproc_output_tokens_total"), engine_tokens([sim.url])
    load = Load([s.url], chat(MODEL, 4)).start()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        streams = [asyncio.create_task(request(session, s.url, chat(MODEL, 150, True)))
                   for _ in range(STREAMS)]
        await asyncio.to_thread(wait_until, lambda: s.running(MODEL, "a100-0") >= STREAMS, 10,
                                "streams counted")
        admin = f"http://127.0.0.1:{s.envoy_admin_port}"
        await asyncio.to_thread(_post, admin + "/drain_listeners?graceful")
        ends = await asyncio.gather(*streams)
        outcomes = await load.stop()  # the load balancer takes this Envoy out
    assert {e for e, _ in ends} == {"done"} and set(outcomes) == {"200"}, (ends, outcomes)
    await asyncio.to_thread(wait_until, lambda: s.running(MODEL, "a100-0") == 0, 5, "every record in")
    assert s.envoy is not None
    assert s.envoy.stop(signal.SIGTERM) == 0
    s.start_envoy()
    async with aiohttp.ClientSession() as session:
        assert (await request(session, s.url, chat(MODEL, 5)))[0] == "200"
    wait_until(lambda: s.running(MODEL, "a100-0") == 0, 5, "the new Envoy's request released")
    assert s.sample("extproc_released_requests_total") == 0
    wait_until(lambda: tally(s) - tallied == engine_tokens([sim.url]) - generated, 5, "the tally exact")


def tally(s: LocalStack) -> float:
    return s.sample("extproc_output_tokens_total")


def _post(url: str) -> None:
    import urllib.request
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5) as resp:
        assert resp.status == 200



# -- a fast restart while the load goes on (issue 33) ------------------------------------------------

CLIENTS, ANSWER_TOKENS = 20, 200
GAP_S, WATCH_S, SETTLED_S = 0.5, 20.0, 10.0
MISTAKES_TWO_GATEWAYS = 6  # real requests released by mistake, of the ~480 in the run (measured 0-5)


@pytest.fixture
def fleet(tmp_path, request) -> Iterator[tuple[list[LocalStack], object]]:
    """One engine; `request.param` gateway processes (two share counts through a real redis-server),
    all on the default 1 s scrape; no Envoy yet."""
    sim = start_sim(["--gpu", "A100-80GB", "--model", MODEL], tmp_path)
    redis = RedisServer(tmp_path) if request.param > 1 else None
    gateways = []
    try:
        for i in range(request.param):
            d = tmp_path / f"gateway-{i}"
            d.mkdir()
            g = LocalStack(config_path=d / "gateway.yaml", log_dir=d,
                           env={"EXTPROC_REDIS_URL": redis.url} if redis else {})
            g.write_config({"models": {MODEL: {"pods": [
                {"name": "a100-0", "address": f"127.0.0.1:{sim.port}"}]}}})
            gateways.append(g)
            g.start_gateway()
        yield gateways, sim
    finally:
        for g in gateways:
            g.stop()
        if redis is not None:
            redis.stop()
        sim.stop()


def engine_holds(url: str) -> float:
    """The engine's own count: vllm:num_requests_running + num_requests_waiting."""
    text = http_get(url + "/metrics")[1].decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))


def counts(gateways: list[LocalStack], engine_url: str) -> tuple[list[float], float]:
    return [g.running(MODEL, "a100-0") for g in gateways], engine_holds(engine_url)


async def watch(gateways: list[LocalStack], engine_url: str, seconds: float) -> list[tuple]:
    """(seconds from now, each gateway's count for the pod, the engine's) about 4 times a second."""
    start, seen = time.monotonic(), []
    while (t := time.monotonic() - start) < seconds:
        seen.append((t, *await asyncio.to_thread(counts, gateways, engine_url)))
        await asyncio.sleep(0.25)  # the sampling period
    return seen


def excess(seen: list[tuple], after: float = 0.0) -> list[float]:
    """Each gateway's count less the engine's, at every sample from `after` s on."""
    return [g - engine for t, gws, engine in seen if t >= after for g in gws]


def true_for_good(seen: list[tuple]) -> float:
    """When the counts became true for good: the median excess of every second from then on within 1."""
    def true_from(t: float) -> bool:
        return all(abs(statistics.median(excess([x for x in seen if u <= x[0] < u + 1]))) <= 1
                   for u, *_ in seen if u >= t)
    return next((t for t, *_ in seen if true_from(t)), WATCH_S)


@pytest.mark.parametrize("fleet", [1, 2], ids=["one-gateway", "two-gateways-redis"], indirect=True)
async def test_envoy_killed_and_back_in_half_a_second_under_load_counts_true_within_10s(fleet, tmp_path):
    """20 clients stream 200-token answers one after another throughout; Envoy SIGKILLed and started
    again 0.5 s later. Its access-log records of the 20 open streams are lost. From 10 s after Envoy
    is back, every gateway's count for the pod matches the engine's own as well as before the kill
    (compared 4 times a second for 20 s; a single read may catch a few requests between the two
    reads, or a record on its way)."""
    gateways, sim = fleet
    bootstrap, listen = envoy_in_front_of(gateways)
    envoy = start_envoy_at(bootstrap, listen, tmp_path)
    url = f"http://127.0.0.1:{listen}"
    try:
        load = Load([url] * CLIENTS, chat(MODEL, ANSWER_TOKENS, stream=True)).start()
        await asyncio.to_thread(wait_until, lambda: counts(gateways, sim.url) == ([CLIENTS] * len(gateways),
                                                                                  CLIENTS), 30, "load steady")
        before = await watch(gateways, sim.url, 5)
        envoy.stop(signal.SIGKILL)
        await asyncio.sleep(GAP_S)  # the fault itself: how long Envoy stays down
        envoy = await asyncio.to_thread(start_envoy_at, bootstrap, listen, tmp_path)
        seen = await watch(gateways, sim.url, WATCH_S)
        outcomes = await load.stop()
        # before Envoy stops (a SIGTERM loses the access-log records it has not sent yet)
        await asyncio.to_thread(wait_until, lambda: counts(gateways, sim.url) == ([0] * len(gateways), 0), 10,
                                "every record in")
    finally:
        envoy.stop()
    # whole, in the captured output a failure shows (pytest cuts an assertion's message short): seconds
    # from Envoy's restart (before the kill: negative), each gateway's count for the pod, the engine's
    trace = "\n".join(f"{t:5.1f} {gws} {engine}"
                      for t, gws, engine in [(t - 5.0, g, e) for t, g, e in before] + seen)
    print(trace)
    late, calm = excess(seen, SETTLED_S), excess(before)
    mean, baseline = sum(late) / len(late), sum(calm) / len(calm)
    assert mean < baseline + 1, (mean, baseline)  # the issue measured +20.2 (+0.4 without the fault)
    assert statistics.median(abs(e) for e in late) <= 1
    settled = true_for_good(seen)
    released = sum(g.sample("extproc_released_requests_total", cause="engine_count") for g in gateways)
    # A record that found nothing open, here or (passed on through Redis) at the gateway that routed
    # it: a real request released.
    wrong = sum(g.sample("extproc_unmatched_access_logs_total")
                - g.sample("extproc_peer_access_logs_total", direction="released") for g in gateways)
    # Released: the 20 streams open at the kill, and any request whose record died with Envoy too (one
    # that had ended, its record still in Envoy's buffer, or a client's next one routed but not yet
    # sent on): at most one more per client. A real one only by mistake: none with one gateway; with
    # two, the counts they share through Redis are a sync or two behind, and the excess right after
    # the restart can be overestimated by a few (each such request counted one low until it ends).
    assert CLIENTS <= released <= 2 * CLIENTS, released
    assert wrong <= (0 if len(gateways) == 1 else MISTAKES_TWO_GATEWAYS), wrong
    assert outcomes["done"] > 0 and set(outcomes) <= {"done", "cut", "refused"}, outcomes
    print(f"{len(gateways)} gateway(s): counts true {settled:.1f} s after Envoy was back; mean excess "
          f"from {SETTLED_S:g} s {mean:+.2f} (before the kill {baseline:+.2f}); released {released:g}, "
          f"real ones {wrong:g}; clients {dict(outcomes)}")
