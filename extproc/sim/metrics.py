"""Prometheus exposition with the engine's own metric names (vLLM or SGLang), one registry per replica.

Gauges and token counters are read from the engine at scrape time (a custom collector), so the hot path
only touches the latency histograms: once per request, and once per step for the per-token one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from extproc.sim.engine import Engine
from extproc.sim.sequences import SeqState, StepResult

# vLLM's bucket edges (vllm/engine/metrics.py), so dashboards built for vLLM read the same quantiles.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True, slots=True)
class MetricNames:
    running: str
    waiting: str
    kv_usage: tuple[str, ...]  # several names for one value (vLLM renamed gpu_cache -> kv_cache)
    prompt_tokens: str  # counter base name; exposition appends _total
    generation_tokens: str
    preemptions: str
    prefix_queries: str
    prefix_hits: str
    requests_finished: str
    ttft: str
    itl: tuple[str, ...]  # per output token after the first (token-weighted), under each name it has had
    tpot_request: str  # one observation per request: its mean time per output token
    e2e: str


VLLM = MetricNames(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    prompt_tokens="vllm:prompt_tokens",
    generation_tokens="vllm:generation_tokens",
    preemptions="vllm:num_preemptions",
    prefix_queries="vllm:prefix_cache_queries",
    prefix_hits="vllm:prefix_cache_hits",
    requests_finished="vllm:request_success",
    ttft="vllm:time_to_first_token_seconds",
    # vLLM observes every inter-token gap here; newer releases also name it inter_token_latency.
    itl=("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
    tpot_request="vllm:request_time_per_output_token_seconds",
    e2e="vllm:e2e_request_latency_seconds",
)

SGLANG = MetricNames(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage=("sglang:token_usage",),
    prompt_tokens="sglang:prompt_tokens",
    generation_tokens="sglang:generation_tokens",
    preemptions="sglang:num_retracted_reqs",
    prefix_queries="sglang:prefix_cache_queries",
    prefix_hits="sglang:prefix_cache_hits",
    requests_finished="sglang:num_requests",
    ttft="sglang:time_to_first_token_seconds",
    itl=("sglang:inter_token_latency_seconds",),
    tpot_request="sglang:time_per_output_token_seconds",
    e2e="sglang:e2e_request_latency_seconds",
)

ENGINE_NAMES = {"vllm": VLLM, "sglang": SGLANG}


class _EngineCollector(Collector):
    def __init__(self, names: MetricNames, model: str, engine: Engine, now: Callable[[], float]) -> None:
        self._n, self._model, self._engine, self._now = names, model, engine, now

    def collect(self) -> Iterator[Metric]:
        n, e, labels = self._n, self._engine, [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge(n.running, "Number of requests in model execution batches.", e.num_running)
        yield gauge(n.waiting, "Number of requests waiting to be processed.", e.num_waiting)
        for name in n.kv_usage:
            yield gauge(name, "KV-cache usage. 1 means 100 percent usage.", e.kv_cache_usage)
        yield counter(n.prompt_tokens, "Number of prefill tokens processed.", e.prompt_tokens_total)
        yield counter(
            n.generation_tokens, "Number of generation tokens processed.", e.generation_tokens_total
        )
        yield counter(n.preemptions, "Cumulative number of preemptions from the engine.", e.preemptions_total)
        yield counter(
            n.prefix_queries, "Prompt tokens looked up in the prefix cache.", e.prefix_queries_total
        )
        yield counter(n.prefix_hits, "Prompt tokens found in the prefix cache.", e.prefix_hits_total)
        if n is SGLANG:  # SGLang reports the ratio as a gauge
            rate = e.prefix_hits_total / e.prefix_queries_total if e.prefix_queries_total else 0.0
            yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", rate)
            yield gauge(
                "sglang:gen_throughput",
                "The generation throughput (token/s).",
                e.generation_throughput(self._now()),
            )
        yield counter(
            n.requests_finished, "Count of successfully processed requests.", e.requests_finished_total
        )
        now = self._now()
        util = e.utilization(now)
        # The busy fraction, under the simulator's own name and DCGM's (percent), which GPU dashboards use.
        yield gauge("sim:gpu_utilization", "Busy fraction of the simulated GPU over the last second.", util)
        yield gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", round(util * 100.0, 3))
        yield counter(
            "sim:gpu_busy_seconds", "Simulated seconds the GPU spent running steps.", e.busy_seconds_total
        )


class WeightedHistogram(Collector):
    """A histogram whose observations carry a weight: `observe(v, n)` counts n observations of v.

    Why: the per-token latency histogram would otherwise cost one prometheus observe per token per step;
    the engine reports each step's gaps grouped (StepResult.inter_token), so this is one call per group.
    """

    def __init__(
        self, names: Sequence[str], doc: str, buckets: Sequence[float], model: str
    ) -> None:
        self._names, self._doc, self._model = tuple(names), doc, model
        self._bounds = tuple(buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    @property
    def count(self) -> int:
        return sum(self._counts)

    def observe(self, value: float, weight: int = 1) -> None:
        self._counts[bisect_left(self._bounds, value)] += weight  # a bucket counts values <= its bound
        self.sum += value * weight

    def collect(self) -> Iterator[Metric]:
        cumulative, buckets = 0, []
        for bound, n in zip((*self._bounds, float("inf")), self._counts):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        for name in self._names:
            h = HistogramMetricFamily(name, self._doc, labels=["model_name"])
            h.add_metric([self._model], buckets, self.sum)
            yield h


class EngineMetrics:
    def __init__(self, engine_kind: str, model: str, engine: Engine, now: Callable[[], float]) -> None:
        names = ENGINE_NAMES[engine_kind]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(names, model, engine, now))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self._ttft = Histogram(
            names.ttft, "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS, **kw
        ).labels(model)
        self._tpot_request = Histogram(
            names.tpot_request,
            "Histogram of time_per_output_token_seconds per request.",
            buckets=TPOT_BUCKETS,
            **kw,
        ).labels(model)
        self.inter_token = WeightedHistogram(
            names.itl, "Histogram of inter-token latency in seconds.", TPOT_BUCKETS, model
        )
        self.registry.register(self.inter_token)
        self._e2e = Histogram(
            names.e2e, "Histogram of end to end request latency in seconds.", buckets=E2E_BUCKETS, **kw
        ).labels(model)

    def observe_first_token(self, seq: SeqState) -> None:
        """Latencies are simulated seconds: what the simulated GPU would report, whatever the time scale."""
        if seq.first_token_time is not None:
            self._ttft.observe(max(0.0, seq.first_token_time - seq.arrival))

    def observe_finished(self, seq: SeqState) -> None:
        if seq.first_token_time is None or seq.finish_time is None:
            return
        self._e2e.observe(max(0.0, seq.finish_time - seq.arrival))
        if seq.num_output > 1:
            self._tpot_request.observe((seq.finish_time - seq.first_token_time) / (seq.num_output - 1))

    def observe_step(self, res: StepResult) -> None:
        """Every non-first token's gap since the sequence's previous token, as vLLM and SGLang count it."""
        for gap, n in res.inter_token:
            self.inter_token.observe(gap, n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
