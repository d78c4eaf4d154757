"""Automatic prefix caching: hits skip prefill, blocks are shared, released blocks are evictable."""

from __future__ import annotations

import pytest

from extproc.sim.engine import Engine
from extproc.sim.gpus import GpuSpec
from extproc.sim.perf import PerfModel
from extproc.sim.prefix import PrefixCache, block_hashes
from extproc.sim.sequences import EngineConfig, SimRequest
from tests.unit.sim.test_sim_engine import IDEAL, MODEL, drain, toy_engine

TEXT = "".join(f"sentence number {i} of a long shared system prompt. " for i in range(200))


def req(rid: str, text: str, max_tokens: int = 4) -> SimRequest:
    return SimRequest(
        rid, prompt_tokens=len(text) // 4, max_tokens=max_tokens, block_hashes=block_hashes(text, 64)
    )


def test_hash_chain_names_prefixes() -> None:
    a = block_hashes("x" * 64 + "y" * 64 + "z" * 10, 64)
    b = block_hashes("x" * 64 + "w" * 64, 64)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]


def test_repeated_prompt_skips_prefill() -> None:
    engine = toy_engine(max_num_batched_tokens=8192)
    first = req("a", TEXT)
    engine.add(first, 0.0)
    cold = engine.step(0.0)
    end = drain(engine, cold.end)
    assert engine.prefix_hits_total == 0
    engine.add(req("b", TEXT), end)
    warm = engine.step(end)
    # Every full block is reused except that at least one prompt token is always recomputed.
    hit_blocks = min(len(first.block_hashes), (first.prompt_tokens - 1) // 16)
    assert warm.num_tokens == first.prompt_tokens - hit_blocks * 16
    assert warm.duration < cold.duration / 5
    assert engine.prefix_hits_total == hit_blocks * 16
    assert engine.prefix_queries_total == 2 * first.prompt_tokens


def test_shared_prefix_hits_only_the_shared_blocks() -> None:
    engine = toy_engine()
    engine.add(req("a", TEXT), 0.0)
    drain(engine)
    other = TEXT[:640] + "something else entirely, " * 40
    engine.add(req("b", other), 10.0)
    drain(engine, 10.0)
    assert engine.prefix_hits_total == 10 * 16  # 640 chars = 10 blocks of 64 chars


def test_blocks_are_shared_while_running_and_evictable_after() -> None:
    shared = toy_engine(max_num_batched_tokens=8192)
    private = toy_engine(max_num_batched_tokens=8192, enable_prefix_caching=False)
    for e in (shared, private):
        e.add(req("a", TEXT, 50), 0.0)
        res = e.step(0.0)
        e.add(req("b", TEXT, 50), res.end)
        e.step(res.end)
    assert shared.kv_cache_usage < 0.6 * private.kv_cache_usage
    drain(shared, 1.0)
    assert shared.kv.used_blocks == 0 and shared.kv.prefix.in_use == 0 and shared.kv_cache_usage == 0.0
    assert shared.kv.prefix.evictable >= len(TEXT) // 64


def test_evictable_blocks_make_room() -> None:
    blocks = 64
    gpu = GpuSpec(
        "tiny",
        memory_gb=2.0 + blocks * 16 * 32768 / 1e9 + 1e-6,
        bandwidth_gbps=1000,
        tflops=100,
        price_per_hour=1,
    )
    engine = Engine(PerfModel(gpu, MODEL, 1, IDEAL), EngineConfig(gpu_memory_utilization=1.0))
    assert engine.kv.total_blocks == blocks
    now = 0.0
    for i in range(6):  # each prompt ~40 blocks of distinct text: the cache must evict to admit the next
        text = f"prompt {i} " * 300
        engine.add(req(f"r{i}", text[:2560]), now)
        now = drain(engine, now)
    assert engine.requests_finished_total == 6
    assert engine.kv.prefix.evictable <= blocks


def test_cache_bookkeeping() -> None:
    c = PrefixCache()
    c.insert(1)
    assert c.acquire(1) and not c.acquire(2)
    c.release(1)
    assert c.in_use == 1 and c.evictable == 0
    c.release(1)
    assert c.in_use == 0 and c.evictable == 1 and c.match([1, 2], 2) == 1
    assert c.evict(5) == 1 and c.match([1], 1) == 0


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_request_still_finishes_with_caching(caching: bool) -> None:
    gpu = GpuSpec(
        "tiny",
        memory_gb=2.0 + 40 * 16 * 32768 / 1e9 + 1e-6,
        bandwidth_gbps=1000,
        tflops=100,
        price_per_hour=1,
    )
    engine = Engine(
        PerfModel(gpu, MODEL, 1, IDEAL),
        EngineConfig(gpu_memory_utilization=1.0, enable_prefix_caching=caching),
    )
    for i in range(3):
        engine.add(req(f"r{i}", TEXT[: 200 * 4], 150), 0.0)
    drain(engine)
    assert engine.requests_finished_total == 3 and engine.generation_tokens_total == 450
    assert engine.preemptions_total >= 1
    assert engine.kv.used_blocks == 0 and engine.kv.prefix.in_use == 0
