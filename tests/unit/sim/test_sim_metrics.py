"""Latency histograms: the per-token one is token-weighted, as vLLM and SGLang count it."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.sim.engine import Engine
from extproc.sim.gpus import GpuSpec
from extproc.sim.metrics import EngineMetrics, WeightedHistogram
from extproc.sim.perf import PerfModel
from extproc.sim.sequences import EngineConfig, SimRequest
from tests.unit.sim.test_sim_engine import IDEAL, MODEL


def samples(metrics: EngineMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {
        s.name + (f"[{s.labels['le']}]" if "le" in s.labels else ""): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_weighted_observations_fill_cumulative_buckets() -> None:
    h = WeightedHistogram(["x_seconds"], "doc", (0.1, 1.0), "m")
    h.observe(0.05, 3)
    h.observe(0.1, 1)  # on the bound: counted in it, as prometheus does
    h.observe(5.0, 2)
    (fam,) = h.collect()
    got = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert got[("x_seconds_bucket", "0.1")] == 4
    assert got[("x_seconds_bucket", "1.0")] == 4
    assert got[("x_seconds_bucket", "+Inf")] == 6 == got[("x_seconds_count", None)]
    assert got[("x_seconds_sum", None)] == pytest.approx(0.15 + 0.1 + 10.0)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_inter_token_histogram_counts_every_non_first_token(kind: str) -> None:
    # 64 KV blocks for 4 requests that need 75 each at the end: preemptions give some tokens long gaps.
    memory = 2.0 + 64 * 16 * 32768 / 1e9 + 1e-6
    gpu = GpuSpec("tiny", memory_gb=memory, bandwidth_gbps=1000, tflops=100, price_per_hour=1)
    engine = Engine(PerfModel(gpu, MODEL, 1, IDEAL), EngineConfig(gpu_memory_utilization=1.0))
    metrics = EngineMetrics(kind, "toy", engine, lambda: 0.0)
    for i in range(4):
        engine.add(SimRequest(f"r{i}", 200, 100 + i), 0.0)
    now, finished = 0.0, []
    while engine.has_work():
        res = engine.step(now)
        assert res is not None
        now = res.end
        metrics.observe_step(res)
        for seq in res.finished:
            metrics.observe_finished(seq)
            finished.append(seq)
    assert engine.preemptions_total >= 1
    got = samples(metrics)
    if kind == "vllm":
        itl, per_request = "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"
    else:
        itl, per_request = "sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"
    assert got[itl + "_count"] == engine.generation_tokens_total - 4 == 402
    # Each request's gaps add up to its first-to-last token time, including time lost to preemption.
    total = sum(s.finish_time - s.first_token_time for s in finished)  # type: ignore[operator]
    assert got[itl + "_sum"] == pytest.approx(total)
    assert got[per_request + "_count"] == 4
    if kind == "vllm":
        assert got["vllm:inter_token_latency_seconds_count"] == 402
