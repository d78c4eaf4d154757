"""Engine metric name maps and the pod health state machine (fake clock)."""

from __future__ import annotations

import pytest

from extproc.telemetry.engine_metrics import MetricsParseError, parse_metrics
from extproc.telemetry.health import PodHealth

KEY = ("m", "p0", "10.0.0.1:8000")

VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3
vllm:num_requests_running{model_name="b"} 2
vllm:num_requests_waiting{model_name="a"} 4
vllm:kv_cache_usage_perc{model_name="a"} 0.25
vllm:kv_cache_usage_perc{model_name="b"} 0.75
vllm:cpu_cache_usage_perc{model_name="a"} 0.1
"""


def test_vllm_counts_sum_and_usage_averages():
    s = parse_metrics(VLLM, "vllm", at=1.0)
    assert (s.running, s.waiting, s.kv_usage, s.cpu_kv_usage, s.at) == (5, 4, 0.5, 0.1, 1.0)


def test_older_vllm_name_and_nan():
    s = parse_metrics("vllm:gpu_cache_usage_perc 0.4\nvllm:num_requests_running 1\n", "vllm", 0)
    assert s.kv_usage == 0.4 and s.waiting is None
    assert parse_metrics("vllm:kv_cache_usage_perc NaN\n", "vllm", 0).kv_usage is None


def test_sglang_names():
    text = "sglang:num_running_reqs 7\nsglang:num_queue_reqs 2\nsglang:token_usage 0.9\n"
    s = parse_metrics(text, "sglang", 0)
    assert (s.running, s.waiting, s.kv_usage) == (7, 2, 0.9)


def test_trtllm_kv():
    assert parse_metrics("trtllm_kv_cache_utilization 0.3\n", "trtllm", 0).kv_usage == 0.3


def test_garbage_is_an_error():
    with pytest.raises(MetricsParseError):
        parse_metrics("this is { not prometheus\n", "vllm", 0)


def test_connect_failure_ejects_at_once_and_a_probe_brings_it_back():
    h = PodHealth(probe_initial=0.5, probe_max=4)
    h.observe_response(KEY, 0, connect_failure=True, now=10.0)
    assert not h.healthy(KEY)
    assert h.due_probes(10.2) == [] and h.due_probes(10.5) == [KEY]
    h.probe_result(KEY, False, 10.5)
    assert h.due_probes(11.0) == [] and h.due_probes(11.5) == [KEY]  # backoff doubled to 1 s
    for t in (12, 14, 16, 18):
        h.probe_result(KEY, False, t)
    assert h.due_probes(21.9) == [] and h.due_probes(22.0) == [KEY]  # capped at 4 s
    h.probe_result(KEY, True, 22.0)
    assert h.healthy(KEY) and h.due_probes(30) == []


def test_repeated_5xx_eject_and_a_success_resets_the_streak():
    h = PodHealth(failures_to_eject=3)
    for status in (500, 503, 200, 500, 502):
        h.observe_response(KEY, status, False, 0)
    assert h.healthy(KEY)
    h.observe_response(KEY, 500, False, 0)
    assert not h.healthy(KEY)


def test_scrapes_refused_eject_now_timeouts_after_three():
    h = PodHealth()
    h.observe_scrape(KEY, ok=False, connect_refused=False, now=0)
    h.observe_scrape(KEY, ok=False, connect_refused=False, now=1)
    assert h.healthy(KEY)
    h.observe_scrape(KEY, ok=False, connect_refused=False, now=2)
    assert not h.healthy(KEY)
    h.observe_scrape(KEY, ok=True, connect_refused=False, now=3)
    assert h.healthy(KEY)
    h.observe_scrape(KEY, ok=False, connect_refused=True, now=4)
    assert not h.healthy(KEY)
    h.forget([])
    assert h.healthy(KEY)


def test_routing_views_follow_ejection_and_readmission_at_once():
    from extproc.pool.pod import Pod
    from extproc.sharing.shared import LocalState
    from extproc.state.accounting import Accounting

    pods = [Pod("m", "a", "10.0.0.1:8000"), Pod("m", "b", "10.0.0.2:8000")]
    acc = Accounting(LocalState())
    views = acc.view_cache.views("m", pods, 0.0)
    acc.health.observe_response(pods[0].key, 0, True, 0.01)  # connection refused
    assert [v.healthy for v in acc.view_cache.views("m", pods, 0.02)] == [False, True]  # cached, yet current
    acc.health.probe_result(pods[0].key, True, 0.1)  # a probe succeeded
    # the same cached views, updated
    assert acc.view_cache.views("m", pods, 0.11) is views and views[0].healthy


def test_only_a_pod_whose_address_refused_comes_back_as_restarted():
    """Back after refused connections: likely a new engine, its speed re-measured. Back after slow
    scrapes or 5xx answers: the same process, what was measured of it stands."""
    h = PodHealth(failures_to_eject=2)
    seen: list[tuple[bool, bool]] = []
    h.on_change = lambda key, healthy, restarted: seen.append((healthy, restarted))
    h.observe_scrape(KEY, False, connect_refused=False, now=1.0)
    h.observe_scrape(KEY, False, connect_refused=False, now=2.0)  # timed out twice: out
    h.observe_scrape(KEY, True, connect_refused=False, now=3.0)
    h.observe_response(KEY, 0, connect_failure=True, now=4.0)     # nothing listening: out
    h.probe_result(KEY, True, 5.0)
    assert seen == [(False, False), (True, False), (False, False), (True, True)]


# Sample scrapes in each engine's own words, for the model-server protocol's three metrics (Gateway API
# Inference Extension, proposal 003: TotalRunningRequests, TotalQueuedRequests, KVCacheUtilization).
TRTLLM_SERVE = """# HELP trtllm_num_requests_running Number of requests currently running
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{model_name="llama",engine_type="trtllm"} 6.0
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{model_name="llama",engine_type="trtllm"} 2.0
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{model_name="llama",engine_type="trtllm"} 0.4
"""
TRITON_TRTLLM = """# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 7
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 64
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 9
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 3
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 4000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 1000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.25
"""
EARLIER_TRTLLM = ("trtllm_num_active_requests 4\ntrtllm_num_queued_requests 1\n"
                  "trtllm_kv_cache_utilization 0.5\n")
SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="llama"} 11.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="llama"} 5.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="llama"} 0.62
"""


@pytest.mark.parametrize(("text", "expected"), [
    (VLLM, (5, 4, 0.5)),
    (SGLANG, (11, 5, 0.62)),
    (TRTLLM_SERVE, (6, 2, 0.4)),
    (TRITON_TRTLLM, (7, 3, 0.25)),  # the protocol's rows: scheduled, waiting, fraction; not the others
    (EARLIER_TRTLLM, (4, 1, 0.5)),
])
def test_every_name_the_model_server_protocol_lists_is_read(text: str, expected: tuple) -> None:
    for engine in ("vllm", "sglang", "trtllm"):  # whatever the pod's engine label says
        s = parse_metrics(text, engine, 0)
        assert (s.running, s.waiting, s.kv_usage) == pytest.approx(expected), engine


def test_an_engine_reads_its_own_names_first() -> None:
    both = TRTLLM_SERVE + "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
    assert parse_metrics(both, "trtllm", 0).running == 6
    assert parse_metrics(both, "vllm", 0).running == 1
