"""The Inference Extension's series from the gateway's state: the pool gauges' averages and naming, the
per-objective hook's rules (which records count, which observe)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from extproc.config import parse
from extproc.config.schema import Config
from extproc.pool import Pool
from extproc.pool.pod import Pod
from extproc.server.inference_metrics import InferencePoolCollector, ObjectiveMetrics
from extproc.vocabulary import PodView, RequestRecord


@dataclass
class FakeGateway:
    config: Config
    views_by_model: dict[str, list[PodView]]
    pool: Pool = field(init=False)

    def __post_init__(self) -> None:
        self.pool = Pool([v.pod for vs in self.views_by_model.values() for v in vs], self.views_by_model)

    def clock(self) -> float:
        return 0.0

    def views(self, model: str, now: float) -> list[PodView]:
        return self.views_by_model.get(model, [])


def view(model: str, name: str, *, running: int, queued: float, kv_free: float | None) -> PodView:
    return PodView(Pod(model, name, f"10.0.0.{len(name)}:8000"), running=running, queued=queued,
                   kv_free=kv_free)


def readings(gateway: FakeGateway) -> dict[tuple[str, str], float]:
    return {(m.name, s.labels["name"]): s.value for m in InferencePoolCollector(gateway).collect()
            for s in m.samples}


def test_pool_gauges_average_over_ready_pods_per_model() -> None:
    gw = FakeGateway(parse({"models": {"a": {"pods": []}, "b": {"pods": []}}}, {}), {
        "a": [view("a", "p", running=4, queued=2, kv_free=0.8),
              view("a", "q", running=2, queued=0, kv_free=0.4)],
        "b": []})
    got = readings(gw)
    assert got[("inference_pool_ready_pods", "a")] == 2
    assert got[("inference_pool_average_running_requests", "a")] == 3
    assert got[("inference_pool_average_queue_size", "a")] == 1
    assert abs(got[("inference_pool_average_kv_cache_utilization", "a")] - 0.4) < 1e-9
    # a pool with no ready pod: 0 ready pods, no averages of nothing
    assert got[("inference_pool_ready_pods", "b")] == 0
    assert ("inference_pool_average_queue_size", "b") not in got


def test_a_followed_inferencepool_is_one_pool_under_its_name() -> None:
    config = parse({"discovery": {"inferencepool": {"name": "llama", "namespace": "ns"}}}, {})
    gw = FakeGateway(config, {"llama-8b": [view("llama-8b", "p", running=1, queued=0, kv_free=None)],
                              "llama": [view("llama", "q", running=3, queued=4, kv_free=0.5)]})
    got = readings(gw)
    assert {name for _, name in got} == {"llama"}
    assert got[("inference_pool_ready_pods", "llama")] == 2
    assert got[("inference_pool_average_queue_size", "llama")] == 2
    assert got[("inference_pool_average_kv_cache_utilization", "llama")] == 0.5  # only pods that report


def record(**over) -> RequestRecord:
    base = dict(request_id="r", model="m", pod=Pod("m", "p", "10.0.0.1:8000"), strategy="load-balance",
                status=200, prompt_tokens=10, output_tokens=11, token_source="usage", ttfb_s=0.5, e2e_s=1.5,
                stream=True)
    return RequestRecord(**{**base, **over})


def test_objective_series_count_every_record_and_observe_successes() -> None:
    registry = CollectorRegistry()
    hook = ObjectiveMetrics(registry)
    labels = {"model_name": "m", "target_model_name": "m"}
    hook.post_response(record(), 0)
    hook.post_response(record(stream=False, output_tokens=4), 0)
    hook.post_response(record(status=503), 0)
    hook.post_response(record(aborted=True), 0)

    def value(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(name, {**labels, **extra})

    assert value("inference_objective_request_total", priority="0") == 4
    assert value("inference_objective_request_duration_seconds_count") == 2
    assert value("inference_objective_output_tokens_sum") == 15
    assert value("inference_objective_input_tokens_sum") == 20
    assert value("inference_objective_request_ttft_seconds_count") == 1  # streamed only
    assert value("inference_objective_request_tpot_seconds_sum") == (1.5 - 0.5) / 10
    assert value("inference_objective_normalized_time_per_output_token_seconds_sum") == 1.5 / 11 + 1.5 / 4
    assert value("inference_objective_request_duration_seconds_bucket", le="3600.0") == 2
