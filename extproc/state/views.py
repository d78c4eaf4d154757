"""The view cache: each model's PodViews as routing reads them, built from every source the gateway
learns from (shared counts, capacity, speed, engine samples, health) and kept between rebuilds.

What the learners (state/accounting.py) change moves a pod's cached view at once: a request started or
ended on it, its health. Everything else reaches the views when they are rebuilt (VIEW_REBUILD_SECONDS)
or their running counts re-read (RUNNING_RESYNC_SECONDS). No I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from extproc.pool.pod import Pod, PodKey
from extproc.sharing.shared import SharedState
from extproc.state.capacity import CapacityEstimator
from extproc.state.speed import SpeedEstimator
from extproc.telemetry.engine_metrics import EngineSample
from extproc.telemetry.health import PodHealth
from extproc.vocabulary import PodView, Snapshot

SampleSource = Callable[[PodKey, float], EngineSample | None]


def no_samples(key: PodKey, now: float) -> EngineSample | None:
    return None


# Routing reads cached views: rebuilt from samples and capacity at most this often, running counts
# re-read from the shared state at most this often; this gateway's own changes apply at once.
VIEW_REBUILD_SECONDS = 0.25
RUNNING_RESYNC_SECONDS = 0.05

SPEED, OBSERVED = "speed", "observed"  # routing.load_balance.capacity


@dataclass(slots=True)
class _Cached:
    pods: Sequence[Pod]
    views: Snapshot
    keys: list[PodKey]
    built: float
    synced: float
    routable: Snapshot | None = None  # the views routing picks among (see `routable`); None: not yet


class ViewCache:
    """Per model, its views and the routable subset; per pod, the cached view the learners move."""

    def __init__(self, shared: SharedState, capacity: CapacityEstimator, speed: SpeedEstimator,
                 health: PodHealth, samples: SampleSource = no_samples) -> None:
        self.shared = shared
        self.capacity = capacity
        self.speed = speed
        self.health = health
        self.samples = samples
        # Which capacity each model's views carry (the model's routing.load_balance.capacity).
        self.capacity_modes: Mapping[str, str] = {}
        self.default_mode = SPEED
        # What routing counts in flight: with peers, this gateway's recent starts echoed per peer.
        self._routing_running = shared.routing_running
        self._cache: dict[str, _Cached] = {}  # per model
        self._live: dict[PodKey, PodView] = {}  # the cached view of each pod, for in-place updates

    def configure(self, default_mode: str, capacity_modes: Mapping[str, str]) -> None:
        """The capacity the views carry: `routing.load_balance.capacity`, and each model's own."""
        self.default_mode = default_mode
        self.capacity_modes = capacity_modes

    # -- what the learners change at once ---------------------------------------------------------

    def started(self, key: PodKey) -> None:
        """This gateway routed a request to the pod."""
        view = self._live.get(key)
        if view is not None:
            view.running += 1 + self.shared.peers  # see SyncCore.routing_running

    def ended(self, key: PodKey) -> None:
        """A request this gateway routed to the pod ended."""
        view = self._live.get(key)
        if view is not None:
            view.running = max(0, view.running - 1)

    def health_changed(self, key: PodKey, healthy: bool) -> None:
        """A pod left or rejoined routing: its cached view follows now."""
        view = self._live.get(key)
        if view is not None:
            view.healthy = healthy
            cached = self._cache.get(key[0])
            if cached is not None:
                cached.routable = None

    def clear(self) -> None:
        """The pool changed: every view is rebuilt at its next read."""
        self._cache.clear()
        self._live.clear()

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
