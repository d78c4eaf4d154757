"""The Grafana dashboard in deploy/observability queries only metrics that exist: every metric name in
its PromQL is found in a live scrape of `extproc serve`'s /metrics (with a pod and Redis configured, so
the per-pod and Redis series are present), in the optimizer's exposition for PodAutoscalers, or in the
optimizer's own /metrics."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.localstack import Proc, free_port, http_get, port_open
from extproc.optimizer.metrics import optimizer_registry
from extproc.optimizer.monitor import Fleet
from extproc.optimizer.service import metrics_text
from tests.unit.test_deploy_manifests import one, render

PROMQL_WORDS = {"sum", "avg", "max", "min", "count", "rate", "irate", "increase", "by", "without", "on",
                "ignoring", "group_left", "group_right", "and", "or", "unless", "histogram_quantile",
                "label_values", "topk", "bottomk", "clamp_min", "clamp_max", "abs", "offset", "bool"}


def queried_metrics(expr: str) -> set[str]:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r",\s*[a-z_]+\s*\)", ")", expr)  # label_values(metric, label)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {n for n in names if n not in PROMQL_WORDS and not n.startswith("__")}


def test_queried_metrics_parser() -> None:
    assert queried_metrics('sum by (model, pod) (rate(a_total{model=~"$m", code!~"2.."}[$__rate_interval])) '
                           '/ on (model, pod) group_left (gpu) avg by (model, pod) (b:c{x="y"}) / 100') \
        == {"a_total", "b:c"}
    assert queried_metrics("label_values(extproc_x, model)") == {"extproc_x"}


def scrape_names(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
    return names


def test_dashboard_queries_only_exported_metrics(tmp_path: Path) -> None:
    config_map = one(render("observability"), "ConfigMap", "extproc-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["extproc-dashboard.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    queried = set().union(*(queried_metrics(e) for e in exprs))

    config = tmp_path / "gateway.yaml"
    config.write_text(json.dumps({"models": {"m": {"pods": [
        {"name": "p", "address": "127.0.0.1:9", "labels": {"gpu": "L20"}}]}},
        "redis": {"url": f"redis://127.0.0.1:{free_port()}/0"}}))  # nothing listens: the gauge is 0
    port, admin = free_port(), free_port()
    gateway = Proc("gateway", [sys.executable, "-m", "extproc", "serve", "--config", str(config),
                               "--port", str(port), "--admin-port", str(admin)], tmp_path)
    try:
        gateway.wait_ready(lambda: port_open(admin))
        status, body = http_get(f"http://127.0.0.1:{admin}/metrics")
    finally:
        gateway.stop()
    assert status == 200
    text = body.decode()
    info = 'extproc_pod_info{deployment="",engine="vllm",gpu="L20",model="m",namespace="default",pod="p"} 1.0'
    assert info in text
    optimizer = generate_latest(optimizer_registry(Fleet(), lambda: 0.0)).decode()
    exported = scrape_names(text) | scrape_names(metrics_text("m", 100)) | scrape_names(optimizer)
    assert "extproc_pod_capacity_tokens_per_second" in exported or "extproc_pod_running_requests" in exported
    assert queried <= exported, f"the dashboard queries metrics nobody exports: {sorted(queried - exported)}"
    for wanted in ("extproc_requests_total", "extproc_pod_running_requests", "extproc_pod_kv_free_ratio",
                   "extproc_pod_capacity_tokens_per_second", "extproc_output_tokens_total",
                   "extproc_pod_info", "vllm:deployment_replicas",  # the panels the issue asks for
                   "extproc_optimizer_plan_cost", "extproc_optimizer_solve_seconds",
                   "extproc_optimizer_cells_skipped", "extproc_optimizer_last_plan_age_seconds",
                   "extproc_optimizer_burst_requests_per_second"):
        assert wanted in queried, wanted
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
