"""Profiles read without scanning the keyspace, against a real redis-server (issue 34): 100 models, half
their profiles written by our gen-profile (indexed), half as AIBrix's own gen-profile writes them (only
the `aibrix:profile_<model>_<deployment>` key), beside 20,000 other keys."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from extproc.gpu_profiles import ProfileStore, profile_key
from extproc.profiling.output import parse_redis_url, store_redis
from tests.support.redis_server import RedisServer

MODELS = [f"model-{i}" for i in range(100)]


def raw_profile(gpu: str, tput: float) -> dict:
    return {"gpu": gpu, "cost": 1.0, "tputs": [[tput]], "indexes": [[8], [128]], "e2e": [[1.0]],
            "slos": {"e2e": 10}, "created": 1.0}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    yield server
    server.stop()


def scans(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))


def test_100_models_profiles_found_by_index_and_by_deployment_without_a_scan(redis_server):
    client = redis.Redis(port=redis_server.port)
    with client.pipeline(transaction=False) as pipe:
        for i in range(20_000):  # the rest of a busy Redis: what a SCAN per model would walk
            pipe.set(f"unrelated:{i}", "x")
        pipe.execute()
    deployments: dict[str, list[str]] = {}
    for i, model in enumerate(MODELS):
        if i % 2:  # AIBrix's gen-profile: the key alone, no index
            client.set(profile_key(model, "a100"), json.dumps(raw_profile("a100", float(i))))
            deployments[model] = ["a100"]
        else:     # ours: the key and its place in the model's index; a deployment routing has not seen
            store_redis(parse_redis_url(f"redis://127.0.0.1:{redis_server.port}/0?model={model}"), "l20",
                        raw_profile("l20", float(i)))
            deployments[model] = []
    before = scans(client)

    async def refresh() -> tuple[ProfileStore, int]:
        store = ProfileStore()
        async_client = aioredis.Redis(port=redis_server.port)
        try:
            return store, await store.refresh_redis(async_client, deployments)
        finally:
            await async_client.aclose()

    store, read = asyncio.run(refresh())
    assert read == 100
    assert scans(client) == before  # not one SCAN
    for i, model in enumerate(MODELS):
        name = "a100" if i % 2 else "l20"
        found = store.profile_for(model, "default", name)
        assert found is not None and found.tputs[0][0] == float(i), model
    client.close()
