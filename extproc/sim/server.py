"""The imperative shell of one simulated replica: an aiohttp server around one `Engine` on a scaled clock.

The parts, each its own module: `live.py` holds the replica's state (engine, open streams, faults) and
takes each step's tokens to the responders; `pacer.py` steps the engine on the wall clock;
`openai_http.py` answers the OpenAI endpoints; `admin.py` serves /sim/* and runs outages; `streams.py`
carries tokens to sockets. This module builds them and owns the listener (serving, refusing or
resetting connections) and the lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from extproc.sim.admin import Admin
from extproc.sim.http_limits import JsonErrorRunner
from extproc.sim.live import LiveReplica
from extproc.sim.openai_http import OpenAIHandlers, openai_http_errors
from extproc.sim.replica import ReplicaSpec
from extproc.sim.streams import ENGINE_DIED, SHUTTING_DOWN

log = logging.getLogger(__name__)

# How long runner.cleanup() lets handlers finish on shutdown. Open streams are dropped first, so what is
# left is short work; aiohttp's default (60 s) would only hold up a SIGTERM.
SHUTDOWN_TIMEOUT_S = 1.0


class ReplicaServer:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.replica = LiveReplica(spec)
        self.engine = self.replica.engine
        self.streams = self.replica.streams  # the open streams (the same dict)
        self.port = spec.port
        self.admin = Admin(self.replica, self.listen, self.drop_connections)
        self._task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._reset_server: asyncio.AbstractServer | None = None

    # --- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self.replica.start()
        mode = self.replica.faults.refuse_connections
        self._runner = JsonErrorRunner(
            self._app(), handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        await self._runner.setup()
        await self.listen(mode)
        # mode == "refuse": nothing listens, so connections are refused by the kernel.
        self._task = asyncio.create_task(self.replica.pacer.run(), name=f"engine-{self.spec.name}")
        self._task.add_done_callback(self._loop_ended)
        log.info(
            "engine-sim %s: %s on %s, %s (%s), port %d, %d KV blocks, time scale %g%s",
            self.spec.name,
            self.spec.model_name,
            self.engine.perf.gpu.name,
            self.spec.engine,
            f"TP={self.engine.perf.tensor_parallel}",
            self.port,
            self.engine.kv.total_blocks,
            self.spec.time_scale,
            f", refusing connections ({mode})" if mode else "",
        )

    async def stop(self) -> None:
        # Open streams first: once the engine loop is gone nothing would ever finish them, and their
        # handlers would hold runner.cleanup() for its whole timeout. Dropped as a dying engine would.
        self.replica.fail_streams(SHUTTING_DOWN, drop=True)
        for task in (self.admin.outage, self._task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except Exception:  # a dead engine loop: _loop_ended logged it
                    pass
        await self.listen("refuse")
        if self._runner is not None:
            await self._runner.cleanup()

    async def listen(self, mode: str | None) -> None:
        """Serve HTTP (None), accept-and-drop connections ("reset"), or have nothing listen ("refuse")."""
        if self._site is not None:
            await self._site.stop()
            self._site = None
        if self._reset_server is not None:
            self._reset_server.close()
            await self._reset_server.wait_closed()
            self._reset_server = None
        host = self.spec.host
        if mode == "reset":
            self._reset_server = await asyncio.start_server(
                self._reset_connection, host, self.port, reuse_address=True
            )
            self.port = self._reset_server.sockets[0].getsockname()[1]
        elif mode is None:
            assert self._runner is not None
            self._site = web.TCPSite(self._runner, host, self.port, backlog=2048, reuse_address=True)
            await self._site.start()
            server = self._site._server  # the bound port, for port 0
            if server is not None and server.sockets:  # type: ignore[union-attr]
                self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        # A dead engine loop would hang every stream: make it loud, end them with an error, and say so on
        # /health and to new requests, so a gateway takes this replica out instead of waiting on it.
        if not task.cancelled() and task.exception() is not None:
            log.error("engine-sim %s: engine loop died", self.spec.name, exc_info=task.exception())
            self.replica.dead = True
            self.replica.fail_streams(ENGINE_DIED, drop=False)  # handlers still run: they write the error

    async def _reset_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()  # fault: accept, then drop the connection at once

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[openai_http_errors])
        OpenAIHandlers(self.replica).add_routes(app)
        self.admin.add_routes(app)
        return app

    def drop_connections(self, keep: Any = None) -> None:
        """Abort every open HTTP connection but `keep` (an outage's: as a crashed engine would)."""
        if self._runner is not None and self._runner.server is not None:
            for handler in list(self._runner.server.connections):
                transport = handler.transport
                if transport is not None and transport is not keep:
                    transport.abort()
