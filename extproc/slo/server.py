"""The live side of SLO routing: the waiting room, its metrics, and the profile refresh loop.

A request that `slo-least-load-pulling` sends to the queue awaits a future here, so waiting never blocks
the event loop or other streams. Whenever capacity may have freed (a request finished: post-response; or
one arrived) the most urgent queued request is re-routed first, to the most relaxed deployment that fits;
dispatch stops at the first that still does not fit, so urgency order holds. A request whose deadline
passes (its SLO breached while waiting) is rejected with a 429; one that meets a full queue too. A
cancelled stream (client gone) leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from extproc.gpu_profiles import ProfileStore
from extproc.openai import OpenAIError
from extproc.routing.slo import SloReject, SloWait
from extproc.slo.assignment import assign
from extproc.slo.dispatch import dispatch
from extproc.slo.queue import REJECT_BREACHED, REJECT_FULL, Entry, Full
from extproc.slo.state import SloState, deployment_of

if TYPE_CHECKING:
    from extproc.openai import Request
    from extproc.routing import Profile
    from extproc.server.gateway import Decision, Gateway

log = logging.getLogger(__name__)

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 240)


class Rejected(OpenAIError):
    """A 429 with Retry-After: the SLO cannot be met (breached) or the queue is full."""

    def __init__(self, reason: str, retry_after: float, message: str) -> None:
        super().__init__(429, message, type="rate_limit_exceeded", code=reason)
        self.retry_after = max(1, math.ceil(retry_after))


def rejection(reason: str, retry_after: float, model: str) -> Rejected:
    if reason == REJECT_FULL:
        msg = f"the gateway queue for model {model!r} is full; retry later"
    else:
        msg = f"the request's SLO for model {model!r} cannot be met at the current load; retry later"
    return Rejected(reason, retry_after, msg)


class _Waiter:
    __slots__ = ("request", "profile", "request_id", "future", "timer")

    def __init__(self, request: Request, profile: Profile, request_id: str, future: asyncio.Future) -> None:
        self.request = request
        self.profile = profile
        self.request_id = request_id
        self.future = future
        self.timer: asyncio.TimerHandle | None = None


class SloRoom:
    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway
        reg = gateway.registry
        self.queue_length = Gauge("extproc_slo_queue_length", "Requests waiting in the gateway's SLO queue",
                                  ["model"], registry=reg)
        self.queue_wait = Histogram("extproc_slo_queue_wait_seconds", "Time requests spent in the SLO "
                                    "queue, by how they left it (dispatched, rejected, cancelled)",
                                    ["model", "outcome"], buckets=WAIT_BUCKETS, registry=reg)
        self.rejections = Counter("extproc_slo_rejections", "Requests rejected by SLO routing (429), by "
                                  "reason: slo_breached, queue_full", ["model", "reason"], registry=reg)
        reg.register(_UtilizationCollector(self))
        self._dispatch_scheduled: set[str] = set()
        # False where something else runs the queue (the fleet simulation dispatches in virtual time)
        self.dispatches = True
        gateway.add_hook(self)  # post_response: a completion may free capacity

    @property
    def state(self) -> SloState | None:
        router = self._gw.router
        return router.state.store.get("slo") if router is not None else None  # type: ignore[return-value]

    # -- the request path -------------------------------------------------------------------------

    def reject(self, model: str, reason: str, retry_after: float) -> Rejected:
        self.rejections.labels(model, reason).inc()
        return rejection(reason, retry_after, model)

    async def wait(self, request: Request, profile: Profile, request_id: str, entry: Entry) -> Decision:
        """Queue the request and wait for its dispatch; raises Rejected. Cancellation leaves the queue."""
        state = self.state
        model = request.model
        loop = asyncio.get_running_loop()
        waiter = _Waiter(request, profile, request_id, loop.create_future())
        entry.payload = waiter
        try:
            state.queues.push(entry)
        except Full:
            raise self.reject(model, REJECT_FULL, entry.retry_after) from None
        self._length(model)
        now = self._gw.clock()
        waiter.timer = loop.call_later(max(0.0, entry.deadline - now), self._breach, entry)
        self.dispatch(model)  # an arrival: maybe it (or one before it) fits now
        outcome = "cancelled"
        try:
            decision = await waiter.future
            outcome = "dispatched"
            return decision
        except Rejected:
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
            if state.queues.remove(entry):
                self._length(model)
            self.queue_wait.labels(model, outcome).observe(max(0.0, self._gw.clock() - entry.arrival))

    def _breach(self, entry: Entry) -> None:
        state = self.state
        waiter: _Waiter = entry.payload  # type: ignore[assignment]
        if state is None or not state.queues.remove(entry) or waiter.future.done():
            return
        self._length(entry.model)
        waiter.future.set_exception(self.reject(entry.model, REJECT_BREACHED, entry.retry_after))
        self.dispatch(entry.model)  # the next head may fit where this one did not

    def dispatch(self, model: str) -> int:
        """Route queued requests, most urgent first, while they fit. Returns how many left the queue."""
        state = self.state
        if state is None:
            return 0

        def route(entry: Entry) -> object:
            w: _Waiter = entry.payload  # type: ignore[assignment]
            try:
                return self._gw.route(w.request, w.profile, w.request_id)
            except (SloWait, SloReject):
                raise
            except Exception as exc:  # a bug costs this request, not the queue
                log.exception("slo dispatch failed")
                return exc

        left = dispatch(state, model, self._gw.clock(), route,
                        skip=lambda e: e.payload.future.done())  # type: ignore[union-attr]
        for entry, result in left:
            fut = entry.payload.future  # type: ignore[union-attr]
            if isinstance(result, SloReject):
                fut.set_exception(self.reject(model, result.reason, result.retry_after))
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
        if not self.dispatches or state is None or not state.queues.length(model) \
                or model in self._dispatch_scheduled:
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

    # -- profiles ---------------------------------------------------------------------------------

    async def run_profiles(self, redis_url: str | None) -> None:
        """Every profile_refresh_seconds: profile files named in config, and Redis `aibrix:profile_*`."""
        store = ProfileStore()
        client = None
        if redis_url:
            from redis import asyncio as aioredis
            client = aioredis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            while True:
                try:
                    await self.refresh_profiles(store, client)
                except Exception:
                    log.exception("SLO profile refresh failed")
                try:
                    await self.refresh_splits()
                except Exception:
                    log.exception("SLO split refresh failed")
                state = self.state
                await asyncio.sleep(state.settings.profile_refresh_seconds if state else 10.0)
        finally:
            if client is not None:
                await client.aclose()

    async def refresh_splits(self) -> None:
        """`slo`'s GPU types per shape (an LP of a few ms) for every model with recent arrivals, in a
        thread: never on a request's path."""
        state = self.state
        if state is None:
            return
        state.split_elsewhere = True
        for model, mix in list(state.mixes.items()):
            pods: dict[str, int] = {}
            for pod in self._gw.pool.ready_pods(model):
                pods[deployment_of(pod)] = pods.get(deployment_of(pod), 0) + 1
            now = self._gw.clock()
            rates, table = mix.rates(now), state.table(model)  # snapshots, taken on the loop
            split = await asyncio.to_thread(assign, table, pods, rates)
            state.store_split(model, tuple(sorted(pods.items())), now, split)

    async def refresh_profiles(self, store: ProfileStore, client: Any = None) -> None:
        state = self.state
        if state is None:
            return
        store.load_files(state.settings.profiles)
        models = self._gw.pool.models()
        if client is not None:
            try:
                await asyncio.wait_for(store.refresh_redis(client, models), timeout=5)
            except Exception as exc:  # Redis down: keep what we have
                log.warning("SLO profiles from Redis unavailable: %s", exc)
        for model in models:
            found = {}
            for pod in self._gw.pool.all_pods():
                if pod.model != model:
                    continue
                dep = deployment_of(pod)
                if dep and dep not in found:
                    p = store.profile_for(model, pod.namespace, dep)
                    if p is not None:
                        found[dep] = p
            state.set_profiles(model, found)


class _UtilizationCollector:
    """extproc_slo_utilization{model, deployment}: mean SLO-model utilization of the deployment's pods."""

    def __init__(self, room: SloRoom) -> None:
        self._room = room

    def collect(self):
        g = GaugeMetricFamily("extproc_slo_utilization", "Mean utilization of a deployment's pods in SLO "
                              "routing's load model (sum of in-flight consumptions; 1.0 = at the SLO rate)",
                              labels=["model", "deployment"])
        state = self._room.state
        gw = self._room._gw
        if state is not None and state.tables:
            now = gw.clock()
            for model in state.tables:
                views = gw.accounting.views(model, gw.pool.ready_pods(model), now)
                for (m, dep), u in sorted(state.deployment_utilization(views).items()):
                    g.add_metric([m, dep], u)
        yield g
