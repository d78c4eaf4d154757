"""Two gateway processes sharing one real redis-server: the same running counts, the same observed
capacity and the same fitted speed, even for a pod only one of them routes to, and for a gateway that
has just started; Redis going away never stops routing."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from extproc.localstack import LocalStack, wait_until
from extproc.optimizer.traces import read_windows
from extproc.optimizer.workload import trace_rates
from tests.integration.sim_fixtures import SimProcess, start_sim
from tests.support.redis_server import RedisServer
from tests.support.stack import running_stacks

MODEL = "llama2-7b"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say this is a test!"}]}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("multi-gateway")


@pytest.fixture(scope="module")
def redis(log_dir: Path) -> Iterator[list[RedisServer]]:
    box = [RedisServer(log_dir)]
    yield box
    box[0].stop()


@pytest.fixture(scope="module")
def sim(log_dir: Path) -> Iterator[SimProcess]:
    s = start_sim(["--gpu", "A100-80GB", "--model", MODEL, "--time-scale", "2"], log_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gateways(log_dir: Path, redis: list[RedisServer], sim: SimProcess) -> Iterator[list[LocalStack]]:
    env = {"EXTPROC_REDIS_URL": redis[0].url, "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": "true"}
    with running_stacks(log_dir, config(sim.port), env) as stacks:
        yield stacks


async def stream_through(stack: LocalStack, n: int, max_tokens: int) -> None:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0)

    async def one() -> None:
        stream = await c.chat.completions.create(stream=True, max_tokens=max_tokens, **CHAT)
        async for _ in stream:
            pass

    await asyncio.gather(*(one() for _ in range(n)))


def agree_on(a: LocalStack, b: LocalStack, metric: str) -> None:
    seen: list[tuple[float, float]] = [(0.0, 0.0)]

    def agree() -> bool:
        ca, cb = seen[-1] = (a.sample(metric, pod="a100-0"), b.sample(metric, pod="a100-0"))
        # 10 %: each gateway folds the shared counters in at its own sync phase, and an EWMA moving
        # with tau 10 s differs by ~5 % over a half-second offset; a gateway that shared nothing is at 0
        return ca > 0 and cb > 0 and abs(ca - cb) <= 0.10 * ca

    try:
        wait_until(agree, 30, f"both gateways learn the same {metric}")
    except TimeoutError as e:
        raise AssertionError(f"{metric} (a, b) last seen: {seen[-1]}") from e


async def test_gateways_routing_side_by_side_fit_the_same_speed(gateways: list[LocalStack]):
    """Two gateways routing at once fit the same speed (first in the module: same history)."""
    a, b = gateways
    wait_until(lambda: a.sample("extproc_redis_up") == 1 and b.sample("extproc_redis_up") == 1, 10, "redis up")
    await asyncio.gather(stream_through(a, 12, 100), stream_through(b, 12, 100))
    await asyncio.to_thread(agree_on, a, b, "extproc_pod_time_per_output_token_seconds")
    await asyncio.to_thread(wait_until, lambda: a.running(MODEL, "a100-0") == 0
                            and b.running(MODEL, "a100-0") == 0, 10, "running back to 0")


async def test_running_counts_and_capacity_are_shared(gateways: list[LocalStack]):
    a, b = gateways
    wait_until(lambda: a.sample("extproc_redis_up") == 1 and b.sample("extproc_redis_up") == 1, 10, "redis up")
    b_tallied = b.sample("extproc_output_tokens_total", pod="a100-0")  # by the test before
    load = asyncio.create_task(stream_through(a, 8, 400))  # long streams through gateway a only

    def both_see_eight() -> bool:
        return a.running(MODEL, "a100-0") == 8 and b.running(MODEL, "a100-0") == 8

    await asyncio.to_thread(wait_until, both_see_eight, 15, "8 running, seen by both gateways")
    assert b.sample("extproc_pod_local_running_requests", pod="a100-0") == 0
    await load
    await stream_through(a, 16, 100)

    # observed rate: shared token counters, so b learns it from a's traffic alone (EWMAs, tau 10 s)
    await asyncio.to_thread(agree_on, a, b, "extproc_pod_observed_tokens_per_second")
    assert b.sample("extproc_output_tokens_total", pod="a100-0") == b_tallied  # b tallied nothing itself
    await asyncio.to_thread(wait_until, lambda: a.running(MODEL, "a100-0") == 0
                            and b.running(MODEL, "a100-0") == 0, 10, "running back to 0")


def config(sim_port: int) -> dict:
    return {"models": {MODEL: {"pods": [{"name": "a100-0", "address": f"127.0.0.1:{sim_port}"}]}},
            "routing": {"default_strategy": "least-request"}}


async def test_a_gateway_that_routed_nothing_fits_on_the_fleets_records(gateways: list[LocalStack],
                                                                         redis: list[RedisServer],
                                                                         sim: SimProcess, log_dir: Path):
    """A gateway just started (scaled out, restarted) routes on what the others measured: the speed
    capacity of a pod it never routed to is within 5 % of the gateway that did, from the sums the
    gateways share through Redis (before: 107.7 against 3,973.6 tokens/s)."""
    a, _ = gateways
    d = log_dir / "fresh"
    d.mkdir()
    fresh = LocalStack(config_path=d / "gateway.yaml", log_dir=d, env={"EXTPROC_REDIS_URL": redis[0].url})
    fresh.write_config(config(sim.port))
    fresh.start_gateway()
    try:
        await asyncio.to_thread(wait_until, lambda: fresh.sample("extproc_redis_up") == 1, 10, "redis up")
        await stream_through(a, 16, 100)
        metric = "extproc_pod_capacity_tokens_per_second"
        seen: list[tuple[float, float]] = [(0.0, 0.0)]

        def agree() -> bool:
            ca, cf = seen[-1] = (a.sample(metric, pod="a100-0"), fresh.sample(metric, pod="a100-0"))
            return ca > 0 and abs(ca - cf) <= 0.05 * ca

        try:
            await asyncio.to_thread(wait_until, agree, 15, "the fresh gateway learns the pod's speed")
        except TimeoutError as e:
            raise AssertionError(f"{metric} (routing gateway, fresh gateway) last seen: {seen[-1]}") from e
        assert fresh.sample("extproc_output_tokens_total", pod="a100-0") == 0  # it routed nothing
    finally:
        fresh.stop()


async def test_redis_down_routing_continues_and_sharing_resumes(gateways: list[LocalStack],
                                                                redis: list[RedisServer], log_dir: Path):
    a, b = gateways
    redis[0].stop()
    await asyncio.to_thread(wait_until, lambda: a.sample("extproc_redis_up") == 0, 10, "redis down seen")
    await stream_through(a, 4, 20)  # routing does not depend on Redis
    await stream_through(b, 4, 20)
    redis[0] = RedisServer(log_dir, redis[0].port)
    await asyncio.to_thread(wait_until, lambda: a.sample("extproc_redis_up") == 1
                            and b.sample("extproc_redis_up") == 1, 20, "redis back")
    load = asyncio.create_task(stream_through(b, 5, 400))
    await asyncio.to_thread(wait_until, lambda: a.running(MODEL, "a100-0") == 5, 15, "sharing resumed")
    await load


async def test_request_traces_reach_redis_in_aibrix_format(gateways: list[LocalStack], redis: list[RedisServer]):
    import json

    from redis import asyncio as aioredis

    await stream_through(gateways[0], 3, 8)
    client = aioredis.Redis.from_url(redis[0].url)
    try:
        async def traces() -> list[bytes]:
            return [k async for k in client.scan_iter(match=f"aibrix:{MODEL}_request_trace_*")]

        deadline = asyncio.get_running_loop().time() + 20  # a 10 s window must close first
        keys = await traces()
        while not keys and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
            keys = await traces()
        assert keys, "no request trace written"
        values = [json.loads(await client.get(k)) for k in keys]
        assert sum(v["meta_total_reqs"] for v in values) >= 3
        assert all(v["meta_v"] == 4 and v["meta_interval_sec"] == 10 for v in values)
        assert 0 < await client.ttl(keys[0]) <= 600
    finally:
        await client.aclose()


async def test_both_gateways_traces_add_up_to_every_request_sent(gateways: list[LocalStack],
                                                                 redis: list[RedisServer]):
    """Requests through both gateways in one fresh window: the windows in Redis, and the optimizer's rate,
    count all of them (each gateway merges its window in; before, the last writer's share won)."""
    from redis import asyncio as aioredis

    a, b = gateways
    await asyncio.to_thread(wait_until, lambda: a.sample("extproc_redis_up") == 1
                            and b.sample("extproc_redis_up") == 1, 20, "redis up")
    start = math.ceil(time.time() / 10) * 10  # earlier tests' requests are all in windows before this
    await asyncio.to_thread(wait_until, lambda: time.time() >= start, 11, "a fresh trace window")
    await asyncio.gather(stream_through(a, 5, 8), stream_through(b, 7, 8))
    sent = 12
    client = aioredis.Redis.from_url(redis[0].url)
    window_s = 240.0
    try:
        seen: list[tuple[int, int]] = []
        deadline = asyncio.get_running_loop().time() + 30  # the window closes, then each gateway flushes
        while asyncio.get_running_loop().time() < deadline:
            windows = await read_windows(client, MODEL, time.time() + 10, window_s)
            windows = [w for w in windows if w.end > start]
            seen.append((sum(w.arrived for w in windows), sum(w.completed for w in windows)))
            if seen[-1] == (sent, sent):
                break
            await asyncio.sleep(0.2)
        assert seen and seen[-1] == (sent, sent), f"(arrived, completed) in Redis, last seen {seen[-1:]}"
        later = max(w.end for w in windows) + 30.0  # the average: the burst rule aside
        rates = trace_rates(windows, later, window_s)
        covered = later - (min(w.end for w in windows) - 10)  # what the windows cover, < window_s
        assert sum(d.rps for d in rates) * covered == pytest.approx(sent)
    finally:
        await client.aclose()
