"""`extproc serve --workers N`: N gateway processes on one box that act as one gateway.

One Python process routes on one core. The supervisor (this module; it never routes and never
imports gRPC) creates the shared segment (sharing/workers.py), starts worker i on the ext_proc port
`port + i` (Envoy's `extproc` cluster lists the N ports and spreads streams over them round robin:
`extproc envoy-config --extproc-workers N`), serves the one admin port (/metrics: the workers' merged,
/healthz: every worker's), restarts a worker that dies, and passes SIGTERM on so each drains.

Each worker is an ordinary `serve` process: its own config watcher, discovery, scrapes and engine
health; in-flight counts, token counts and access-log records go through the segment, or through Redis
when one is configured (then the workers are gateway replicas like any other).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from extproc import die_with_parent
from extproc.ratelimit.worker_store import create_budgets
from extproc.server.metrics_merge import merge
from extproc.sharing.workers import create_segment

log = logging.getLogger(__name__)

RESTART_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0)  # a worker crashing again soon waits longer
STABLE_SECONDS = 60.0          # a worker up this long starts its backoff afresh
SCRAPE_TIMEOUT_SECONDS = 2.0
POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 15.0      # past the drain timeout: then SIGKILL


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process is told on its command line (`--worker index:fd:budgets-fd:admin-socket`)."""
    index: int
    segment_fd: int
    budgets_fd: int    # the rate-limit budgets the workers share without Redis (ratelimit/worker_store.py)
    admin_socket: str  # an abstract Unix socket: the admin server only the supervisor reads

    def render(self) -> str:
        return f"{self.index}:{self.segment_fd}:{self.budgets_fd}:{self.admin_socket}"

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        index, fd, budgets, name = text.split(":", 3)
        return cls(int(index), int(fd), int(budgets), name)

    @property
    def admin_path(self) -> str:
        return "\0" + self.admin_socket


class Worker:
    """One worker process: started, watched, restarted with back-off, and read over its admin socket."""

    def __init__(self, spec: WorkerSpec, argv: Sequence[str]) -> None:
        self.spec = spec
        self.argv = list(argv)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.crashes = 0
        self.restart_at: float | None = None  # set while it is down and waiting to be started again
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self.proc = die_with_parent.popen(self.argv, pass_fds=(self.spec.segment_fd, self.spec.budgets_fd))
        self.started = time.monotonic()
        self.restart_at = None
        log.info("worker %d started (pid %d)", self.spec.index, self.proc.pid)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def watch(self, now: float) -> None:
        """Schedule a restart once it exits (back-off grows while it keeps crashing), and do it when due."""
        code = self.exited()
        if code is None:
            return
        if self.restart_at is None:
            if now - self.started > STABLE_SECONDS:
                self.crashes = 0
            delay = RESTART_BACKOFF_SECONDS[min(self.crashes, len(RESTART_BACKOFF_SECONDS) - 1)]
            self.crashes += 1
            self.restart_at = now + delay
            log.error("worker %d exited with %s; restarting in %gs", self.spec.index, code, delay)
        elif now >= self.restart_at:
            self.start()

    async def fetch(self, path: str) -> tuple[int, str]:
        """GET `path` from its admin server: (status, body), or (0, why) when it does not answer."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # force_close: no kept-alive connection outlives a restarted worker's socket
                connector=aiohttp.UnixConnector(path=self.spec.admin_path, force_close=True),
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS))
        try:
            async with self._session.get(f"http://worker{path}") as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return 0, str(exc)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def worker_argv(spec: WorkerSpec, serve_args: Sequence[str], port: int) -> list[str]:
    """`serve_args`: `extproc`'s arguments from `serve` on, without --port and --workers."""
    return [sys.executable, "-m", "extproc", *serve_args, "--port", str(port), "--worker", spec.render()]


def supervisor_app(workers: list[Worker]) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        replies = await asyncio.gather(*(w.fetch("/metrics") for w in workers))
        texts = [text for status, text in replies if status == 200]
        return web.Response(body=merge(texts).encode(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        replies = await asyncio.gather(*(w.fetch("/healthz") for w in workers))
        down = [w.spec.index for w, (status, _) in zip(workers, replies) if status != 200]
        if not down:
            return web.Response(text="ok\n")
        return web.Response(status=503, text=f"workers not serving: {down}\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app


async def supervise(count: int, serve_args: Sequence[str], *, port: int, admin_host: str, admin_port: int,
                    drain_timeout_seconds: float) -> int:
    if not 1 <= count <= 64:
        raise ValueError(f"--workers must be 1..64, not {count}")
    if port + count - 1 > 65535:
        raise ValueError(f"--port {port} with --workers {count} runs past port 65535")
    segment, budgets = create_segment(count), create_budgets()
    tag = f"extproc-{os.getpid():x}-{time.time_ns():x}"
    workers = [Worker(spec := WorkerSpec(i, segment, budgets, f"{tag}-{i}"),
                      worker_argv(spec, serve_args, port + i))
               for i in range(count)]
    for worker in workers:
        worker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    admin = web.AppRunner(supervisor_app(workers), access_log=None, shutdown_timeout=1.0)
    await admin.setup()
    await web.TCPSite(admin, admin_host, admin_port).start()
    log.info("%d workers on ext_proc ports %d-%d, admin on http://%s:%d", count, port, port + count - 1,
             admin_host, admin_port)
    while not stop.is_set():
        now = time.monotonic()
        for worker in workers:
            worker.watch(now)
        await asyncio.sleep(POLL_SECONDS)

    log.info("stopping: SIGTERM to every worker (each drains)")
    for worker in workers:
        if worker.exited() is None and worker.proc is not None:
            worker.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + drain_timeout_seconds + STOP_GRACE_SECONDS
    while any(w.exited() is None for w in workers) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_SECONDS)
    for worker in workers:
        if worker.exited() is None and worker.proc is not None:
            log.error("worker %d did not stop: killed", worker.spec.index)
            worker.proc.kill()
            worker.proc.wait()
        await worker.close()
    await admin.cleanup()
    os.close(segment)
    os.close(budgets)
    return 1 if any(w.exited() not in (0, None) for w in workers) else 0


__all__ = ["WorkerSpec", "supervise", "supervisor_app"]
