"""Merging the workers' /metrics: counts add up, shared readings are reported once."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from extproc.server.metrics_merge import merge

WORKER_0 = """# HELP extproc_requests_total Requests handled
# TYPE extproc_requests_total counter
extproc_requests_total{code="200",pod="a"} 3.0
extproc_requests_created{code="200",pod="a"} 1.7e9
# HELP extproc_pod_running_requests In flight across gateways
# TYPE extproc_pod_running_requests gauge
extproc_pod_running_requests{pod="a"} 5.0
# HELP extproc_pod_local_running_requests Routed here
# TYPE extproc_pod_local_running_requests gauge
extproc_pod_local_running_requests{pod="a"} 2.0
# HELP extproc_slo_queue_wait_seconds Wait
# TYPE extproc_slo_queue_wait_seconds histogram
extproc_slo_queue_wait_seconds_bucket{le="1.0"} 1.0
extproc_slo_queue_wait_seconds_bucket{le="+Inf"} 2.0
extproc_slo_queue_wait_seconds_count 2.0
extproc_slo_queue_wait_seconds_sum 1.5
"""
WORKER_1 = WORKER_0.replace("} 3.0", "} 4.0").replace("local_running_requests{pod=\"a\"} 2.0",
                                                        "local_running_requests{pod=\"a\"} 3.0")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_counters_and_histograms_add_up_and_shared_gauges_are_reported_once():
    merged = samples(merge([WORKER_0, WORKER_1]))
    assert merged[("extproc_requests_total", (("code", "200"), ("pod", "a")))] == 7
    assert merged[("extproc_pod_running_requests", (("pod", "a"),))] == 5
    assert merged[("extproc_pod_local_running_requests", (("pod", "a"),))] == 5
    assert merged[("extproc_slo_queue_wait_seconds_bucket", (("le", "+Inf"),))] == 4
    assert merged[("extproc_slo_queue_wait_seconds_sum", ())] == 3.0
    assert not any(name.endswith("_created") for name, _ in merged)


def test_label_values_survive_escaping():
    text = '# TYPE x gauge\nx{pod="a\\"b\\\\c"} 1.0\n'
    assert samples(merge([text])) == {("x", (("pod", 'a"b\\c'),)): 1.0}
