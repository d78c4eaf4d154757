"""`python -m extproc.perf.speed_read`: one gateway's read of the others' speed sums at P pods, the
replies taken as text (decoded with surrogateescape, then encoded back for numpy) against taken as
bytes (`NEVER_DECODE`, as RedisState reads them), alternated in one run against a real redis-server:
CPU ms per read (the pipeline's parse and `speed_sums.others_many`), medians and the paired ratio.
Both must give the same views, or the run fails."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
from redis.client import NEVER_DECODE

from extproc.perf.sync import make_pods, start_redis
from extproc.sharing import speed_sums
from extproc.sharing.sync_core import pod_id, speed_key
from extproc.state.speed import SpeedEstimator


async def _run(port: int, pods: int, models: int, rounds: int) -> dict[str, float]:
    fleet = make_pods(pods, models)
    fleet_sums, own, rng = SpeedEstimator(), SpeedEstimator(), random.Random(1)
    for pod in fleet:
        for estimator in (fleet_sums, own):
            estimator.observe(pod.key, 0.02, rng.uniform(1, 32), 199, 100.0)
            estimator.observe_prefill(pod.key, 0.05, rng.uniform(100, 2000), 200, 100.0)
    client = aioredis.Redis(port=port, decode_responses=True, encoding_errors="surrogateescape")
    try:
        for pod in fleet:
            vector = speed_sums.encode(fleet_sums.export(pod.key))
            await client.hset(speed_key(pod.model), pod_id(pod), vector)
        owns = {pod_id(pod): speed_sums.encode(own.export(pod.key)) for pod in fleet}
        names = sorted({pod.model for pod in fleet})

        async def read(binary: bool) -> tuple[float, list]:
            pipe = client.pipeline(transaction=False)
            for model in names:
                if binary:
                    pipe.execute_command("HGETALL", speed_key(model), **{NEVER_DECODE: True})
                else:
                    pipe.hgetall(speed_key(model))
            started = time.process_time()
            pids, raws = [], []
            for reply in await pipe.execute():
                for pid, raw in reply.items():
                    pids.append(pid.decode("utf-8", "surrogateescape") if binary else pid)
                    raws.append(raw)
            views = speed_sums.others_many(raws, [owns[pid] for pid in pids])
            return (time.process_time() - started) * 1000, views

        text, binary = [], []
        for _ in range(rounds):
            (t, as_text), (b, as_bytes) = await read(False), await read(True)
            if as_text != as_bytes:
                raise AssertionError("the two reads gave different views")
            text.append(t)
            binary.append(b)
    finally:
        await client.aclose()
    return {"pods": pods, "text_ms": round(statistics.median(text), 1),
            "bytes_ms": round(statistics.median(binary), 1),
            "paired_ratio": round(statistics.median(b / t for t, b in zip(text, binary)), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="speed-read-") as tmp:
        proc, port = start_redis(Path(tmp))
        try:
            print(asyncio.run(_run(port, args.pods, args.models, args.rounds)))
        finally:
            proc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
