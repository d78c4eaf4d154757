"""A small Kubernetes API server for tests: list + watch of Pods, Deployments and InferencePools (label and
field selectors), and GET of one Deployment, over real HTTP on 127.0.0.1, reached through the official
client configured from a kubeconfig file. It can be restarted on its port, its objects kept (as etcd
keeps them)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web


async def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll with a deadline (the event loop keeps running the watcher and the server meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class FakeApiServer:
    """Pods and Deployments with resourceVersions, an event log, watches that can be dropped or expired
    (410). One resourceVersion sequence for all kinds, as etcd has."""

    def __init__(self) -> None:
        self.version = 100
        self.objects: dict[str, dict[str, Any]] = {}  # "Kind/namespace/name" -> object
        # (version, event type, object, the object before): a watch with a selector sees an object
        # that leaves it as DELETED and one that enters it as ADDED, as the API server sends them
        self.events: list[tuple[int, str, dict[str, Any], dict[str, Any] | None]] = []
        self.oldest = 0  # a watch from before this version gets 410 Gone (etcd compaction)
        self.changed = asyncio.Condition()
        self.lists: list[float] = []  # when each list came
        self.watches: list[dict[str, str]] = []  # each watch request's query
        self.list_queries: list[dict[str, str]] = []  # each list request's query, and its path
        self.fail_lists = 0  # the next this-many lists get a 500
        self._drop = 0  # bumped to cut every open watch
        self.watch_timeout_ends = False  # honour timeoutSeconds by ending the stream cleanly
        self.paused = False  # open watches deliver nothing (a slow watch falling behind)
        self.reads: list[str] = []  # the paths of single-object GETs

    async def change(self, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        key = f"{obj['kind']}/{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        before = self.objects.pop(key, None) if kind == "DELETED" else self.objects.get(key)
        if kind != "DELETED":
            self.objects[key] = obj
        self.events.append((self.version, kind, obj, before))
        async with self.changed:
            self.changed.notify_all()

    async def restart(self, down_seconds: float = 0.0) -> None:
        """The API server goes away (every connection cut, connections refused) and comes back on its
        port with its objects; watchers must reconnect and list again."""
        await self.site.stop()
        if down_seconds:
            await asyncio.sleep(down_seconds)  # the outage's length, not a synchronisation
        await self.site.start()

    async def drop_watches(self) -> None:
        self._drop += 1
        async with self.changed:
            self.changed.notify_all()

    async def expire(self) -> None:
        """Compact: every version up to now is gone; open watches end (a resume will get 410)."""
        self.oldest = self.version + 1
        self.watch_timeout_ends = True
        await self.drop_watches()

    async def read(self, request: web.Request) -> web.Response:
        """GET of one Deployment by name."""
        self.reads.append(request.path)
        key = f"Deployment/{request.match_info['namespace']}/{request.match_info['name']}"
        if key not in self.objects:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        return web.json_response(self.objects[key])

    async def handle(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info.get("namespace")
        of_kind = KINDS[request.path.rsplit("/", 1)[1]]
        selects = selector(request.query.get("labelSelector", ""), request.query.get("fieldSelector", ""))
        if of_kind in ("Pod", "Deployment"):  # the gateway and the optimizer select what they may read
            # (pools are followed by name; autoscalers are read whole: they carry no model label)
            assert request.query.get("labelSelector"), "an unfiltered list of every pod"

        def wanted(obj: dict[str, Any]) -> bool:
            return obj["kind"] == of_kind and namespace in (None, obj["metadata"]["namespace"]) \
                and selects(obj)

        if request.query.get("watch") not in ("true", "True", "1"):
            self.lists.append(time.monotonic())
            self.list_queries.append(dict(request.query, path=request.path))
            if self.fail_lists:
                self.fail_lists -= 1
                return web.json_response({"kind": "Status", "code": 500}, status=500)
            items = [p for p in self.objects.values() if wanted(p)]
            return web.json_response({"kind": f"{of_kind}List", "items": items,
                                      "metadata": {"resourceVersion": str(self.version)}})
        self.watches.append(dict(request.query, path=request.path))
        since = int(request.query.get("resourceVersion") or 0)
        response = web.StreamResponse()
        response.content_type = "application/json"
        await response.prepare(request)
        if since < self.oldest:
            gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                "message": f"too old resource version: {since}"}}
            await response.write(json.dumps(gone).encode() + b"\n")
            return response
        drop, sent = self._drop, since
        while True:
            for version, kind, obj, before in [] if self.paused else self.events:
                if version <= sent:
                    continue
                now_in, was_in = wanted(obj), before is not None and wanted(before)
                if kind == "MODIFIED" and now_in != was_in:
                    kind = "ADDED" if now_in else "DELETED"
                elif not now_in:
                    continue
                data = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                for start in range(0, len(data), 65536):  # in chunks, as a real server flushes
                    await response.write(data[start : start + 65536])
            sent = sent if self.paused else self.version
            if self._drop != drop:
                if self.watch_timeout_ends:
                    return response  # a clean end, as when timeoutSeconds runs out
                request.transport.close()  # a dropped connection mid-stream
                return response
            async with self.changed:
                await self.changed.wait()


KINDS = {"pods": "Pod", "deployments": "Deployment", "inferencepools": "InferencePool",
         "horizontalpodautoscalers": "HorizontalPodAutoscaler", "podautoscalers": "PodAutoscaler"}
POOLS = "/apis/inference.networking.k8s.io/v1"


def selector(labels: str, fields: str) -> Callable[[dict[str, Any]], bool]:
    """A label selector (`k`, `k=v`, `k==v`, `k!=v`, comma-separated) and a `metadata.name=` field
    selector, as the API server applies them."""
    terms = [t for t in labels.split(",") if t]
    name = fields.removeprefix("metadata.name=") if fields else None
    assert fields in ("", f"metadata.name={name}"), f"unsupported field selector {fields!r}"

    def matches(obj: dict[str, Any]) -> bool:
        have = obj["metadata"].get("labels") or {}
        if name is not None and obj["metadata"]["name"] != name:
            return False
        for term in terms:
            if "!=" in term:
                key, value = term.split("!=", 1)
                if have.get(key) == value:
                    return False
            elif "=" in term:
                key, value = term.replace("==", "=").split("=", 1)
                if have.get(key) != value:
                    return False
            elif term not in have:
                return False
        return True

    return matches


class ApiSite:
    """The HTTP side of a FakeApiServer: started, stopped and started again on the same port."""

    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        server = self.server
        app = web.Application()
        app.router.add_get("/api/v1/pods", server.handle)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", server.handle)
        app.router.add_get("/apis/apps/v1/deployments", server.handle)
        app.router.add_get("/apis/apps/v1/namespaces/{namespace}/deployments", server.handle)
        app.router.add_get("/apis/apps/v1/namespaces/{namespace}/deployments/{name}", server.read)
        app.router.add_get(POOLS + "/namespaces/{namespace}/inferencepools", server.handle)
        for base in ("/apis/autoscaling/v2", "/apis/autoscaling.aibrix.ai/v1alpha1"):
            plural = "horizontalpodautoscalers" if base.endswith("v2") else "podautoscalers"
            app.router.add_get(f"{base}/{plural}", server.handle)
            app.router.add_get(f"{base}/namespaces/{{namespace}}/{plural}", server.handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await self.server.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@asynccontextmanager
async def fake_api_server(tmp_path: Path) -> AsyncIterator[FakeApiServer]:
    """The server on a free port; its `kubeconfig` attribute names a kubeconfig file that reaches it,
    `restart()` stops it and starts it again on that port."""
    server = FakeApiServer()
    site = ApiSite(server)
    await site.start()
    server.site = site
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": f"http://127.0.0.1:{site.port}"}}],
        "users": [{"name": "test", "user": {"token": "not-a-secret"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    server.kubeconfig = str(kubeconfig)
    try:
        yield server
    finally:
        await site.stop()
