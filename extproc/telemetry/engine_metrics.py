"""Engine /metrics text -> EngineSample, with one name map per engine. Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


class MetricsParseError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class EngineSample:
    running: float | None        # requests running in the engine
    waiting: float | None        # requests queued in the engine
    kv_usage: float | None       # GPU KV-cache usage fraction 0..1; None when not reported or NaN
    cpu_kv_usage: float | None
    at: float = 0.0              # clock time the scrape's answer came back
    sent: float | None = None    # clock time the scrape was sent: the count is from between the two


@dataclass(frozen=True, slots=True)
class EngineNames:
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]    # first present wins (newer name first)
    cpu_kv_usage: tuple[str, ...] = ()
    kv_percent: bool = False     # reported in percent rather than as a fraction


ENGINE_NAMES: dict[str, EngineNames] = {
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (both fractions despite "perc").
    "vllm": EngineNames(("vllm:num_requests_running",), ("vllm:num_requests_waiting",),
                        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
                        ("vllm:cpu_cache_usage_perc",)),
    "sglang": EngineNames(("sglang:num_running_reqs",), ("sglang:num_queue_reqs",), ("sglang:token_usage",)),
    # TensorRT-LLM (Triton / trtllm-serve) reports KV utilisation as a fraction.
    "trtllm": EngineNames(("trtllm_num_active_requests", "nv_trt_llm_request_metrics"),
                          ("trtllm_num_queued_requests",), ("trtllm_kv_cache_utilization",)),
}


def parse_metrics(text: str, engine: str, at: float, sent: float | None = None) -> EngineSample:
    """Several series of one metric (several served models, several engines behind one port) are
    summed for counts and averaged for usage fractions."""
    names = ENGINE_NAMES.get(engine, ENGINE_NAMES["vllm"])
    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values.setdefault(sample.name, []).append(float(sample.value))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on garbage
        raise MetricsParseError(f"unparsable metrics: {exc}") from None

    def first(candidates: tuple[str, ...], mean: bool) -> float | None:
        for name in candidates:
            found = [v for v in values.get(name, ()) if math.isfinite(v)]
            if found:
                return sum(found) / len(found) if mean else sum(found)
            if name in values:  # present but NaN: "not reported"
                return None
        return None

    kv = first(names.kv_usage, mean=True)
    if kv is not None and names.kv_percent:
        kv /= 100.0
    return EngineSample(running=first(names.running, False), waiting=first(names.waiting, False),
                        kv_usage=None if kv is None else min(1.0, max(0.0, kv)),
                        cpu_kv_usage=first(names.cpu_kv_usage, True), at=at, sent=sent)
