"""The optimizer service over HTTP, with an in-memory stand-in for Redis (the real one: integration tests)."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from extproc.gpu_profiles import ProfileStore, dump_profile
from extproc.optimizer.deployments import Deployment, StaticDeploymentSource
from extproc.optimizer.policy import PlanPolicy
from extproc.optimizer.service import OptimizerService, ServiceSettings, metrics_text
from extproc.slo.fleet_factors import decode, factors_key
from extproc.tracing import TraceRecorder
from tests.support.get_pipeline import GetPipeline
from tests.unit.optimizer.support import LONG, SHORT, profile

NOW = 1_700_000_000.0
MODEL = "llama"


class MemoryRedis:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.ttl: dict[str, int | None] = {}
        self.down = False

    async def set(self, key: str, value: str, ex: int | None = None) -> None:
        if self.down:
            raise ConnectionError("redis is down")
        self.data[key] = value
        self.ttl[key] = ex

    async def mget(self, keys: list[str]) -> list[str | None]:
        if self.down:
            raise ConnectionError("redis is down")
        return [self.data.get(k) for k in keys]

    def pipeline(self, transaction: bool = False) -> GetPipeline:
        return GetPipeline(self)

    async def smembers(self, key: str) -> set[str]:
        if self.down:
            raise ConnectionError("redis is down")
        return set()  # no profile index: profiles are found by their deployments' keys

    async def scan_iter(self, match: str, count: int = 10) -> AsyncIterator[str]:
        if self.down:
            raise ConnectionError("redis is down")
        for k in list(self.data):
            if fnmatch.fnmatchcase(k, match):
                yield k

    def traffic(self, end: float, short: int = 0, long: int = 0) -> None:
        """One window of completed requests ending at `end` (as the gateway's recorder writes it)."""
        r = TraceRecorder()
        for _ in range(short):
            r.arrived(MODEL, end - 5)
            r.completed(MODEL, *SHORT, end - 5)
        for _ in range(long):
            r.arrived(MODEL, end - 5)
            r.completed(MODEL, *LONG, end - 5)
        self.data.update(r.due(end))


DEPLOYMENTS = [
    Deployment("default", "a", MODEL, min_replicas=1),
    Deployment("default", "b", MODEL),
    Deployment("prod", "other", "other-model", min_replicas=2, replicas=5),
]


@pytest.fixture
def redis() -> MemoryRedis:
    r = MemoryRedis()
    r.data["aibrix:profile_llama_a"] = json.dumps(dump_profile(profile("a", 1.0, short=10, long=1)))
    r.data["aibrix:profile_llama_b"] = json.dumps(dump_profile(profile("b", 1.0, short=2, long=5)))
    return r


@pytest.fixture
async def service(redis: MemoryRedis) -> OptimizerService:
    svc = OptimizerService(
        StaticDeploymentSource(DEPLOYMENTS),
        ProfileStore(),
        redis,
        # plans on the mean load: counts by hand
        ServiceSettings(window_seconds=240, policy=PlanPolicy(headroom=0.0)),
        clock=lambda: NOW,
    )
    return svc


@pytest.fixture
async def client(service: OptimizerService) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(service.app())) as c:
        yield c


async def metric(client: TestClient, path: str) -> str:
    r = await client.get(path)
    assert r.status == 200, await r.text()
    return (await r.text()).splitlines()[-1]


def test_metrics_text_is_aibrixs() -> None:
    assert metrics_text("m", 250) == (
        "# HELP vllm:deployment_replicas Number of suggested replicas.\n"
        "# TYPE vllm:deployment_replicas gauge\n"
        'vllm:deployment_replicas{model_name="m"} 250\n'
    )
    assert 'model_name="a\\"b"' in metrics_text('a"b', 0)


async def test_no_load_reports_min_replicas_in_hundredths(
    service: OptimizerService, client: TestClient
) -> None:
    await service.tick(NOW)
    assert await metric(client, "/metrics/default/a") == 'vllm:deployment_replicas{model_name="llama"} 100'
    assert await metric(client, "/metrics/default/b") == 'vllm:deployment_replicas{model_name="llama"} 0'
    assert (
        await metric(client, "/metrics/prod/other")
        == 'vllm:deployment_replicas{model_name="other-model"} 200'
    )


