"""The optimizer finds its Deployments in the Kubernetes API (extproc/optimizer/kubernetes.py), against the
fake API server over real HTTP (tests/support/kube_api.py): labels, min_replicas, spec.replicas, a
Deployment that comes or goes within one re-plan, POST /monitor checking that it exists; and
`extproc optimizer` wired to it from its config file."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from extproc.gpu_profiles import ProfileStore
from extproc.localstack import VENV_BIN, Proc, free_port, http_get
from extproc.optimizer.deployments import ConfigError, Deployment, KubernetesSettings, parse_config
from extproc.optimizer.kubernetes import KubernetesDeploymentSource
from extproc.optimizer.service import OptimizerService
from tests.support.kube_api import FakeApiServer, eventually, fake_api_server
from tests.support.redis_server import RedisServer

MODEL = "deepseek-coder-7b"


def deployment_object(name: str, *, namespace: str = "default", replicas: int | None = 2,
                      labels: dict[str, str] | None = None, model: str | None = MODEL) -> dict[str, Any]:
    all_labels = {"app": name, **({"model.aibrix.ai/name": model} if model else {}), **(labels or {})}
    spec: dict[str, Any] = {"selector": {"matchLabels": {"app": name}}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "labels": all_labels}, "spec": spec}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[FakeApiServer]:
    async with fake_api_server(tmp_path) as server:
        yield server


async def running(source: KubernetesDeploymentSource) -> asyncio.Task:
    task = asyncio.create_task(source.run())
    await eventually(lambda: source.synced, "the first list of Deployments")
    return task


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def listed(source: KubernetesDeploymentSource) -> dict[str, Deployment]:
    return {d.key: d for d in await source.deployments()}


async def test_labelled_deployments_are_found_with_their_floor_and_replicas(api: FakeApiServer) -> None:
    await api.change("ADDED", deployment_object("ds-l20", replicas=4))
    await api.change("ADDED", deployment_object("ds-v100", replicas=0,
                                                labels={"model.aibrix.ai/min_replicas": "1"}))
    await api.change("ADDED", deployment_object("ds-bad", labels={"model.aibrix.ai/min_replicas": "one"}))
    source = KubernetesDeploymentSource(KubernetesSettings(kubeconfig=api.kubeconfig))
    task = await running(source)
    try:
        assert await listed(source) == {
            "default/ds-l20": Deployment("default", "ds-l20", MODEL, 0, 4),
            "default/ds-v100": Deployment("default", "ds-v100", MODEL, 1, 0),
        }  # ds-bad's label does not parse: left out (and logged), not guessed
        await api.change("ADDED", deployment_object("ds-a100", replicas=None))  # spec.replicas unset
        await api.change("MODIFIED", deployment_object("ds-l20", replicas=6))
        await api.change("DELETED", deployment_object("ds-v100"))
        await eventually(lambda: {d.key: d.replicas for w in source.watchers for d in w.items()}
                         == {"default/ds-l20": 6, "default/ds-a100": None}, "the changes through the watch")
        assert len(api.lists) == 1
    finally:
        await stop(task)


def autoscaler_object(kind: str, name: str, target: str, most: int,
                      namespace: str = "default") -> dict[str, Any]:
    api_version = "autoscaling/v2" if kind == "HorizontalPodAutoscaler" else "autoscaling.aibrix.ai/v1alpha1"
    return {"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": namespace},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
                     "minReplicas": 0, "maxReplicas": most}}


async def test_the_autoscalers_max_replicas_bound_the_plan(api: FakeApiServer) -> None:
    """An HPA (or KEDA's, or AIBrix's PodAutoscaler) that scales a Deployment caps what the plan counts on:
    the lowest of its maxReplicas and the Deployment's own max label, followed through the watch."""
    await api.change("ADDED", deployment_object("ds-l20", labels={"model.aibrix.ai/max_replicas": "9"}))
    await api.change("ADDED", deployment_object("ds-v100"))
    await api.change("ADDED", deployment_object("ds-a100"))
    await api.change("ADDED", autoscaler_object("HorizontalPodAutoscaler", "l20-hpa", "ds-l20", 4))
    await api.change("ADDED", autoscaler_object("PodAutoscaler", "v100-pa", "ds-v100", 7))
    source = KubernetesDeploymentSource(KubernetesSettings(kubeconfig=api.kubeconfig,
                                                           autoscalers=("hpa", "podautoscaler")))
    task = await running(source)
    try:
        assert {k: d.max_replicas for k, d in (await listed(source)).items()} == {
            "default/ds-l20": 4, "default/ds-v100": 7, "default/ds-a100": None}
        await api.change("MODIFIED", autoscaler_object("HorizontalPodAutoscaler", "l20-hpa", "ds-l20", 12))
        await api.change("DELETED", autoscaler_object("PodAutoscaler", "v100-pa", "ds-v100", 7))

        async def caps() -> dict[str, int | None]:
            return {k: d.max_replicas for k, d in (await listed(source)).items()}

        await eventually(lambda: len(source.caps()) == 1 and source.caps()[0].max_replicas == 12,
                         "the autoscalers' changes through the watch")
        # the HPA now allows more than the Deployment's own label: the label's 9 holds
        assert await caps() == {"default/ds-l20": 9, "default/ds-v100": None, "default/ds-a100": None}
    finally:
        await stop(task)


