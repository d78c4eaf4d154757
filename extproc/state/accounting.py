"""The gateway's learned view of every pod: in-flight counts, completed tokens, capacity, engine
metrics and health, combined into the PodViews routing reads.

Accounting is itself a pair of lifecycle hooks: `post_choice` counts a request in flight on its pod,
`post_response` releases it and credits its output tokens. It does no I/O: the live server feeds it
engine samples and Redis snapshots from background loops, the fleet simulation feeds it virtual ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from extproc.openai import Request
from extproc.pool.pod import Pod, PodKey
from extproc.state.capacity import BusyClock, CapacityEstimator
from extproc.state.record import PodView, RequestRecord, Snapshot
from extproc.state.shared import SharedState
from extproc.state.speed import LoadIntegral, SpeedEstimator
from extproc.state.speed_sums import shifted
from extproc.telemetry.engine_metrics import EngineSample
from extproc.telemetry.health import PodHealth

SampleSource = Callable[[PodKey, float], EngineSample | None]


def _no_samples(key: PodKey, now: float) -> EngineSample | None:
    return None


# Routing reads cached views: rebuilt from samples and capacity at most this often, running counts
# re-read from the shared state at most this often; this gateway's own changes apply at once.
VIEW_REBUILD_SECONDS = 0.25
RUNNING_RESYNC_SECONDS = 0.05


@dataclass(slots=True)
class _Cached:
    pods: Sequence[Pod]
    views: Snapshot
    keys: list[PodKey]
    built: float
    synced: float
    routable: Snapshot | None = None  # the views routing picks among (see `routable`); None: not yet


SPEED, OBSERVED = "speed", "observed"  # routing.load_balance.capacity


class Accounting:
    def __init__(self, shared: SharedState, capacity: CapacityEstimator | None = None,
                 health: PodHealth | None = None, samples: SampleSource = _no_samples,
                 speed: SpeedEstimator | None = None, wall: Callable[[], float] = time.time) -> None:
        self.shared = shared
        self.wall = wall  # the clock shared speed evidence is timed by (each gateway's own differs)
        self.capacity = capacity or CapacityEstimator()  # AIBrix's observed rate (capacity: observed)
        self.speed = speed or SpeedEstimator()  # speed at load (capacity: speed, the default)
        self.load = LoadIntegral()
        self._starts: dict[int, tuple[float, float]] = {}  # id(request) -> (routed at, load integral)
        # Which capacity each model's views carry (the model's routing.load_balance.capacity).
        self.capacity_modes: dict[str, str] = {}
        self.default_mode = SPEED
        # What routing counts in flight: with peers, this gateway's recent starts echoed per peer.
        self._routing_running = getattr(shared, "routing_running", shared.running)
        self.health = health or PodHealth()
        self.health.on_change = self._health_changed
        self.samples = samples
        self.output_tokens: dict[PodKey, int] = {}  # this gateway's own tally, for /metrics
        self._cache: dict[str, _Cached] = {}  # per model
        self._live: dict[PodKey, PodView] = {}  # the cached view of each pod, for in-place updates
        self.busy = BusyClock()
        self._tracked: list[Pod] = []

    # -- hooks -----------------------------------------------------------------------------------

    def post_choice(self, request: Request, chosen: PodView, now: float) -> None:
        pod = chosen.pod
        self.shared.add_running(pod, 1)
        self._starts[id(request)] = (now, self.load.advance(pod.key, now, self.shared.running(pod.key)))
        view = self._live.get(pod.key)
        if view is not None:
            view.running += 1 + getattr(self.shared, "peers", 0)  # see SyncCore.routing_running

    def _health_changed(self, key: PodKey, healthy: bool, restarted: bool = False) -> None:
        """A pod left or rejoined routing (a response, scrape or probe): the cached view follows now.
        Back after its address refused connections, it is likely a new engine: re-measured from its
        type's figure (a pod out for slow scrapes keeps what was measured)."""
        if restarted:
            self.speed.restarted(key)
        view = self._live.get(key)
        if view is not None:
            view.healthy = healthy
            cached = self._cache.get(key[0])
            if cached is not None:
                cached.routable = None

    def post_response(self, record: RequestRecord, now: float) -> None:
        key = record.pod.key
        self.shared.add_running(record.pod, -1)
        load = self.load.advance(key, now, self.shared.running(key))
        start = self._starts.pop(id(record.request), None) if record.request is not None else None
        if start is not None:
            self._observe_speed(record, now, *start, load)
        self.credit(record.pod, record.output_tokens)
        self.busy.completed(key)
        self.health.observe_response(key, record.status, record.connect_failure, now)
        view = self._live.get(key)
        if view is not None:
            view.running = max(0, view.running - 1)

    def _observe_speed(self, record: RequestRecord, now: float, started: float, load_then: float,
                       load_now: float) -> None:
        """A request's time per output token, against its pod's mean in-flight count over its life.
        Streamed: decode time from the first byte on. Non-streamed responses arrive in one piece, so
        their time per token includes the prefill (a small share unless the prompt dwarfs the output)."""
        out, ttfb = record.output_tokens, record.ttfb_s
        if not record.ok or out is None or out < 2:
            return
        if record.stream:
            if ttfb is None:
                return
            tpot = (record.e2e_s - ttfb) / (out - 1)
        else:
            tpot, ttfb = record.e2e_s / out, None
        self.speed.observe_prefill(record.pod.key, ttfb, record.prompt_tokens or 0, out, now)
        span = now - started
        if span > 0 and tpot > 0:
            self.speed.observe(record.pod.key, tpot, (load_now - load_then) / span, out - 1, now)

    def _share_speed(self, now: float) -> None:
        """Publish this gateway's speed evidence and fold in the other gateways' (state/speed.py),
        timed on the wall clock in between."""
        peers = self.shared.peer_speed()
        offset = self.wall() - now
        for pod in self._tracked:
            key = pod.key
            evidence = self.speed.export(key)
            if evidence is not None:
                self.shared.share_speed(key, shifted(evidence, offset))
            self.speed.merge_peers(key, [shifted(v, -offset) for v in peers.get(key, ())])

    def credit(self, pod: Pod, tokens: int | None) -> None:
        """Completed output tokens of one request (also for a request this gateway did not route,
        e.g. one that outlived a restart: the pod still did the work)."""
        if tokens:
            self.shared.add_tokens(pod, tokens)
            self.output_tokens[pod.key] = self.output_tokens.get(pod.key, 0) + tokens

    # -- background -------------------------------------------------------------------------------

    def sample_busy(self, now: float) -> None:
        """Between refreshes (the live gateway: every Redis sync): which pods have requests in flight."""
        running = self.shared.running
        busy = set()
        advance = self.load.advance
        for p in self._tracked:  # other gateways' changes reach the integral at each sync
            if (n := running(p.key)) > 0:
                busy.add(p.key)
            advance(p.key, now, n)
        self.busy.sample(now, busy)

    def refresh(self, pods: Iterable[Pod], now: float) -> None:
        """Every metrics refresh: fold the completed tokens into the capacity estimates."""
        self._tracked = list(pods)
        for pod in self._tracked:
            self.capacity.track(pod.key, now)
        self.sample_busy(now)
        self.capacity.observe_many(self.shared.take_token_deltas(), now)
        self.capacity.refresh(now, self.busy.take())
        for pod in self._tracked:
            sample = self.samples(pod.key, now)
            if sample is not None:
                self.speed.observe_kv(pod.key, sample.running, sample.kv_usage, now)
        self._share_speed(now)
        self.speed.refresh(self._tracked, now)

    def forget(self, live: Iterable[PodKey]) -> None:
        live = set(live)
        self._cache.clear()
        self._live.clear()
        self.capacity.forget(live)
        self.speed.forget(live)
        self.load.forget(live)
        self.health.forget(live)
        self.shared.forget(live)
        for key in [k for k in self.output_tokens if k not in live]:
            del self.output_tokens[key]

    # -- what routing reads -----------------------------------------------------------------------

    def views(self, model: str, pods: Sequence[Pod], now: float) -> Snapshot:
        """The model's pods as routing sees them: cached, see VIEW_REBUILD_SECONDS."""
        return self._cached(model, pods, now).views

    def routable(self, model: str, pods: Sequence[Pod], now: float) -> Snapshot:
        """The views routing picks among: the healthy ones, or all of them when none is healthy (a
        health signal must never cause a total outage). Kept until the views are rebuilt or a pod's
        health changes, so what strategies derive from it is derived once (routing/snapshot.py)."""
        cached = self._cached(model, pods, now)
        if cached.routable is None:
            views = cached.views
            healthy = [v for v in views if v.healthy]
            cached.routable = views if len(healthy) == len(views) or not healthy else Snapshot(healthy)
        return cached.routable

    def _cached(self, model: str, pods: Sequence[Pod], now: float) -> _Cached:
        # The other workers' routing since the last decision, as it happened (a rebuild or resync
        # below then overwrites these views with sums that hold the same changes).
        changes = self.shared.peer_changes()
        if changes:
            live = self._live
            for key, delta in changes:
                view = live.get(key)
                if view is not None:
                    view.running = max(0, view.running + delta)
        cached = self._cache.get(model)
        if cached is None or cached.pods is not pods or now - cached.built >= VIEW_REBUILD_SECONDS:
            views = Snapshot(self.build_views(pods, now, self._routing_running))
            keys = [view.pod.key for view in views]
            cached = self._cache[model] = _Cached(pods, views, keys, now, now)
            self._live.update(zip(keys, views))
            return cached
        if now - cached.synced >= RUNNING_RESYNC_SECONDS:
            for view, n in zip(cached.views, map(self._routing_running, cached.keys)):
                view.running = n
            cached.synced = now
        return cached

    def build_views(self, pods: Sequence[Pod], now: float,
                    running: Callable[[PodKey], int] | None = None) -> list[PodView]:
        """Fresh views from every source (also what /metrics shows, with the true running counts)."""
        running = running or self.shared.running
        capacities = self.capacity.capacities(p.key for p in pods)
        speeds = self.speed.speeds()
        modes, default = self.capacity_modes, self.default_mode
        views = []
        for pod in pods:
            key = pod.key
            speed = speeds.get(key) if modes.get(pod.model, default) == SPEED else None
            sample = self.samples(key, now)
            kv_free = queued = cpu_kv = None
            if sample is not None:
                queued = sample.waiting
                cpu_kv = sample.cpu_kv_usage
                if sample.kv_usage is not None and math.isfinite(sample.kv_usage):
                    kv_free = min(1.0, max(0.0, 1.0 - sample.kv_usage))
            views.append(PodView(pod, running=running(key), queued=queued or 0.0,
                                 kv_free=kv_free, cpu_kv_usage=cpu_kv,
                                 capacity=speed.saturated if speed is not None else capacities[key],
                                 healthy=self.health.healthy(key), speed=speed))
        return views
