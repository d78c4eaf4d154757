"""Writes closed trace windows to Redis. A failed write drops that window (counted), never the request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from prometheus_client import Counter

from extproc.tracing.window import TraceRecorder

log = logging.getLogger(__name__)

TRACE_TTL_SECONDS = 600  # AIBrix: expireWriteRequestTraceIntervalInMins = 10

windows_dropped = Counter("extproc_trace_windows_dropped",
                          "Request-trace windows not written to Redis (Redis unreachable or erroring)")


class _Redis(Protocol):
    def set(self, name: str, value: str, ex: int | None = ...) -> Awaitable[Any]: ...


class TraceFlusher:
    """Every `interval` seconds, SET each closed window with a TTL. Run `run()` as a supervised task.

    Late windows are fine: the optimizer reads keys by their window end, not by when they appear."""

    def __init__(self, redis_client: _Redis, recorder: TraceRecorder, *, interval: float = 1.0,
                 timeout: float = 2.0, ttl: int = TRACE_TTL_SECONDS,
                 clock: Callable[[], float] = time.time) -> None:
        self._redis = redis_client
        self._recorder = recorder
        self._interval = interval
        self._timeout = timeout
        self._ttl = ttl
        self._clock = clock
        self.written = 0
        self.dropped = 0
        self._failing = False  # log the first failure of an outage, not every window

    async def flush(self, now_wall: float | None = None) -> int:
        """Write every window closed at `now_wall` (default: now); returns how many were written."""
        written = 0
        for key, value in self._recorder.due(self._clock() if now_wall is None else now_wall):
            try:
                await asyncio.wait_for(self._redis.set(key, value, ex=self._ttl), self._timeout)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis down, timeout, auth: the window is lost, routing is not
                self.dropped += 1
                windows_dropped.inc()
                if not self._failing:
                    log.warning("request trace %s dropped: %s: %s", key, type(e).__name__, e)
                self._failing = True
                continue
            if self._failing:
                log.info("request traces written to Redis again")
            self._failing = False
            written += 1
        self.written += written
        return written

    async def run(self) -> None:
        """Flush once a second until cancelled; never raises anything but CancelledError."""
        while True:
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not kill the gateway's task group
                log.exception("request trace flush failed")
            await asyncio.sleep(self._interval)
