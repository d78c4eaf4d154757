"""`extproc bench sync --processes`: the gateways side by side, one process each, as real ones run.

Each gateway is a process of its own with one `RedisState` and its own share of the fleet: it holds
`inflight / G` requests on every pod, completes `rate x P / G` of them a second (at random among its
own: tokens credited, its speed evidence on the pod changed), each replaced at once by a new one on a
pod at random (so a completion moves two counts, as in the serial run, where the new one starts at a
random gateway on the same pod; here a pod's total wanders instead of staying at `inflight`), and syncs
once per fleet turn, as fast as it can (the clock is virtual, turn x interval, so heartbeats fall once
every 1/interval turns). No gateway waits for another between the barriers (after the first read,
after the warm-up, after the measured turns): their pipelines meet in Redis as a fleet's do.

What changes against the serial run (extproc/perf/sync.py): a gateway's CPU is its own process's
(process time across its `sync_once`, with its own heap and collector), its latency includes
queueing behind the others' pipelines in Redis, and Redis's CPU is that of commands arriving from G
clients at once. Redis's cores are its CPU over the measured window per fleet turn x 1/interval, as
in the serial run. Tokens are checked as there (every gateway must count every token the fleet
completed on every pod, once, after closing heartbeats); the views and speed sums, which need every
gateway's state at one moment, are checked by the serial run only.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import random
import statistics
import time
from typing import Any

from extproc.perf.sync import (
    TOKENS_PER_REQUEST,
    _first_sync,
    _quantile,
    _redis_counters,
    _shards,
    make_pods,
)
from extproc.redis_connect import RedisTarget
from extproc.sharing.redis_sync import RedisState
from extproc.sharing.sync_core import SPEED_READ_HEARTBEATS, SPEED_WRITE_HEARTBEATS
from extproc.state.speed import SpeedEstimator


def run_processes(target: RedisTarget, gateways: int, pods: int, *, models: int = 4, rate: float = 10.0,
                  inflight: int = 32, interval: float = 0.1, turns: int = 40, warmup: int = 5,
                  seed: int = 1, speed: bool = True, progress=print, **_: Any) -> dict:
    cycle = max(1, round(1.0 / interval)) * SPEED_READ_HEARTBEATS  # whole cycles of the speed read
    turns = -(-turns // cycle) * cycle
    admins = _shards(target)
    for admin in admins:
        admin.flushall()
    context = mp.get_context("spawn")  # not fork: a child forked from this (numpy's threads) can hang
    barrier = context.Barrier(gateways + 1)
    results = context.Queue()
    options = {"gateways": gateways, "pods": pods, "models": models, "rate": rate, "inflight": inflight,
               "interval": interval, "turns": turns, "warmup": warmup, "seed": seed, "speed": speed}
    procs = [context.Process(target=_gateway, args=(target, g, options, barrier, results), daemon=True)
             for g in range(gateways)]
    for proc in procs:
        proc.start()
    try:
        barrier.wait(timeout=600)   # every gateway read once: every token baseline is 0
        barrier.wait(timeout=600)   # warmed up
        before, started = [_redis_counters(admin) for admin in admins], time.perf_counter()
        barrier.wait(timeout=3600)  # the measured turns done
        after, wall = [_redis_counters(admin) for admin in admins], time.perf_counter() - started
        progress(f"  G={gateways} P={pods}: measured turns done in {wall:.1f} s, closing")
        for _ in range(SPEED_WRITE_HEARTBEATS + SPEED_READ_HEARTBEATS + 1 if speed else 2):
            barrier.wait(timeout=600)  # every gateway wrote, then read (a round each)
        reports = [results.get(timeout=600) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        for admin in admins:
            admin.close()
    credited = [sum(column) for column in zip(*(r["credited"] for r in reports))]
    wrong_tokens = sum(c != t for r in reports for c, t in zip(r["counted"], credited))
    cpu = [ms for r in reports for ms in r["cpu_ms"]]
    latency = [ms for r in reports for ms in r["latency_ms"]]
    per_second = 1 / interval
    shard_ms = [(a[0] - b[0]) * 1000 / turns for a, b in zip(after, before)]
    return {
        "code": "this, one process per gateway", "gateways": gateways, "pods": pods, "models": models,
        "rate": rate, "inflight": inflight, "interval_s": interval, "turns": turns,
        "sync_cpu_ms_median": round(statistics.median(cpu), 2),
        "sync_cpu_ms_p99": round(_quantile(cpu, 0.99), 2),
        "sync_cpu_ms_mean": round(statistics.fmean(cpu), 2),
        "sync_core_share": round(statistics.fmean(cpu) / 1000 * per_second, 3),
        "turn_latency_ms_median": round(statistics.median(latency), 2),
        "turn_latency_ms_max": round(max(latency), 2),
        "timeouts": sum(r["timeouts"] for r in reports), "failures": sum(r["failures"] for r in reports),
        "wrong_views": "-", "wrong_token_counts": wrong_tokens, "wrong_speed_sums": "-",
        "age_ms_median": -1, "age_ms_max": -1,
        "redis_cpu_ms_per_fleet_turn": round(sum(shard_ms), 2),
        "redis_cores": round(sum(shard_ms) / 1000 * per_second, 3),
        "redis_cores_per_shard": [round(ms / 1000 * per_second, 3) for ms in shard_ms],
        "redis_commands_per_s": round(sum(a[1] - b[1] for a, b in zip(after, before)) / turns * per_second),
        "reply_bytes_per_s": round(sum(a[2] - b[2] for a, b in zip(after, before)) / turns * per_second),
        "request_bytes_per_s": round(sum(a[3] - b[3] for a, b in zip(after, before)) / turns * per_second),
        "measured_wall_s": round(wall, 1),
    }


def _gateway(target: RedisTarget, g: int, options: dict, barrier: Any, results: Any) -> None:
    logging.getLogger("extproc.state").setLevel(logging.ERROR)  # a line per gateway and outage
    try:
        results.put(asyncio.run(_gateway_turns(target, g, barrier, **options)))
    except BaseException:
        barrier.abort()  # the others (and the parent) stop waiting for this one
        raise


async def _gateway_turns(target: RedisTarget, g: int, barrier: Any, *, gateways: int, pods: int, models: int,
                         rate: float, inflight: int, interval: float, turns: int, warmup: int, seed: int,
                         speed: bool) -> dict:
    now = [time.time()]
    state = RedisState(target, f"bench-gw-{g}", sync_interval=interval, gateway_ttl=3600.0,
                       clock=lambda: now[0])
    fleet = make_pods(pods, models)
    state.track(fleet)
    rng, estimator = random.Random(seed * 1000 + g), SpeedEstimator()
    held = [inflight // gateways + (p % gateways < inflight % gateways) for p in range(pods)]
    credited, counted = [0] * pods, [0] * pods
    index = {pod.key: p for p, pod in enumerate(fleet)}

    def measured(p: int) -> None:
        if speed:
            key = fleet[p].key
            estimator.observe(key, 0.02 * (1 + 0.05 * rng.random()), rng.uniform(1, 32), 199, now[0])
            estimator.observe_prefill(key, 0.05 * rng.random(), rng.uniform(100, 2000), 200, now[0])
            state.share_speed(key, estimator.export(key))  # type: ignore[arg-type]

    def take_tokens() -> None:
        for key, delta in state.take_token_deltas().items():
            counted[index[key]] += delta

    for p, n in enumerate(held):
        if n:
            state.add_running(fleet[p], n)
            measured(p)
    report: dict = {"cpu_ms": [], "latency_ms": [], "timeouts": 0, "failures": 0}
    try:
        await _first_sync(state, attempts=100)  # 50 gateways writing every pod at once: Redis queues them
        take_tokens()
        barrier.wait(timeout=600)
        for turn in range(warmup + turns):
            if turn == warmup:
                barrier.wait(timeout=600)
            now[0] += interval
            completions = rate * pods * interval / gateways
            whole = int(completions) + (rng.random() < completions - int(completions))
            for _ in range(whole if any(held) else 0):
                p = rng.randrange(pods)
                while not held[p]:
                    p = rng.randrange(pods)
                held[p] -= 1
                state.add_running(fleet[p], -1)
                state.add_tokens(fleet[p], TOKENS_PER_REQUEST)
                credited[p] += TOKENS_PER_REQUEST
                measured(p)
                # ... and a new one starts here on a pod at random: as in the serial run, every
                # completion moves two (gateway, pod) counts, so as many writes go to Redis
                q = rng.randrange(pods)
                held[q] += 1
                state.add_running(fleet[q], 1)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                await state.sync_once()
            except TimeoutError as exc:
                report["timeouts"] += turn >= warmup
                state.turn_failed(exc)
                continue
            except Exception as exc:
                report["failures"] += turn >= warmup
                state.turn_failed(exc)
                continue
            c1, t1 = time.process_time(), time.perf_counter()
            take_tokens()
            if turn >= warmup:
                report["cpu_ms"].append((c1 - c0) * 1000)
                report["latency_ms"].append((t1 - t0) * 1000)
        barrier.wait(timeout=3600)
        # Closing: every gateway writes, then every one reads what the others wrote (a barrier between
        # rounds, so no read comes before another's write of the same round)
        closing = SPEED_WRITE_HEARTBEATS + SPEED_READ_HEARTBEATS + 1 if speed else 2
        for _ in range(closing):
            now[0] += 1.0
            await _first_sync(state, attempts=100)
            take_tokens()
            barrier.wait(timeout=600)
    finally:
        await state.close()
    return report | {"credited": credited, "counted": counted}

