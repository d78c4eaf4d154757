"""The engine model against hand-computed cases, in its own (virtual, deterministic) time."""

from __future__ import annotations

import math

import pytest

from extproc.sim.engine import Engine
from extproc.sim.gpus import GpuSpec
from extproc.sim.models import ModelSpec, get_model
from extproc.sim.perf import PerfModel, PerfParams
from extproc.sim.replica import build_engine
from extproc.sim.sequences import CapacityError, EngineConfig, SimRequest
from extproc.sim.virtual import run_closed_loop

# A toy GPU and model with round numbers, so expectations can be computed by hand.
GPU = GpuSpec("toy", memory_gb=20, bandwidth_gbps=1000, tflops=100, price_per_hour=1.0)
MODEL = ModelSpec(
    "toy-1b", params_b=1.0, layers=8, hidden=1024, heads=8, kv_heads=8, head_dim=128, max_model_len=4096
)
IDEAL = PerfParams(
    mem_efficiency=1.0,
    kv_efficiency=1.0,
    compute_efficiency=1.0,
    step_overhead_s=0.0,
    per_seq_overhead_s=0.0,
    activation_reserve_gb=0.0,
)


def toy_engine(**cfg: object) -> Engine:
    return Engine(PerfModel(GPU, MODEL, 1, IDEAL), EngineConfig(**cfg))  # type: ignore[arg-type]


def drain(engine: Engine, now: float = 0.0) -> float:
    while engine.has_work():
        res = engine.step(now)
        assert res is not None
        now = res.end
    return now


def test_kv_bytes_per_token_from_config() -> None:
    assert MODEL.kv_bytes_per_token == 2 * 8 * 8 * 128 * 2 == 32768
    assert get_model("llama2-7b").kv_bytes_per_token == 524288  # 0.5 MiB: 32 layers, 32 KV heads
    assert get_model("llama3-8b").kv_bytes_per_token == 131072  # GQA: 8 KV heads