async def test_traces_drive_the_plan(
    service: OptimizerService, client: TestClient, redis: MemoryRedis
) -> None:
    redis.traffic(NOW, short=200, long=100)  # latest window: 20 short/s, 10 long/s
    await service.tick(NOW)
    assert await metric(client, "/metrics/default/a") == 'vllm:deployment_replicas{model_name="llama"} 200'
    assert await metric(client, "/metrics/default/b") == 'vllm:deployment_replicas{model_name="llama"} 200'
    state = service.fleet.models[MODEL]
    assert state.plan is not None and state.plan.cost == 4.0 and state.error is None
    # min_replicas is a no-load floor only: with load, a's 2 is the plan's, not max(plan, min)
    redis.data.clear()
    redis.traffic(NOW, long=10)  # 1 long/s -> b alone: 1 replica; a falls to 0 despite min_replicas=1
    await service.tick(NOW)
    assert (await metric(client, "/metrics/default/a")).endswith(" 0")
    assert (await metric(client, "/metrics/default/b")).endswith(" 100")


async def test_each_replan_publishes_the_feedbacks_cuts_for_the_gateways(
    service: OptimizerService, redis: MemoryRedis
) -> None:
    """The SLO routers hold a cut deployment's pods to that share of their budgets (slo/fleet_factors.py);
    the key expires so a stopped optimizer's cuts do not outlive it."""
    redis.traffic(NOW, short=200, long=100)
    await service.tick(NOW)
    assert decode(redis.data[factors_key(MODEL)]) == {}  # no cut yet
    state = service.fleet.models[MODEL]
    # the feedback keys its factors as the plan names deployments, `namespace/name` (profile_for)
    assert sorted(p.gpu for p in service.profiles_of(state).values() if p) == ["default/a", "default/b"]
    state.feedback.factors.update({"default/a": 0.8, "default/b": 1.3})  # as Feedback.update does
    await service.tick(NOW + 10)
    assert decode(redis.data[factors_key(MODEL)]) == {"a": 0.8}  # by name, as routers key them; no raise
    assert redis.ttl[factors_key(MODEL)] == 60  # six 10 s re-plans


