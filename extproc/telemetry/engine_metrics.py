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


Series = tuple[str, tuple[tuple[str, str], ...]]  # a metric name and the label values a sample must have


def series(spec: str) -> Series:
    """`name` or `name{label=value,...}`, as the model-server protocol's table writes them."""
    name, _, labels = spec.partition("{")
    pairs = (p.split("=", 1) for p in labels.rstrip("}").split(",") if p)
    return name, tuple((k.strip(), v.strip().strip('"')) for k, v in pairs)


@dataclass(frozen=True, slots=True)
class EngineNames:
    running: tuple[Series, ...]
    waiting: tuple[Series, ...]
    kv_usage: tuple[Series, ...]    # first present wins (newer name first)
    cpu_kv_usage: tuple[Series, ...] = ()
    kv_percent: bool = False     # reported in percent rather than as a fraction

    @staticmethod
    def of(running: tuple[str, ...], waiting: tuple[str, ...], kv_usage: tuple[str, ...],
           cpu_kv_usage: tuple[str, ...] = ()) -> EngineNames:
        return EngineNames(*(tuple(series(n) for n in names)
                             for names in (running, waiting, kv_usage, cpu_kv_usage)))

    def then(self, other: EngineNames) -> EngineNames:
        """These names first, then the other engine's: a pod whose engine label is missing or wrong
        still reports (each engine's names are its own, so no sample is read twice)."""
        def join(a: tuple[Series, ...], b: tuple[Series, ...]) -> tuple[Series, ...]:
            return a + tuple(x for x in b if x not in a)
        return EngineNames(join(self.running, other.running), join(self.waiting, other.waiting),
                           join(self.kv_usage, other.kv_usage), join(self.cpu_kv_usage, other.cpu_kv_usage),
                           self.kv_percent)


# Each engine's names for what the Gateway API Inference Extension's model-server protocol (proposal 003)
# requires (TotalRunningRequests, TotalQueuedRequests, KVCacheUtilization, all fractions of 1 for the
# KV cache), the protocol's names first, then older ones still in use.
OWN_NAMES: dict[str, EngineNames] = {
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (both fractions despite "perc").
    "vllm": EngineNames.of(("vllm:num_requests_running",), ("vllm:num_requests_waiting",),
                           ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
                           ("vllm:cpu_cache_usage_perc",)),
    "sglang": EngineNames.of(("sglang:num_running_reqs",), ("sglang:num_queue_reqs",),
                             ("sglang:token_usage",)),
    # TensorRT-LLM: trtllm-serve's own names (the protocol's), this project's earlier reading of them
    # (num_active / num_queued), and Triton's TensorRT-LLM backend (one family, a label per kind).
    "trtllm": EngineNames.of(
        ("trtllm_num_requests_running", "trtllm_num_active_requests",
         'nv_trt_llm_request_metrics{request_type="scheduled"}'),
        ("trtllm_num_requests_waiting", "trtllm_num_queued_requests",
         'nv_trt_llm_request_metrics{request_type="waiting"}'),
        ("trtllm_kv_cache_utilization", 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}')),
}


def _read_by(engine: str) -> EngineNames:
    names = OWN_NAMES[engine]
    for other, theirs in OWN_NAMES.items():
        if other != engine:
            names = names.then(theirs)
    return names


ENGINE_NAMES: dict[str, EngineNames] = {engine: _read_by(engine) for engine in OWN_NAMES}


def parse_metrics(text: str, engine: str, at: float, sent: float | None = None) -> EngineSample:
    """Several series of one metric (several served models, several engines behind one port) are
    summed for counts and averaged for usage fractions."""
    names = ENGINE_NAMES.get(engine, ENGINE_NAMES["vllm"])
    values: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on garbage
        raise MetricsParseError(f"unparsable metrics: {exc}") from None

    def first(candidates: tuple[Series, ...], mean: bool) -> float | None:
        for name, want in candidates:
            samples = [v for labels, v in values.get(name, ()) if all(labels.get(k) == x for k, x in want)]
            found = [v for v in samples if math.isfinite(v)]
            if found:
                return sum(found) / len(found) if mean else sum(found)
            if samples:  # present but NaN: "not reported"
                return None
        return None

    kv = first(names.kv_usage, mean=True)
    if kv is not None and names.kv_percent:
        kv /= 100.0
    return EngineSample(running=first(names.running, False), waiting=first(names.waiting, False),
                        kv_usage=None if kv is None else min(1.0, max(0.0, kv)),
                        cpu_kv_usage=first(names.cpu_kv_usage, True), at=at, sent=sent)
