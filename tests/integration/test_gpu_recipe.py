"""docs/optimizer.md "From benchmark to plan on your GPUs", walked end to end on live parts: two GPU types
(engine-sims standing in for the vLLM Deployments), each benchmarked and profiled with the real commands
and the profiles stored in a real redis-server; two gateways behind real Envoys route traffic with the
`slo` strategy on those profiles and write their traces to Redis; `extproc optimizer` (the service)
reads both and serves a plan per Deployment that covers the load sent."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis as redis_client
import yaml
from scipy.optimize import linprog

from extproc.gpu_profiles import GpuProfile, parse_profile
from extproc.localstack import VENV_BIN, LocalStack, Proc, free_port, http_get, wait_until
from extproc.profiling.plan import LoadPlan
from extproc.profiling.workload import prompt_text
from extproc.slo.fleet_factors import factors_key, ttl_seconds
from tests.integration.sim_fixtures import SimProcess, start_sim
from tests.support.recipe import profile_gpu
from tests.support.redis_server import RedisServer
from tests.support.stack import running_stacks

pytestmark = pytest.mark.integration

MODEL = "llama2-7b"
SCALE = "10"  # simulated seconds per wall second: the whole walk in well under a minute
# Deployment -> (engine-sim GPU preset, cost per replica)
TYPES = {"llama2-7b-a100": ("A100-80GB", 2.0), "llama2-7b-v100": ("V100", 1.0)}
PLAN = LoadPlan(input_lens=(128, 1024), output_lens=(32,), rates=(16.0, 64.0), num_prompts=16)
SLO = ["--tpot", "0.02", "--percentile", "99"]  # wall seconds at SCALE: 0.2 s of model time
LOAD = {128: 12.0, 1024: 3.0}  # prompt tokens -> requests/s sent through the gateways, 32 tokens each
REPLICAS = re.compile(r"^vllm:deployment_replicas\{model_name=\"llama2-7b\"\} (\d+)$", re.M)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpu-recipe")


@pytest.fixture(scope="module")
def redis(log_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer(log_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sims(log_dir: Path) -> Iterator[dict[str, SimProcess]]:
    started: dict[str, SimProcess] = {}
    try:
        for deployment, (gpu, _) in TYPES.items():
            started[deployment] = start_sim(["--gpu", gpu, "--model", MODEL, "--time-scale", SCALE], log_dir)
        yield started
    finally:
        for sim in started.values():
            sim.stop()


def gateway_config(sims: dict[str, SimProcess]) -> dict:
    pods = [{"name": f"{d}-0", "address": f"127.0.0.1:{sim.port}", "deployment": d}
            for d, sim in sims.items()]
    return {"models": {MODEL: {"pods": pods}}, "routing": {"default_strategy": "slo"}}


def send_load(stacks: list[LocalStack], seconds: float, stop: threading.Event) -> list[int]:
    """LOAD for `seconds` (or until `stop`), evenly spaced, alternating gateways; the statuses."""
    async def run() -> list[int]:
        clients = [openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="sk-test", max_retries=0)
                   for s in stacks]
        rng = random.Random(0)
        statuses: list[int] = []

        async def one(k: int, tokens: int) -> None:
            try:
                stream = await clients[k % len(clients)].completions.create(
                    model=MODEL, prompt=prompt_text(tokens, rng), max_tokens=32, stream=True,
                    extra_body={"min_tokens": 32, "ignore_eos": True})
                async for _ in stream:
                    pass
                statuses.append(200)
            except openai.APIStatusError as e:
                statuses.append(e.status_code)

        loop = asyncio.get_running_loop()
        start, tasks, k = loop.time(), [], 0
        schedule = sorted((n / rate, tokens) for tokens, rate in LOAD.items()
                          for n in range(int(seconds * rate)))
        for at, tokens in schedule:
            if stop.is_set():
                break
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            tasks.append(asyncio.create_task(one(k, tokens)))
            k += 1
        await asyncio.gather(*tasks)
        for c in clients:
            await c.close()
        return statuses

    return asyncio.run(run())


def reported(port: int, deployment: str) -> int:
    status, body = http_get(f"http://127.0.0.1:{port}/metrics/default/{deployment}")
    assert status == 200, body
    m = REPLICAS.search(body.decode())
    assert m is not None, body
    return int(m.group(1))


def redis_keys(url: str, pattern: str) -> list[bytes]:
    client = redis_client.Redis.from_url(url)
    try:
        return list(client.scan_iter(match=pattern))
    finally:
        client.close()


def stored_profile(url: str, deployment: str) -> GpuProfile:
    client = redis_client.Redis.from_url(url)
    try:
        raw = client.get(f"aibrix:profile_{MODEL}_{deployment}")
    finally:
        client.close()
    assert raw is not None, f"no profile for {deployment} in Redis"
    return parse_profile(json.loads(raw))


def covers(plan: dict[str, float], profiles: dict[str, GpuProfile], load: dict[int, float]) -> bool:
    """Whether the replicas can share the load within each profile's admitted throughput: a feasible
    split x[shape][type] >= 0, each shape's rate in full, each type's replicas' work within their count."""
    names, shapes = sorted(plan), sorted(load)
    n = len(names)
    served = [[profiles[d].served[profiles[d].cell(s, 32)[0]][profiles[d].cell(s, 32)[1]] for d in names]
              for s in shapes]
    bounds = [(0, None if served[c][g] > 0 else 0) for c in range(len(shapes)) for g in range(n)]
    a_eq = [[1.0 if c == cc else 0.0 for cc in range(len(shapes)) for _ in range(n)]
            for c in range(len(shapes))]
    a_ub = [[(1 / served[c][g] if served[c][g] > 0 and g == gg else 0.0) for c in range(len(shapes))
             for g in range(n)] for gg in range(n)]
    result = linprog([0.0] * len(bounds), A_ub=a_ub, b_ub=[plan[d] for d in names], A_eq=a_eq,
                     b_eq=[load[s] for s in shapes], bounds=bounds)
    return bool(result.status == 0)