async def test_only_the_configured_namespaces(api: FakeApiServer) -> None:
    await api.change("ADDED", deployment_object("a", namespace="team-a"))
    await api.change("ADDED", deployment_object("b", namespace="team-b"))
    await api.change("ADDED", deployment_object("c", namespace="elsewhere"))
    source = KubernetesDeploymentSource(KubernetesSettings(("team-a", "team-b"), api.kubeconfig))
    task = await running(source)
    try:
        assert set(await listed(source)) == {"team-a/a", "team-b/b"}
        assert await source.read("elsewhere", "c") is None  # outside its namespaces (and its RBAC)
        assert not api.reads
    finally:
        await stop(task)


async def test_a_deployment_that_comes_or_goes_is_planned_for_or_dropped_in_one_replan(
        api: FakeApiServer) -> None:
    await api.change("ADDED", deployment_object("ds-l20", labels={"model.aibrix.ai/min_replicas": "2"}))
    source = KubernetesDeploymentSource(KubernetesSettings(kubeconfig=api.kubeconfig))
    service = OptimizerService(source, ProfileStore())
    task = await running(source)
    try:
        await service.tick(1000.0)
        state = service.fleet.models[MODEL]
        assert list(state.deployments) == ["default/ds-l20"] and state.reported("default/ds-l20") == 2

        await api.change("ADDED", deployment_object("ds-v100", namespace="gpu"))
        await eventually(lambda: len(source.watchers[0].items()) == 2, "ds-v100 seen")
        await service.tick(1010.0)
        assert list(service.fleet.models[MODEL].deployments) == ["default/ds-l20", "gpu/ds-v100"]

        await api.change("DELETED", deployment_object("ds-l20"))
        await api.change("DELETED", deployment_object("ds-v100", namespace="gpu"))
        await eventually(lambda: not source.watchers[0].items(), "both gone")
        await service.tick(1020.0)
        assert MODEL not in service.fleet.models
    finally:
        await stop(task)


