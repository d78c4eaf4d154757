"""The live SLO waiting room: an asyncio shell around the pure room (slo/room.py), and its metrics. The
slo* strategies supply it through their registration (slo/waiting.py); the ext_proc stream reaches it
through extproc.admission, which admits a held-back request here before the stream awaits `wait`.

A request its strategy queues awaits a future here, so waiting never blocks the event loop or other
streams. Whenever capacity may have freed (a request finished: post-response; or one arrived) the room
dispatches: the most urgent queued request is re-routed first, to the most relaxed deployment that fits,
and dispatch stops at the first that still does not fit, so urgency order holds. A request whose
deadline passes (its SLO breached while waiting) is rejected with a 429; one that meets a full queue
too. A cancelled stream (client gone) leaves the queue at once. The fleet simulation wraps the same
room in virtual time (fleetsim/loop.py) and builds none of this.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.openai import OpenAIError
from extproc.routing.outcome import Outcome, Queued, Rejected, Routed
from extproc.slo.queue import REJECT_FULL, Entry, Queues
from extproc.slo.room import Room
from extproc.slo.state import SloState, learned

if TYPE_CHECKING:
    from extproc.openai import Request
    from extproc.routing import Profile

log = logging.getLogger(__name__)

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 240)


class LiveGateway(Protocol):
    """What the waiting room uses of the gateway (extproc.server.gateway.Gateway)."""

    registry: CollectorRegistry
    clock: Callable[[], float]
    router: Any
    pool: Any
    accounting: Any
    spans: Any  # server.otel.RequestSpans when OpenTelemetry is on: told each request's wait

    def route(self, request: Request, profile: Profile, request_id: str, queued: bool = False) -> Outcome: ...
    def abort(self, key: str) -> None: ...
    def refused(self, model: str, rejected: Rejected) -> None: ...
    def add_hook(self, plugin: object) -> None: ...


class RetryLater(OpenAIError):
    """A 429 with Retry-After: the SLO cannot be met (breached) or the queue is full."""

    def __init__(self, reason: str, retry_after: float, message: str) -> None:
        self.retry_after = max(1, math.ceil(retry_after))
        super().__init__(429, message, type="rate_limit_exceeded", code=reason,
                         headers=(("retry-after", str(self.retry_after)),))


def rejection(reason: str, retry_after: float, model: str) -> RetryLater:
    if reason == REJECT_FULL:
        msg = f"the gateway queue for model {model!r} is full; retry later"
    else:
        msg = f"the request's SLO for model {model!r} cannot be met at the current load; retry later"
    return RetryLater(reason, retry_after, msg)


class _Waiter:
    __slots__ = ("request", "profile", "request_id", "future", "timer")

    def __init__(self, request: Request, profile: Profile, request_id: str, future: asyncio.Future) -> None:
        self.request = request
        self.profile = profile
        self.request_id = request_id
        self.future = future
        self.timer: asyncio.TimerHandle | None = None


class SloRoom:
    def __init__(self, gateway: LiveGateway) -> None:
        self._gw = gateway
        reg = gateway.registry
        self.queue_length = Gauge("extproc_slo_queue_length", "Requests waiting in the gateway's SLO queue",
                                  ["model"], registry=reg)
        self.queue_wait = Histogram("extproc_slo_queue_wait_seconds", "Time requests spent in the SLO "
                                    "queue, by how they left it (dispatched, rejected, cancelled)",
                                    ["model", "outcome"], buckets=WAIT_BUCKETS, registry=reg)
        self.rejections = Counter("extproc_slo_rejections", "Requests rejected by SLO routing (429), by "
                                  "reason: slo_breached, queue_full", ["model", "reason"], registry=reg)
        self._dispatch_scheduled: set[str] = set()
        gateway.add_hook(self)  # post_response: a completion may free capacity

    @property
    def state(self) -> SloState | None:
        router = self._gw.router
        return learned(router.state.store) if router is not None else None

    def _queues(self) -> Queues:
        """The SLO queues of a request held back: its slo* strategy was built, and its state with it."""
        state = self.state
        if state is None:
            raise RuntimeError("a request was held back before any SLO strategy was built")
        return state.queues

    # -- the request path -------------------------------------------------------------------------

    def reject(self, model: str, rejected: Rejected) -> RetryLater:
        """Every refusal of the live gateway passes here: counted, told to the hooks, answered."""
        self.rejections.labels(model, rejected.reason).inc()
        self._gw.refused(model, rejected)
        return rejection(rejected.reason, rejected.retry_after, model)

    def admit(self, queued: Queued) -> Queued | Rejected:
        """The held-back request joins its model's queue (Rejected: the queue is full). The stream
        awaits `wait` next, in the same turn of the loop: nothing dispatches before its waiter is set."""
        return Room(self._queues()).admit(queued)

    async def wait(self, request: Request, profile: Profile, request_id: str, queued: Queued) -> Routed:
        """Wait, admitted, for the request's dispatch; raises RetryLater (or the 503 of no ready pod).
        Cancellation leaves the queue."""
        queues = self._queues()
        entry: Entry[_Waiter] = queued.entry
        model = request.model
        loop = asyncio.get_running_loop()
        waiter = _Waiter(request, profile, request_id, loop.create_future())
        entry.payload = waiter
        self._length(model)
        now = self._gw.clock()
        waiter.timer = loop.call_later(max(0.0, entry.deadline - now), self._breach, entry)
        self.dispatch(model)  # an arrival: maybe it (or one before it) fits now
        outcome = "cancelled"
        try:
            routed = await waiter.future
            outcome = "dispatched"
            return routed
        except RetryLater:
            outcome = "rejected"
            raise
        except asyncio.CancelledError:
            # the client went away: out of the queue now; a decision made in the same instant is undone
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._gw.abort(fut.result().key)
            raise
        finally:
            if waiter.timer is not None:
                waiter.timer.cancel()
            if queues.remove(entry):
                self._length(model)
            self.queue_wait.labels(model, outcome).observe(max(0.0, self._gw.clock() - entry.arrival))

    def _breach(self, entry: Entry[_Waiter]) -> None:
        state = self.state
        if state is None:
            return
        waiter = entry.payload
        room: Room[_Waiter] = Room(state.queues)
        rejected = room.breach(entry)
        if rejected is None or waiter.future.done():
            return
        self._length(entry.model)
        waiter.future.set_exception(self.reject(entry.model, rejected))
        self.dispatch(entry.model)  # the next head may fit where this one did not

    def dispatch(self, model: str) -> int:
        """Route queued requests, most urgent first, while they fit. Returns how many left the queue."""
        state = self.state
        if state is None:
            return 0

        def route(entry: Entry[_Waiter]) -> Outcome | Exception:
            w = entry.payload
            try:
                if self._gw.spans is not None:  # the span opened by this routing records the wait
                    self._gw.spans.waited(w.request, max(0.0, self._gw.clock() - entry.arrival))
                return self._gw.route(w.request, w.profile, w.request_id, queued=True)
            except Exception as exc:  # a bug costs this request, not the queue
                log.exception("slo dispatch failed")
                return exc

        room: Room[_Waiter] = Room(state.queues)
        left = room.dispatch(model, self._gw.clock(), route, skip=lambda e: e.payload.future.done())
        for entry, result in left:
            fut = entry.payload.future
            if isinstance(result, Rejected):
                fut.set_exception(self.reject(model, result))
            elif isinstance(result, Exception):
                fut.set_exception(result)
            elif result is None:
                fut.set_exception(OpenAIError(503, f"no ready pod for model {model!r}",
                                              type="service_unavailable", code="no_ready_pod"))
            else:
                fut.set_result(result)
        self._length(model)
        return len(left)

    def _length(self, model: str) -> None:
        state = self.state
        self.queue_length.labels(model).set(state.queues.length(model) if state is not None else 0)

    # -- hooks ------------------------------------------------------------------------------------

    def post_response(self, record, now: float) -> None:
        """A request finished: capacity may have freed. Dispatch after the current call returns (the
        finishing request's other hooks run first, and the gateway is not re-entered)."""
        state = self.state
        model = record.model
        if state is None or not state.queues.length(model) or model in self._dispatch_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.dispatch(model)
            return
        self._dispatch_scheduled.add(model)

        def run() -> None:
            self._dispatch_scheduled.discard(model)
            self.dispatch(model)
        loop.call_soon(run)
