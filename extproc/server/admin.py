"""Admin HTTP: Prometheus /metrics and /healthz, bound to localhost unless configured otherwise."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.server.gateway import Gateway


def admin_app(gateway: Gateway, is_serving) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(gateway.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        if is_serving():
            return web.Response(text="ok\n")
        return web.Response(status=503, text="draining\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app
