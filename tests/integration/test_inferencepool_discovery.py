"""InferencePool discovery against a small API server (tests/support/kube_api.py): the pool and its pods
listed and watched over real HTTP on 127.0.0.1 through the official client. The gateway's pods follow
the pool: its selector, its target ports, its pods' readiness, 410 Gone and an API server restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from extproc.config import parse
from extproc.pool.inferencepool import InferencePoolDiscovery
from extproc.server.discovery import DiscoveredPool
from extproc.server.gateway import Gateway
from tests.support.kube_api import FakeApiServer, eventually, fake_api_server

NS = "serving"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def pool_object(selector: dict[str, str], ports: list[int], name: str = "llama") -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"matchLabels": selector},
                     "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "extproc", "port": {"number": 9002},
                                           "failureMode": "FailOpen"}}}


def pod_object(name: str, ip: str, labels: dict[str, str], *, ready: bool = True,
               namespace: str = NS) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"nvidia.com/gpu.product": "NVIDIA-L4", **labels}},
            "spec": {"containers": [{"name": "vllm", "ports": [{"containerPort": 8000}]}]},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


APP = {"app": "vllm-llama3"}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[FakeApiServer]:
    async with fake_api_server(tmp_path) as server:
        yield server


async def follow(api: FakeApiServer, **pool: Any) -> tuple[Gateway, InferencePoolDiscovery, asyncio.Task]:
    """`extproc serve`'s wiring: the discovered pods joined with the file's config, applied to a Gateway."""
    config = parse({"discovery": {"inferencepool": {"name": "llama", "namespace": NS, **pool},
                                  "kubeconfig": api.kubeconfig, "backoff_seconds": 0.05,
                                  "max_backoff_seconds": 0.2}}, {})
    gateway = Gateway(config)
    joined = DiscoveredPool(gateway.apply, config)
    discovery = InferencePoolDiscovery(config.discovery, joined.update)
    task = asyncio.create_task(discovery.run())
    await eventually(lambda: discovery.pool.synced.is_set(), "the pool listed")
    return gateway, discovery, task


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def ready(gateway: Gateway, model: str = MODEL) -> dict[str, str]:
    return {p.name: p.address for p in gateway.pool.ready_pods(model)}


async def test_pods_follow_the_pool_adds_removes_and_readiness(api: FakeApiServer) -> None:
    await api.change("ADDED", pool_object(APP, [8000]))
    await api.change("ADDED", pod_object("a", "10.1.0.1", APP))
    await api.change("ADDED", pod_object("other", "10.1.0.9", {"app": "someone-else"}))
    await api.change("ADDED", pod_object("elsewhere", "10.1.0.8", APP, namespace="other-ns"))
    gateway, discovery, task = await follow(api, model=MODEL)
    try:
        await eventually(lambda: ready(gateway) == {"a": "10.1.0.1:8000"}, "the pool's one pod")
        pod = gateway.pool.ready_pods(MODEL)[0]
        assert (pod.gpu, pod.namespace) == ("NVIDIA-L4", NS)
        # the pod watch asks for the pool's selector in the pool's namespace, nothing wider
        pod_lists = [q for q in api.list_queries if q["path"].endswith("/pods")]
        assert pod_lists and all(q["labelSelector"] == "app=vllm-llama3"
                                 and q["path"] == f"/api/v1/namespaces/{NS}/pods" for q in pod_lists)
        pool_lists = [q for q in api.list_queries if q["path"].endswith("/inferencepools")]
        assert pool_lists[0]["fieldSelector"] == "metadata.name=llama"

        await api.change("ADDED", pod_object("b", "10.1.0.2", APP))
        await eventually(lambda: set(ready(gateway)) == {"a", "b"}, "b added")
        await api.change("MODIFIED", pod_object("a", "10.1.0.1", APP, ready=False))
        await eventually(lambda: set(ready(gateway)) == {"b"}, "a unready")
        # unready: no new requests, but in-flight requests' records still find it
        assert gateway.pool.pod_at("10.1.0.1:8000").name == "a"
        await api.change("DELETED", pod_object("a", "10.1.0.1", APP, ready=False))
        await eventually(lambda: gateway.pool.pod_at("10.1.0.1:8000") is None, "a deleted")
        # a pod relabelled out of the selector leaves the pool (the watch sees it as DELETED)
        await api.change("MODIFIED", pod_object("b", "10.1.0.2", {"app": "moved"}))
        await eventually(lambda: gateway.pool.pod_at("10.1.0.2:8000") is None, "b relabelled away")
        assert ready(gateway) == {} and gateway.pool.has_model(MODEL)  # known, no pods: 503, not 404
        assert discovery.reselections == 1 and len(api.lists) == 2  # one list of the pool, one of pods
    finally:
        await stop(task)


async def test_a_new_selector_reselects_and_new_ports_multiply(api: FakeApiServer) -> None:
    await api.change("ADDED", pool_object(APP, [8000]))
    await api.change("ADDED", pod_object("old-a", "10.2.0.1", APP))
    await api.change("ADDED", pod_object("new-a", "10.2.0.2", {"app": "vllm-llama3-v2"}))
    gateway, discovery, task = await follow(api, model=MODEL)
    try:
        await eventually(lambda: set(ready(gateway)) == {"old-a"}, "the first selection")
        await api.change("MODIFIED", pool_object({"app": "vllm-llama3-v2"}, [8000]))
        await eventually(lambda: set(ready(gateway)) == {"new-a"}, "the new selector's pods only")
        assert discovery.reselections == 2
        # two target ports (data-parallel ranks): a pod per port, named as the reference picker does
        await api.change("MODIFIED", pool_object({"app": "vllm-llama3-v2"}, [8000, 8001]))
        await eventually(lambda: ready(gateway) == {"new-a-rank-0": "10.2.0.2:8000",
                                                    "new-a-rank-1": "10.2.0.2:8001"}, "two ranks")
        by_name = {p.name: p for p in gateway.pool.ready_pods(MODEL)}
        assert by_name["new-a-rank-1"].metrics_url == "http://10.2.0.2:8001/metrics"
        # a change of the pool elsewhere (its picker's failure mode) selects nothing anew
        changed = pool_object({"app": "vllm-llama3-v2"}, [8000, 8001])
        changed["spec"]["endpointPickerRef"]["failureMode"] = "FailClose"
        await api.change("MODIFIED", changed)
        await eventually(lambda: discovery.pool.resource_version == str(api.version), "the pool event")
        assert discovery.reselections == 3
        # the pool deleted: no pods at all
        await api.change("DELETED", changed)
        await eventually(lambda: gateway.pool.all_pods() == [], "no pool, no pods")
    finally:
        await stop(task)


async def test_a_pool_created_later_and_the_model_from_pod_labels(api: FakeApiServer) -> None:
    await api.change("ADDED", pod_object("a", "10.3.0.1", {**APP, "model.aibrix.ai/name": "llama-8b"}))
    await api.change("ADDED", pod_object("b", "10.3.0.2", APP))
    gateway, discovery, task = await follow(api)
    try:
        assert gateway.pool.all_pods() == [] and discovery.pods is None  # no pool yet
        await api.change("ADDED", pool_object(APP, [8000]))
        # no model configured: a pod's model label, else the pool's name
        await eventually(lambda: set(ready(gateway, "llama-8b")) == {"a"}, "a under its label's model")
        await eventually(lambda: set(ready(gateway, "llama")) == {"b"}, "b under the pool's name")
    finally:
        await stop(task)


async def test_410_gone_relists_the_pods(api: FakeApiServer) -> None:
    await api.change("ADDED", pool_object(APP, [8000]))
    await api.change("ADDED", pod_object("a", "10.4.0.1", APP))
    await api.change("ADDED", pod_object("b", "10.4.0.2", APP))
    gateway, discovery, task = await follow(api, model=MODEL)
    try:
        await eventually(lambda: set(ready(gateway)) == {"a", "b"}, "both pods")
        lists = len(api.lists)
        api.paused = True  # the deletion never reaches the watches ...
        await api.change("DELETED", pod_object("a", "10.4.0.1", APP))
        await api.expire()  # ... and is compacted away: resuming gets 410 Gone
        await eventually(lambda: set(ready(gateway)) == {"b"}, "the pods after the relist")
        await eventually(lambda: len(api.lists) >= lists + 2, "the pool and its pods both listed again")
        assert any(int(w["resourceVersion"]) < api.oldest for w in api.watches), "no 410 was given"
        assert discovery.reselections == 1  # the same pool: the pod watch was not replaced
    finally:
        await stop(task)


async def test_the_api_server_restarting(api: FakeApiServer) -> None:
    await api.change("ADDED", pool_object(APP, [8000]))
    await api.change("ADDED", pod_object("a", "10.5.0.1", APP))
    gateway, discovery, task = await follow(api, model=MODEL)
    try:
        await eventually(lambda: set(ready(gateway)) == {"a"}, "a")
        lists = len(api.lists)
        await api.restart(down_seconds=0.3)
        await api.change("ADDED", pod_object("b", "10.5.0.2", APP))
        await eventually(lambda: set(ready(gateway)) == {"a", "b"}, "b after the restart")
        await eventually(lambda: len(api.lists) >= lists + 2, "both watchers listed again")
        await api.change("MODIFIED", pool_object({"app": "none-yet"}, [8000]))
        await eventually(lambda: gateway.pool.all_pods() == [], "the new selector, over new watches")
    finally:
        await stop(task)


async def test_extproc_serve_follows_the_pool(api: FakeApiServer, tmp_path: Path) -> None:
    """The wiring in `extproc serve`: the pool's pod shows in the per-pod series and in the pool's
    `inference_pool_ready_pods{name=<pool>}`, and leaves both when the pool's selector moves away."""
    import json
    import sys
    import time

    import aiohttp

    from extproc.localstack import Proc, free_port

    await api.change("ADDED", pool_object(APP, [8000]))
    await api.change("ADDED", pod_object("a", "127.0.0.1", APP))
    config = tmp_path / "gateway.yaml"
    config.write_text(json.dumps({"discovery": {"inferencepool": {"name": "llama", "model": MODEL},
                                                "kubeconfig": api.kubeconfig, "backoff_seconds": 0.05}}))
    port, admin = free_port(), free_port()
    proc = Proc("gateway", [sys.executable, "-m", "extproc", "serve", "--config", str(config),
                            "--port", str(port), "--admin-port", str(admin)], tmp_path,
                {"POD_NAMESPACE": NS})

    async def scrape() -> str:
        assert proc.popen.poll() is None, proc.log()
        try:
            async with aiohttp.ClientSession() as session, \
                    session.get(f"http://127.0.0.1:{admin}/metrics") as response:
                return await response.text()
        except aiohttp.ClientError:
            return ""

    async def until(check, what: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not check(await scrape()):
            assert time.monotonic() < deadline, f"{what}:\n{proc.log()}"
            await asyncio.sleep(0.05)

    series = f'extproc_pod_healthy{{model="{MODEL}",pod="a"}}'
    try:
        await until(lambda text: series in text and 'inference_pool_ready_pods{name="llama"} 1.0' in text,
                    "the pool's pod served", 20)
        await api.change("MODIFIED", pool_object({"app": "elsewhere"}, [8000]))
        await until(lambda text: series not in text and 'inference_pool_ready_pods{name="llama"} 0.0' in text,
                    "the pod gone with the selector", 10)
    finally:
        await api.drop_watches()
        proc.stop()
