"""Request traces for the GPU optimizer (AIBRIX_GPU_OPTIMIZER_TRACING_FLAG=true): the gateway's hooks
feed `tracing.TraceRecorder`, a background task writes closed windows to Redis."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from extproc.cancellation import raise_if_cancelled
from extproc.openai import Request
from extproc.pool.pod import deployment_of
from extproc.redis_connect import RedisTarget
from extproc.routing.framework import held_back
from extproc.routing.outcome import Rejected
from extproc.server.gateway import Gateway
from extproc.tracing.flusher import TraceFlusher
from extproc.tracing.window import TraceRecorder
from extproc.vocabulary import RequestRecord

log = logging.getLogger(__name__)


class TraceHooks:
    """Wall-clock windows, so traces written by several gateways line up in Redis (the fleet
    simulation passes its virtual clock as `wall`)."""

    def __init__(self, recorder: TraceRecorder, wall: Callable[[], float] = time.time) -> None:
        self.recorder = recorder
        self.wall = wall

    def post_arrival(self, request: Request, now: float) -> None:
        # Counted on arrival, not when routed: a request the SLO queue holds and routes later, or
        # refuses, is offered load all the same, and counting it as it left the queue read a queue
        # draining onto new replicas as a burst above the load (docs/optimizer.md, Workload).
        self.recorder.arrived(request.model, self.wall())

    def post_reject(self, model: str, rejected: Rejected, now: float) -> None:
        self.recorder.rejected(model, rejected.deployments, self.wall())

    def post_response(self, record: RequestRecord, now: float) -> None:
        if record.ok and record.output_tokens is not None:
            # as the client saw it (from the first byte at Envoy): TTFT, E2E and TPAT hold a wait in the
            # SLO queue, TPOT (after the first byte) does not
            self.recorder.completed(record.model, record.prompt_tokens or 0, record.output_tokens,
                                    self.wall(), deployment_of(record.pod), tpot(record), record.ttfb_s,
                                    record.e2e_s)


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first, as the client saw it: (end - first byte) / (tokens - 1)."""
    out = record.output_tokens or 0
    if record.ttfb_s is None or out < 2:
        return None
    return max(0.0, record.e2e_s - record.ttfb_s) / (out - 1)


def snapshot(recorder: TraceRecorder, gateway: Gateway) -> None:
    """Each model's requests in flight and held back in the gateway's waiting rooms (the SLO queue),
    reported with its next window (meta_pending_reqs, meta_queueing_reqs)."""
    pending = Counter(o.request.model for o in gateway.open)
    router = gateway.router
    for model in gateway.pool.models():
        recorder.snapshot(model, pending.get(model, 0), held_back(router.state, model) if router else 0)


async def run_tracing(gateway: Gateway, redis: RedisTarget | str) -> None:
    from extproc import redis_connect

    recorder = TraceRecorder()
    gateway.add_hook(TraceHooks(recorder))
    client = redis_connect.open_async(redis, timeout=2)
    flusher = TraceFlusher(client, recorder)
    try:
        while True:
            try:
                snapshot(recorder, gateway)
                await flusher.flush()  # a Redis failure drops (and counts) that window, nothing more
            except Exception:
                log.exception("request traces failed")
            raise_if_cancelled()  # redis-py's wait_for can swallow a cancel (extproc/cancellation.py)
            await asyncio.sleep(1.0)
    finally:
        await client.aclose()
