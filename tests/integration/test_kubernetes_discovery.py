"""Kubernetes pod discovery against a small API server (tests/support/kube_api.py): list + watch over
real HTTP on 127.0.0.1, reached through the official client configured from a kubeconfig file."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from extproc.config import parse
from extproc.pool.settings import DiscoverySettings
from extproc.pool.watch import PodWatcher
from extproc.server.discovery import DiscoveredPool
from extproc.server.gateway import Gateway
from tests.support.kube_api import FakeApiServer, eventually, fake_api_server

MODEL = "deepseek-coder-7b"


def pod_object(name: str, ip: str | None = "10.0.0.1", *, ready: bool = True, gpu: str = "L20",
               namespace: str = "default", labels: dict[str, str] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running" if ip else "Pending",
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"model.aibrix.ai/name": MODEL, "model.aibrix.ai/engine": "vllm",
                                "machine.cluster.vke.volcengine.com/gpu-name": gpu,
                                "pod-template-hash": "96667667c", **(labels or {})},
                     "ownerReferences": [{"kind": "ReplicaSet", "name": f"{MODEL}-{gpu.lower()}-96667667c"}]},
        "spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": status,
    }


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[FakeApiServer]:
    async with fake_api_server(tmp_path) as server:
        yield server


async def start(api: FakeApiServer, **settings: Any) -> tuple[PodWatcher, list[list], asyncio.Task]:
    seen: list[list] = []
    watcher = PodWatcher(DiscoverySettings(kind="kubernetes", kubeconfig=api.kubeconfig,
                                           backoff_seconds=0.05, **settings), seen.append)
    task = asyncio.create_task(watcher.run())
    await eventually(lambda: watcher.synced.is_set(), "the first list")
    return watcher, seen, task


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def by_name(watcher: PodWatcher) -> dict[str, Any]:
    return {p.name: p for p in watcher.pods()}


async def test_add_modify_delete_through_one_watch(api: FakeApiServer) -> None:
    await api.change("ADDED", pod_object("l20-a", "10.0.0.1"))
    watcher, seen, task = await start(api)
    try:
        pod = by_name(watcher)["l20-a"]
        assert (pod.address, pod.ready, pod.gpu, pod.deployment, pod.engine) == \
            ("10.0.0.1:8000", True, "L20", f"{MODEL}-l20", "vllm")

        await api.change("ADDED", pod_object("v100-a", None, gpu="V100"))  # no IP yet: not routable
        await api.change("MODIFIED", pod_object("l20-a", "10.0.0.1", ready=False))
        await eventually(lambda: not by_name(watcher)["l20-a"].ready, "l20-a unready")
        assert "v100-a" not in by_name(watcher)

        await api.change("MODIFIED", pod_object("v100-a", "10.0.0.2", gpu="V100"))
        await eventually(lambda: "v100-a" in by_name(watcher), "v100-a with an IP")
        assert by_name(watcher)["v100-a"].gpu == "V100"

        await api.change("DELETED", pod_object("l20-a", "10.0.0.1", ready=False))
        await eventually(lambda: "l20-a" not in by_name(watcher), "l20-a deleted")
        await eventually(lambda: [p.name for p in seen[-1]] == ["v100-a"], "the deletion handed on")
        assert len(api.lists) == 1  # all of it over one list and one watch
        assert len(api.watches) == 1 and api.watches[0]["resourceVersion"] == "101"
    finally:
        await stop(task)


async def test_a_burst_of_events_is_applied_together_and_the_last_state_wins(api: FakeApiServer) -> None:
    watcher, seen, task = await start(api)
    try:
        before = watcher.published
        for i in range(60):  # a rollout: pods come and flip readiness
            await api.change("ADDED" if i < 30 else "MODIFIED",
                             pod_object(f"p{i % 30}", f"10.0.1.{i % 30}", ready=i >= 30))
        await eventually(lambda: len(watcher.pods()) == 30 and all(p.ready for p in watcher.pods()),
                         "30 ready pods")
        await eventually(lambda: seen[-1] and len(seen[-1]) == 30 and all(p.ready for p in seen[-1]),
                         "the last state handed on")
        assert watcher.published - before < 30, watcher.published - before
    finally:
        await stop(task)


async def test_a_pod_near_the_largest_object_etcd_stores(api: FakeApiServer) -> None:
    watcher, _, task = await start(api)
    try:
        big = pod_object("l20-big", "10.0.0.5")
        # near etcd's 1.5 MiB object limit: above aiohttp's default line limit (512 KiB), within the
        # kubernetes client's (4 MiB)
        big["metadata"]["annotations"] = {"example.com/blob": "x" * 1_400_000}
        await api.change("ADDED", big)
        await api.change("ADDED", pod_object("l20-after", "10.0.0.6"))
        await eventually(lambda: {"l20-big", "l20-after"} <= set(by_name(watcher)), "both pods")
        assert len(api.lists) == 1  # no failure, no relist
    finally:
        await stop(task)


async def test_watch_resumes_from_last_version_after_clean_end(api: FakeApiServer) -> None:
    watcher, _, task = await start(api)
    try:
        await api.change("ADDED", pod_object("l20-a"))
        await eventually(lambda: "l20-a" in by_name(watcher), "l20-a")
        api.watch_timeout_ends = True
        await api.drop_watches()  # the server ends the watch, as its timeoutSeconds would
        await eventually(lambda: len(api.watches) >= 2, "a second watch")
        assert api.watches[1]["resourceVersion"] == str(api.version)  # resumed, not relisted
        assert len(api.lists) == 1
        await api.change("ADDED", pod_object("l20-b", "10.0.0.3"))
        await eventually(lambda: "l20-b" in by_name(watcher), "l20-b through the resumed watch")
    finally:
        await stop(task)


async def test_dropped_watch_relists_and_sees_what_was_missed(api: FakeApiServer) -> None:
    await api.change("ADDED", pod_object("l20-a"))
    watcher, _, task = await start(api)
    try:
        api.fail_lists = 1  # the first relist fails too: backoff, then another list
        await api.drop_watches()
        # while disconnected: one pod goes away and another comes, with no watch to tell
        api.objects.clear()
        api.version += 1
        await api.change("ADDED", pod_object("l20-b", "10.0.0.3"))
        await eventually(lambda: set(by_name(watcher)) == {"l20-b"}, "the relisted pool")
        assert len(api.lists) == 3  # first list, the failed relist, the good one
    finally:
        await stop(task)


async def test_410_gone_relists(api: FakeApiServer) -> None:
    await api.change("ADDED", pod_object("l20-a"))
    watcher, _, task = await start(api)
    try:
        await api.change("ADDED", pod_object("l20-b", "10.0.0.3"))
        await eventually(lambda: "l20-b" in by_name(watcher), "l20-b")
        api.paused = True  # the deletion below never reaches the watch ...
        await api.change("DELETED", pod_object("l20-a"))
        await api.expire()  # ... and is compacted away: resuming from the watch's version gets 410
        await eventually(lambda: len(api.lists) >= 2, "a relist after 410")
        await eventually(lambda: set(by_name(watcher)) == {"l20-b"}, "the pool after the relist")
        gone = [w for w in api.watches if int(w["resourceVersion"]) < api.oldest]
        assert gone, "a watch should have been refused with 410"
    finally:
        await stop(task)


async def test_backoff_grows_while_lists_keep_failing(api: FakeApiServer) -> None:
    api.fail_lists = 4
    seen: list[list] = []
    watcher = PodWatcher(DiscoverySettings(kind="kubernetes", kubeconfig=api.kubeconfig,
                                           backoff_seconds=0.05, max_backoff_seconds=5), seen.append)
    task = asyncio.create_task(watcher.run())
    try:
        await eventually(lambda: watcher.synced.is_set(), "a list after four failures")
        gaps = [b - a for a, b in zip(api.lists, api.lists[1:], strict=False)]
        assert len(gaps) == 4
        assert all(later > earlier * 1.2 for earlier, later in zip(gaps, gaps[1:], strict=False)), gaps
    finally:
        await stop(task)


async def test_no_credentials_yet_is_retried(api: FakeApiServer, tmp_path: Path) -> None:
    """A kubeconfig (or service-account token) that appears later: discovery starts then, not never."""
    await api.change("ADDED", pod_object("l20-a"))
    later = tmp_path / "later-kubeconfig"
    watcher = PodWatcher(DiscoverySettings(kind="kubernetes", kubeconfig=str(later), backoff_seconds=0.02,
                                           max_backoff_seconds=0.1), lambda pods: None)
    task = asyncio.create_task(watcher.run())
    try:
        await eventually(lambda: watcher.failures >= 2, "failed attempts without a kubeconfig")
        assert not task.done() and not api.lists
        later.write_text(Path(api.kubeconfig).read_text())
        await eventually(lambda: watcher.synced.is_set(), "the first list once the kubeconfig exists")
        assert set(by_name(watcher)) == {"l20-a"}
    finally:
        await stop(task)


async def test_one_namespace(api: FakeApiServer) -> None:
    await api.change("ADDED", pod_object("mine", namespace="serving"))
    await api.change("ADDED", pod_object("theirs", "10.0.0.9", namespace="other"))
    watcher, _, task = await start(api, namespace="serving")
    try:
        assert set(by_name(watcher)) == {"mine"}
        assert by_name(watcher)["mine"].namespace == "serving"
    finally:
        await stop(task)


async def test_gateway_follows_discovery_and_a_reload_keeps_the_pods(api: FakeApiServer) -> None:
    """Unready: no new requests, but the address still resolves for in-flight requests' records."""
    config = parse({"models": {}, "discovery": {"kind": "kubernetes"}}, {})
    gateway = Gateway(config)
    joined = DiscoveredPool(gateway.apply, config)
    await api.change("ADDED", pod_object("l20-a", "10.0.0.1"))
    await api.change("ADDED", pod_object("v100-a", "10.0.0.2", gpu="V100"))
    watcher = PodWatcher(replace(config.discovery, kubeconfig=api.kubeconfig), joined.update)
    task = asyncio.create_task(watcher.run())
    try:
        await eventually(lambda: len(gateway.pool.ready_pods(MODEL)) == 2, "both pods routable")
        await api.change("MODIFIED", pod_object("l20-a", "10.0.0.1", ready=False))
        await eventually(lambda: [p.name for p in gateway.pool.ready_pods(MODEL)] == ["v100-a"],
                         "l20-a out of the ready set")
        assert gateway.pool.pod_at("10.0.0.1:8000").name == "l20-a"
        # a config file reload goes through the overlay: the watched pods stay
        gateway.apply(joined.overlay(parse({"models": {}, "discovery": {"kind": "kubernetes"},
                                            "routing": {"default_strategy": "least-request"}}, {})))
        assert gateway.config.default_strategy == "least-request"
        assert [p.name for p in gateway.pool.ready_pods(MODEL)] == ["v100-a"]
        await api.change("DELETED", pod_object("l20-a", "10.0.0.1", ready=False))
        await eventually(lambda: gateway.pool.pod_at("10.0.0.1:8000") is None, "l20-a gone")
    finally:
        await stop(task)