def test_from_benchmark_to_plan(log_dir: Path, redis: RedisServer, sims: dict[str, SimProcess]) -> None:
    started = time.monotonic()
    # 1. Benchmark each GPU type and make its profile, into Redis (both types at once, as two shells)
    to_redis = f"{redis.url.rsplit('/', 1)[0]}/0?model={MODEL}"
    done: list[str] = []

    def profile(deployment: str) -> None:
        profile_gpu(sims[deployment].url, MODEL, PLAN, deployment, TYPES[deployment][1], SLO, log_dir,
                    to_redis)
        done.append(deployment)

    workers = [threading.Thread(target=profile, args=(d,)) for d in TYPES]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=90)
    assert sorted(done) == sorted(TYPES), "a step failed (its assertion is printed above)"
    profiles = {d: stored_profile(redis.url, d) for d in TYPES}  # as the gateways and the optimizer read it
    for p in profiles.values():  # both types serve both shapes behind admission
        assert all(t > 0 for row in p.served for t in row) and p.concurrency_admitted is not None

    # 2. The optimizer beside the gateways: Deployments from its config, profiles from Redis
    config = log_dir / "optimizer.yaml"
    config.write_text(yaml.safe_dump({"deployments": [{"name": d, "model": MODEL} for d in TYPES]}))
    port = free_port()
    optimizer = Proc("optimizer", [str(VENV_BIN / "extproc"), "optimizer", "--config", str(config),
                                   "--port", str(port), "--redis-url", redis.url, "--interval", "1",
                                   "--window", "10"], log_dir)
    try:
        optimizer.wait_ready(lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200)
        # 3. Traffic through two gateways (traces on, Redis shared) until the plan answers it
        env = {"EXTPROC_REDIS_URL": redis.url, "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": "true"}
        with running_stacks(log_dir, gateway_config(sims), env) as stacks:
            stop = threading.Event()
            box: list[list[int]] = []
            sender = threading.Thread(target=lambda: box.append(send_load(stacks, 25.0, stop)))
            sender.start()
            plan: dict[str, float] = {}

            def planned() -> bool:
                plan.update({d: reported(port, d) / 100 for d in TYPES})
                return sum(plan.values()) > 0

            try:
                wait_until(planned, 30, "a plan under load")
            finally:
                stop.set()
                sender.join(timeout=30)
        assert box and box[0] and set(box[0]) == {200}, box[0][:10] if box else "no traffic sent"
        traces = redis_keys(redis.url, f"aibrix:{MODEL}_request_trace_*")
        assert traces, "no trace window in Redis"
        # the feedback's cuts for the gateways' SLO routers, rewritten every re-plan, expiring
        client = redis_client.Redis.from_url(redis.url)
        try:
            cuts, ttl = client.get(factors_key(MODEL)), client.ttl(factors_key(MODEL))
        finally:
            client.close()
        assert cuts is not None and "factors" in json.loads(cuts) and 0 < ttl <= ttl_seconds(1), (cuts, ttl)
    finally:
        assert optimizer.stop() == 0, optimizer.log()
    # 4. The plan covers what was sent, by the profiles it planned from; whole replicas per Deployment
    assert all(v == int(v) for v in plan.values()), plan
    assert covers(plan, profiles, LOAD), (plan, {d: p.served for d, p in profiles.items()})
    assert not covers(dict.fromkeys(plan, 0.0), profiles, LOAD)  # the check can fail
    assert time.monotonic() - started < 90