def test_kv_blocks_from_memory_minus_weights() -> None:
    # 20 GB x 0.5 = 10 GB; minus 2 GB of weights = 8 GB; / 32768 B per token = 244140 tokens; / 16.
    engine = toy_engine(gpu_memory_utilization=0.5)
    assert engine.kv.total_blocks == int(8e9 // 32768) // 16


def test_decode_step_is_bytes_over_bandwidth() -> None:
    perf = PerfModel(GPU, MODEL, 1, IDEAL)
    # One sequence with 999 cached tokens decoding its 1000th: 2 GB weights + 1000 x 32 KiB of KV.
    expected = (2e9 + 1000 * 32768) / 1e12
    assert perf.decode_step_time(1, 999) == pytest.approx(expected)


def test_idle_ttft_is_prefill_time() -> None:
    engine = toy_engine(max_num_batched_tokens=8192)
    engine.add(SimRequest("a", prompt_tokens=2000, max_tokens=1), now=5.0)
    res = engine.step(5.0)
    assert res is not None and res.emitted == ["a"]
    # Compute-bound: 2 FLOPs/param x 2000 tokens plus attention over the causal triangle, at 100 TFLOPs.
    flops = 2e9 * 2000 + 4 * 8 * 8 * 128 * (2000 * 2001 / 2)
    assert res.duration == pytest.approx(flops / 100e12)
    assert res.finished[0].first_token_time - res.finished[0].arrival == pytest.approx(res.duration)


def test_long_prompt_is_chunked_by_token_budget() -> None:
    engine = toy_engine(max_num_batched_tokens=512)
    engine.add(SimRequest("a", prompt_tokens=1200, max_tokens=2), now=0.0)
    steps = []
    while engine.has_work():
        res = engine.step(steps[-1].end if steps else 0.0)
        steps.append(res)
    assert [s.num_tokens for s in steps] == [512, 512, 176, 1]
    assert [s.emitted for s in steps] == [[], [], ["a"], ["a"]]


def test_per_sequence_decode_speed_falls_as_batch_grows() -> None:
    rates = []
    for batch in (1, 8, 64, 256):
        r = run_closed_loop(toy_engine(), batch, 64, 256, batch)
        rates.append(r.mean_decode_rate)
    assert rates == sorted(rates, reverse=True)
    assert rates[-1] < rates[0] * 0.9
    # ... while the aggregate throughput grows (the reason batching exists).
    assert 256 * rates[-1] > 8 * rates[1] > rates[0]


def test_max_num_seqs_bounds_running_and_queues_the_rest() -> None:
    engine = toy_engine(max_num_seqs=4)
    for i in range(10):
        engine.add(SimRequest(f"r{i}", 16, 8), 0.0)
    assert (engine.num_running, engine.num_waiting) == (0, 10)
    engine.step(0.0)
    assert (engine.num_running, engine.num_waiting) == (4, 6)
    drain(engine)
    assert engine.requests_finished_total == 10
    assert engine.generation_tokens_total == 80
    assert engine.prompt_tokens_total == 160


def test_kv_usage_is_fraction_of_blocks() -> None:
    engine = toy_engine(gpu_memory_utilization=0.5)
    engine.add(SimRequest("a", prompt_tokens=33, max_tokens=10), 0.0)
    engine.step(0.0)  # prefill 33 tokens -> 3 blocks of 16
    assert engine.kv.used_blocks == 3
    assert engine.kv_cache_usage == pytest.approx(3 / engine.kv.total_blocks)
    engine.abort("a")
    assert engine.kv.used_blocks == 0 and not engine.has_work()


def test_kv_full_preempts_newest_and_counts() -> None:
    # Memory for the 2 GB of weights plus exactly 64 blocks (the 1e-6 absorbs float rounding).
    gpu = GpuSpec(
        "tiny",
        memory_gb=2.0 + 64 * 16 * 32768 / 1e9 + 1e-6,
        bandwidth_gbps=1000,
        tflops=100,
        price_per_hour=1,
    )
    engine = Engine(PerfModel(gpu, MODEL, 1, IDEAL), EngineConfig(gpu_memory_utilization=1.0))
    assert engine.kv.total_blocks == 64  # 1024 tokens of KV
    for i in range(4):  # 4 x (200 + 100) = 1200 tokens needed at the end > 1024
        engine.add(SimRequest(f"r{i}", 200, 100), 0.0)
    now = 0.0
    preempted: list[str] = []
    max_usage = 0.0
    while engine.has_work():
        res = engine.step(now)
        now = res.end
        preempted += res.preempted
        max_usage = max(max_usage, engine.kv_cache_usage)
        assert engine.kv.used_blocks <= engine.kv.total_blocks
    assert engine.preemptions_total == len(preempted) >= 1
    assert preempted[0] == "r3"  # the newest running request is the victim
    assert engine.requests_finished_total == 4 and engine.generation_tokens_total == 400
    assert max_usage > 0.9


def test_preempted_request_recomputes_then_continues() -> None:
    gpu = GpuSpec(
        "tiny", memory_gb=2.0 + 20 * 16 * 32768 / 1e9, bandwidth_gbps=1000, tflops=100, price_per_hour=1
    )
    engine = Engine(PerfModel(gpu, MODEL, 1, IDEAL), EngineConfig(gpu_memory_utilization=1.0))
    engine.add(SimRequest("a", 150, 60), 0.0)
    engine.add(SimRequest("b", 100, 60), 0.0)
    drain(engine)
    assert engine.preemptions_total >= 1
    assert engine.generation_tokens_total == 120  # no token is emitted twice


def test_kv_pressure_reports_and_really_limits() -> None:
    free = toy_engine()
    pressed = toy_engine(kv_pressure=0.9)
    assert pressed.kv_cache_usage >= 0.9
    assert pressed.kv.total_blocks == free.kv.total_blocks
    assert pressed.max_model_len <= free.max_model_len
    assert pressed.kv.phantom_blocks == math.ceil(free.kv.total_blocks * 0.9)


def test_request_longer_than_context_is_rejected() -> None:
    engine = toy_engine()
    with pytest.raises(CapacityError):
        engine.add(SimRequest("a", 4000, 200), 0.0)


def test_utilization_is_busy_fraction() -> None:
    engine = toy_engine()
    engine.add(SimRequest("a", 16, 4), 0.0)
    end = drain(engine)
    assert engine.utilization(end, window=end) == pytest.approx(1.0)
    assert engine.utilization(2 * end, window=2 * end) == pytest.approx(0.5)
    assert engine.utilization(end + 10.0, window=1.0) == 0.0


def test_steps_never_overlap() -> None:
    engine = toy_engine()
    engine.add(SimRequest("a", 16, 4), 0.0)
    first = engine.step(0.0)
    engine.add(SimRequest("b", 16, 4), 0.0)
    second = engine.step(0.0)  # asked too early: starts when the GPU is free
    assert second.start == pytest.approx(first.end)


def test_tensor_parallel_70b_fits_and_splits_bytes() -> None:
    engine = build_engine("A100-80GB", "llama3-70b")
    assert engine.perf.tensor_parallel == 4
    single = engine.perf.decode_step_time(1, 100)
    # 141 GB of weights over 4 x 2039 GB/s at 80 % efficiency, plus all-reduce latency: ~25 ms.
    assert 0.02 < single < 0.03
    with pytest.raises(ValueError):
        build_engine("A100-80GB", "llama3-70b", tensor_parallel=1)


def test_virtual_runs_are_deterministic() -> None:
    a = run_closed_loop(build_engine("A100-40GB", "llama3-8b"), 8, 1024, 128, 32)
    b = run_closed_loop(build_engine("A100-40GB", "llama3-8b"), 8, 1024, 128, 32)
    assert a.duration == b.duration and a.output_tokens == b.output_tokens == 32 * 128


def test_step_history_is_bounded_and_gives_throughput() -> None:
    engine = toy_engine(max_model_len=30000)
    engine.add(SimRequest("a", 16, 20000), 0.0)
    now = 0.0
    for _ in range(8000):  # ~2 ms steps: 16 s of model time
        now = engine.step(now).end
    assert len(engine._recent_steps) < 6000  # only RECENT_WINDOW_S of history is kept
    step = engine._recent_steps[-1][1] - engine._recent_steps[-1][0]
    assert engine.generation_throughput(now, 1.0) == pytest.approx(1.0 / step, rel=0.01)


def test_raising_kv_pressure_mid_run_never_wedges_the_queue() -> None:
    # 64 blocks = 1024 tokens. Each request needs 25 blocks at the end; at 0.9 pressure only 6 remain.
    memory = 2.0 + 64 * 16 * 32768 / 1e9 + 1e-6
    gpu = GpuSpec("tiny", memory_gb=memory, bandwidth_gbps=1000, tflops=100, price_per_hour=1)
    config = EngineConfig(gpu_memory_utilization=1.0, max_num_seqs=2)
    engine = Engine(PerfModel(gpu, MODEL, 1, IDEAL), config)
    assert engine.kv.total_blocks == 64
    for i in range(4):
        engine.add(SimRequest(f"big{i}", 300, 100), 0.0)
    now = engine.step(0.0).end  # two running mid-prefill, two waiting
    engine.set_kv_pressure(0.9)
    engine.add(SimRequest("small", 16, 8), now)  # still fits: must not be stuck behind the doomed ones
    failed: list[str] = []
    finished: list[str] = []
    for _ in range(10_000):  # bounded: a wedged engine fails here instead of hanging the test run
        if not engine.has_work():
            break
        res = engine.step(now)
        assert res is not None, "has_work() but nothing to step: a driver would poll forever"
        now = res.end
        failed += [s.request_id for s in res.failed]
        finished += [s.request_id for s in res.finished]
    assert not engine.has_work()
    assert sorted(failed) == ["big0", "big1", "big2", "big3"]
    assert finished == ["small"]
    assert engine.kv.used_blocks == 0 and engine.kv.prefix.in_use == 0


def test_kv_pressure_makes_the_same_workload_queue_and_preempt_more() -> None:
    def run(pressure: float) -> tuple[int, float, float]:
        """(preemptions, time-averaged queue length, time to drain) for 64 requests sent at once."""
        engine = build_engine("A100-40GB", "llama3-8b", kv_pressure=pressure)
        for i in range(64):
            engine.add(SimRequest(f"r{i}", 1024, 512), 0.0)
        now = queued = 0.0
        while engine.has_work():
            res = engine.step(now)
            assert res is not None
            queued += engine.num_waiting * res.duration
            now = res.end
        assert engine.requests_finished_total == 64
        return engine.preemptions_total, queued / now, now

    free, pressed = run(0.0), run(0.9)
    assert free[0] == 0 < pressed[0]
    assert pressed[1] > 2 * free[1]
    assert pressed[2] > 2 * free[2]