async def test_extproc_serve_routes_to_discovered_pods(api: FakeApiServer, tmp_path: Path) -> None:
    """The wiring in `extproc serve`: a discovered pod shows in the gateway's per-pod metrics, and
    leaves them when deleted."""
    import sys

    import aiohttp

    from extproc.localstack import Proc, free_port

    await api.change("ADDED", pod_object("l20-a", "127.0.0.1"))
    config = tmp_path / "gateway.yaml"
    config.write_text(json.dumps({"discovery": {"kind": "kubernetes", "kubeconfig": api.kubeconfig}}))
    port, admin = free_port(), free_port()
    proc = Proc("gateway", [sys.executable, "-m", "extproc", "serve", "--config", str(config),
                            "--port", str(port), "--admin-port", str(admin)], tmp_path)
    metrics = ""

    async def scrape() -> str:
        nonlocal metrics
        assert proc.popen.poll() is None, proc.log()
        try:
            async with aiohttp.ClientSession() as session, \
                    session.get(f"http://127.0.0.1:{admin}/metrics") as response:
                metrics = await response.text()
        except aiohttp.ClientError:
            metrics = ""
        return metrics

    async def shows(text: str) -> bool:
        return text in await scrape()

    series = f'extproc_pod_healthy{{model="{MODEL}",pod="l20-a"}}'
    try:
        deadline = time.monotonic() + 20
        while not await shows(series):
            assert time.monotonic() < deadline, f"no {series} in:\n{metrics}\n{proc.log()}"
            await asyncio.sleep(0.05)
        await api.change("DELETED", pod_object("l20-a", "127.0.0.1"))
        deadline = time.monotonic() + 10
        while await shows(series):
            assert time.monotonic() < deadline, "the deleted pod is still in the metrics"
            await asyncio.sleep(0.05)
    finally:
        await api.drop_watches()
        proc.stop()