async def post(session: aiohttp.ClientSession, url: str, body: dict | None = None) -> tuple[int, dict]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def test_post_monitor_checks_that_the_deployment_exists(api: FakeApiServer) -> None:
    """As AIBrix's POST /monitor reads the Deployment first: a missing one is a 404, an unlabelled one
    needs its model in the body, the API unreachable is a 503 (and nothing is added)."""
    await api.change("ADDED", deployment_object("unlabelled", model=None, replicas=3))
    source = KubernetesDeploymentSource(KubernetesSettings(kubeconfig=api.kubeconfig))
    service = OptimizerService(source, ProfileStore())
    runner = web.AppRunner(service.app(), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    task = await running(source)
    try:
        async with aiohttp.ClientSession() as s:
            status, body = await post(s, f"{base}/monitor/default/nowhere", {"model": MODEL})
            assert status == 404 and body["error"]["code"] == "deployment_not_found"
            assert api.reads == ["/apis/apps/v1/namespaces/default/deployments/nowhere"]

            status, body = await post(s, f"{base}/monitor/default/unlabelled")
            assert status == 400 and body["error"]["param"] == "model"  # no model label, none in the body
            status, body = await post(s, f"{base}/monitor/default/unlabelled", {"model": MODEL})
            assert (status, body["message"]) == (200, "Deployment optimization started")
            state, d = service.fleet.find("default", "unlabelled")
            assert (state.model, d.replicas) == (MODEL, 3)  # spec.replicas read from the API

            kubeconfig = Path(api.kubeconfig)  # now naming a port nothing listens on
            closed = f"127.0.0.1:{free_port()}"
            kubeconfig.write_text(re.sub(r"127\.0\.0\.1:\d+", closed, kubeconfig.read_text()))
            status, body = await post(s, f"{base}/monitor/default/other", {"model": MODEL})
            assert status == 503 and body["error"]["code"] == "kubernetes_unavailable"
            assert "not-a-secret" not in json.dumps(body)
    finally:
        await stop(task)
        await runner.cleanup()


def test_kubernetes_section_is_validated_whole(tmp_path: Path) -> None:
    config = parse_config({"kubernetes": {"namespaces": ["a", "b", "a"]}}, tmp_path)
    assert config.kubernetes == KubernetesSettings(("a", "b"))
    assert parse_config({"kubernetes": {}}, tmp_path).kubernetes == KubernetesSettings()
    for bad, key in (({"namespaces": "a"}, "kubernetes.namespaces"), ({"namespace": ["a"]}, "kubernetes"),
                     ({"label_selector": "app=x"}, "kubernetes.label_selector"), ([], "kubernetes")):
        with pytest.raises(ConfigError, match=re.escape(key)):
            parse_config({"kubernetes": bad}, tmp_path)


async def test_extproc_optimizer_discovers_from_its_config(api: FakeApiServer, tmp_path: Path) -> None:
    """The wiring in `extproc optimizer`: `kubernetes:` in its config turns discovery on; a Deployment
    created later is served at /metrics within a re-plan, at its min_replicas (no load)."""
    await api.change("ADDED", deployment_object("ds-l20", labels={"model.aibrix.ai/min_replicas": "1"}))
    (tmp_path / "optimizer.yaml").write_text(yaml.safe_dump({"kubernetes": {"kubeconfig": api.kubeconfig}}))
    redis = RedisServer(tmp_path)
    port = free_port()
    command = [str(VENV_BIN / "extproc"), "optimizer", "--config", str(tmp_path / "optimizer.yaml"),
               "--port", str(port), "--redis-url", redis.url, "--interval", "0.2"]
    proc = Proc("optimizer", command, tmp_path)

    def metric(name: str) -> tuple[int, bytes]:
        return http_get(f"http://127.0.0.1:{port}/metrics/default/{name}")

    async def served(name: str, status: int) -> bytes:
        """Polled off the event loop, which serves the API the optimizer watches."""
        for _ in range(150):  # 15 s at most
            code, body = await asyncio.to_thread(metric, name)
            if code == status:
                return body
            await asyncio.sleep(0.1)
        raise AssertionError(f"/metrics/default/{name}: {code} {body[:200]!r}, expected {status}")

    try:
        healthy = lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200  # noqa: E731
        await asyncio.to_thread(proc.wait_ready, healthy)
        assert b'vllm:deployment_replicas{model_name="deepseek-coder-7b"} 100' in await served("ds-l20", 200)
        await api.change("ADDED", deployment_object("ds-v100", labels={"model.aibrix.ai/min_replicas": "2"}))
        assert b"} 200" in await served("ds-v100", 200)
        await api.change("DELETED", deployment_object("ds-l20"))
        await served("ds-l20", 404)
    finally:
        assert proc.stop() == 0, proc.log()
        redis.stop()