async def test_override_and_clear(service: OptimizerService, client: TestClient, redis: MemoryRedis) -> None:
    await service.tick(NOW)
    r = await client.put("/scale/default/b", json={"replicas": 3})
    assert r.status == 200 and (await r.json())["message"] == "Scaled to 3"
    assert (await metric(client, "/metrics/default/b")).endswith(" 300")  # scaled like the plan, not raw
    await client.put("/scale/default/a", json={"replicas": 0})
    redis.traffic(NOW, short=200)
    await service.tick(NOW)
    assert (await metric(client, "/metrics/default/a")).endswith(" 0")  # the override beats the plan
    r = await client.put("/scale/default/a", json={"replicas": -1})  # clears the model's overrides
    assert r.status == 200
    assert (await metric(client, "/metrics/default/a")).endswith(" 200")
    assert (await metric(client, "/metrics/default/b")).endswith(" 0")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"replicas": "3"}, "replicas"),
        ({"replicas": -2}, "replicas"),
        ({"replicas": True}, "replicas"),
        ({}, "replicas"),
    ],
)
async def test_bad_scale_bodies(client: TestClient, body: dict, param: str) -> None:
    r = await client.put("/scale/default/a", json=body)
    assert r.status == 400
    error = (await r.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error"


async def test_errors_are_openai_style_4xx(service: OptimizerService, client: TestClient) -> None:
    await service.tick(NOW)
    for method, path, status, code in [
        ("GET", "/metrics/default/nope", 404, "deployment_not_monitored"),
        ("PUT", "/scale/default/nope", 404, "deployment_not_monitored"),
        ("GET", "/dash/nope", 404, "model_not_monitored"),
        ("GET", "/elsewhere", 404, "unknown_route"),
        ("POST", "/metrics/default/a", 405, "method_not_allowed"),
        ("POST", "/monitor/default/nope", 404, "deployment_not_found"),
    ]:
        r = await client.request(method, path, json={"replicas": 1} if method == "PUT" else None)
        assert r.status == status, (method, path)
        assert (await r.json())["error"]["code"] == code
    r = await client.put("/scale/default/a", data=b"{nope")
    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_body"


async def test_monitor_stop_and_start(service: OptimizerService, client: TestClient) -> None:
    await service.tick(NOW)
    r = await client.delete("/monitor/default/b")
    assert r.status == 200
    assert (await client.get("/metrics/default/b")).status == 404
    await service.tick(NOW)  # a refresh from the source does not bring it back
    assert (await client.get("/metrics/default/b")).status == 404
    r = await client.post("/monitor/default/b")
    assert (await r.json())["message"] == "Deployment optimization started"
    assert (await client.get("/metrics/default/b")).status == 200
    r = await client.post("/monitor/default/b")
    assert (await r.json())["message"] == "Deployment optimization already started"
    assert (await client.delete("/monitor/default/nope")).status == 404


async def test_monitor_adds_a_deployment_with_a_body(service: OptimizerService, client: TestClient) -> None:
    await service.tick(NOW)
    r = await client.post("/monitor/ml/new", json={"model": "fresh", "min_replicas": 2})
    assert r.status == 200
    assert await metric(client, "/metrics/ml/new") == 'vllm:deployment_replicas{model_name="fresh"} 200'
    r = await client.post("/monitor/ml/bad", json={"model": "fresh", "min_replicas": -1})
    assert r.status == 400 and (await r.json())["error"]["param"] == "min_replicas"


async def test_unservable_load_keeps_configured_replicas_and_says_why(
    service: OptimizerService, client: TestClient, redis: MemoryRedis
) -> None:
    redis.data["aibrix:profile_llama_a"] = json.dumps(
        dump_profile(profile("a", 1.0, short=10, long=0, created=2))
    )
    redis.data["aibrix:profile_llama_b"] = json.dumps(
        dump_profile(profile("b", 1.0, short=2, long=0, created=2))
    )
    redis.traffic(NOW, long=10)
    await service.tick(NOW)
    state = service.fleet.models[MODEL]
    assert state.plan is None and "input≈2048 output≈512" in (state.error or "")
    assert (await metric(client, "/metrics/default/a")).endswith(" 100")  # replicas unset: min_replicas


async def test_redis_outage_keeps_the_last_plan(
    service: OptimizerService, client: TestClient, redis: MemoryRedis
) -> None:
    redis.traffic(NOW, short=200, long=100)
    await service.tick(NOW)
    redis.down = True
    await service.tick(NOW + 10)
    state = service.fleet.models[MODEL]
    assert "redis is down" in (state.error or "")
    assert (await metric(client, "/metrics/default/a")).endswith(" 200")


async def test_newer_profile_wins(service: OptimizerService, redis: MemoryRedis, tmp_path: Any) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps(dump_profile(profile("a", 7.0, short=1, long=1, created=0.5))))
    service.profile_files = lambda: [path]
    await service.tick(NOW)
    d = service.fleet.models[MODEL].deployments["default/a"]
    p = service.store.profile_for(d.model, d.namespace, d.name)
    assert p is not None and p.cost == 1.0 and p.gpu == "default/a"  # Redis' created=1.0 beats the file's
    path.write_text(json.dumps(dump_profile(profile("a", 7.0, short=1, long=1, created=9.0))))
    await service.tick(NOW + 20)
    p = service.store.profile_for(d.model, d.namespace, d.name)
    assert p is not None and p.cost == 7.0


async def test_dashboard_is_self_contained(
    service: OptimizerService, client: TestClient, redis: MemoryRedis
) -> None:
    redis.traffic(NOW, short=200, long=100)
    await service.tick(NOW)
    r = await client.get("/dash/llama")
    page = await r.text()
    assert r.status == 200 and r.content_type == "text/html"
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert "url(" not in page
    data = await (await client.get("/dash/llama/data")).json()
    assert data["plan"]["replicas"] == {"default/a": 2, "default/b": 2} and data["plan"]["cost"] == 4.0
    assert {(c["in_log2"], c["out_log2"]) for c in data["heatmap"]} == {(7, 4), (11, 9)}
    assert [d["reported"] for d in data["deployments"]] == [2, 2] and data["reported_cost"] == 4.0
    assert data["history"][-1]["replicas"] == {"default/a": 2, "default/b": 2}


