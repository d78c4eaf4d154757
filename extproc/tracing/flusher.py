"""Writes closed trace windows to Redis, merged into the window other gateways write (tracing.merge).
A failed write is retried on the next flushes for a while (a Redis restart leaves a stale pooled
connection whose first command fails), then dropped (counted); never the request."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from prometheus_client import Counter

from extproc.cancellation import raise_if_cancelled
from extproc.tracing.merge import ScriptingRedis, WindowMerger
from extproc.tracing.window import TraceRecorder

log = logging.getLogger(__name__)

TRACE_TTL_SECONDS = 600  # AIBrix: expireWriteRequestTraceIntervalInMins = 10
RETRY_SECONDS = 60.0  # a window not written within this long after it closed is dropped
MAX_PENDING = 256     # windows kept for retry during an outage (about 40 min of one model's)

windows_dropped = Counter("extproc_trace_windows_dropped",
                          "Request-trace windows not written to Redis (Redis unreachable or erroring)")


class TraceFlusher:
    """Every `interval` seconds, merge each closed window into Redis with a TTL. Run `run()` as a
    supervised task.

    Late windows are fine: the optimizer reads keys by their window end, not by when they appear."""

    def __init__(self, redis_client: ScriptingRedis, recorder: TraceRecorder, *, interval: float = 1.0,
                 timeout: float = 2.0, ttl: int = TRACE_TTL_SECONDS, retry_for: float = RETRY_SECONDS,
                 clock: Callable[[], float] = time.time) -> None:
        self._merger = WindowMerger(redis_client)
        self._writer = uuid.uuid4().hex[:16]  # this flusher's writes, told apart from other gateways'
        self._writes = 0
        self._recorder = recorder
        self._interval = interval
        self._timeout = timeout
        self._ttl = ttl
        self._retry_for = retry_for
        self._clock = clock
        self._pending: list[tuple[str, str, str, float]] = []  # (key, value, write id, when it first failed)
        self.written = 0
        self.dropped = 0
        self._failing = False  # log the first failure of an outage, not every window

    async def flush(self, now_wall: float | None = None) -> int:
        """Write every window closed at `now_wall` (default: now) and those still pending from
        failed writes; returns how many were written."""
        now = self._clock() if now_wall is None else now_wall
        due = [(key, value, self._write_id(), now) for key, value in self._recorder.due(now)]
        batch = self._pending + due
        self._pending = []
        written = 0
        for key, value, write_id, failed_at in batch:
            try:  # a retry keeps its write id: if the failed attempt did land, Redis skips this one
                await asyncio.wait_for(self._merger.merge(key, value, self._ttl, write_id), self._timeout)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis down, timeout, auth: the window waits, routing does not
                if not self._failing:
                    log.warning("request trace %s not written, retrying for %.0f s: %s: %s",
                                key, self._retry_for, type(e).__name__, e)
                self._failing = True
                if now - failed_at < self._retry_for and len(self._pending) < MAX_PENDING:
                    self._pending.append((key, value, write_id, failed_at))
                else:
                    self.dropped += 1
                    windows_dropped.inc()
                continue
            if self._failing:
                log.info("request traces written to Redis again")
            self._failing = False
            written += 1
        self.written += written
        return written

    def _write_id(self) -> str:
        self._writes += 1
        return f"{self._writer}.{self._writes}"

    async def run(self) -> None:
        """Flush once a second until cancelled; never raises anything but CancelledError."""
        while True:
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not kill the gateway's task group
                log.exception("request trace flush failed")
            raise_if_cancelled()  # redis-py's wait_for can swallow a cancel (extproc/cancellation.py)
            await asyncio.sleep(self._interval)