async def test_a_burst_shows_on_the_dashboard_and_in_the_metrics(
    service: OptimizerService, client: TestClient, redis: MemoryRedis
) -> None:
    for k in range(23, 1, -1):  # 220 s at 20 req/s, then two windows at 40 req/s
        redis.traffic(NOW - 10 * k, short=200)
    redis.traffic(NOW - 10, short=400)
    redis.traffic(NOW, short=400)
    await service.tick(NOW)  # the window read: the 24 ending after NOW - 240 s
    burst = (await (await client.get("/dash/llama/data")).json())["burst"]
    # these profiles state no TPOT SLO, so strain cannot be read: the burst is planned for
    assert burst == {"rps": 40.0, "level": pytest.approx(5200 / 240, abs=1e-3), "planned": True}
    seen = await own_metrics(client)
    series = ("extproc_optimizer_burst_requests_per_second", (("handling", "planned"), ("model", MODEL)))
    assert seen[series] == 40.0
    redis.traffic(NOW + 10, short=200)  # the burst is over: no line, no series
    await service.tick(NOW + 10)
    assert (await (await client.get("/dash/llama/data")).json())["burst"] is None
    assert not any(name == series[0] for name, _ in await own_metrics(client))


async def test_page_escapes_what_it_inlines(service: OptimizerService, client: TestClient) -> None:
    from extproc.optimizer.dashboard import render_page

    page = render_page({"model": "</script><b>x", "deployments": []})
    assert "</script><b>" not in page.split('id="initial">', 1)[1].split("</script>", 1)[0]
    assert "&lt;/script&gt;" in page


async def own_metrics(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = await client.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(await r.text()) for s in f.samples}


async def test_own_metrics_follow_the_plan_and_age_while_replanning_fails(
    service: OptimizerService, client: TestClient, redis: MemoryRedis
) -> None:
    m = (("model", MODEL),)
    assert await own_metrics(client) == {}  # nothing planned yet: no series, not zeros
    redis.traffic(NOW, short=200, long=100)
    await service.tick(NOW)
    seen = await own_metrics(client)
    assert seen[("extproc_optimizer_plan_cost", m)] == 4.0
    assert seen[("extproc_optimizer_cells_skipped", m)] == 0
    assert 0 < seen[("extproc_optimizer_solve_seconds", m)] < 30
    assert seen[("extproc_optimizer_demand_requests_per_second", m)] == pytest.approx(30.0)
    assert seen[("extproc_optimizer_last_plan_age_seconds", m)] == 0.0
    assert seen[("extproc_optimizer_replicas", (("deployment", "a"), ("model", MODEL),
                                                 ("namespace", "default")))] == 2
    assert seen[("extproc_optimizer_replicas", (("deployment", "other"), ("model", "other-model"),
                                                 ("namespace", "prod")))] == 2  # no load: its floor

    redis.down = True  # the last plan stays; its age says how stale it is
    service.clock = lambda: NOW + 30
    await service.tick(NOW + 30)
    assert (await own_metrics(client))[("extproc_optimizer_last_plan_age_seconds", m)] == 30.0


async def test_own_metrics_count_the_cells_left_out(service: OptimizerService, client: TestClient,
                                                    redis: MemoryRedis) -> None:
    for name, short in (("a", 10), ("b", 2)):
        redis.data[f"aibrix:profile_llama_{name}"] = json.dumps(
            dump_profile(profile(name, 1.0, short=short, long=0, created=2)))
    redis.traffic(NOW, short=100, long=10)  # nobody serves the long shape: planned without it
    await service.tick(NOW)
    assert (await own_metrics(client))[("extproc_optimizer_cells_skipped", (("model", MODEL),))] == 1

