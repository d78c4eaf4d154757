"""The gateway's learners: what every routed request teaches of its pod (in-flight counts, completed
tokens, capacity, speed, health), and the view cache routing reads them through (state/views.py).

Accounting is itself a pair of lifecycle hooks: `post_choice` counts a request in flight on its pod,
`post_response` releases it, credits its output tokens and measures its speed; each moves the pod's
cached view at once. It does no I/O: the live server feeds it engine samples and Redis snapshots from
background loops, the fleet simulation feeds it virtual ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from extproc.openai import Request
from extproc.pool.pod import Pod, PodKey
from extproc.sharing.shared import SharedState
from extproc.sharing.speed_sums import PeerSums, shifted
from extproc.state.capacity import BusyClock, CapacityEstimator
from extproc.state.speed import LoadIntegral, SpeedEstimator
from extproc.state.views import SampleSource, ViewCache, no_samples
from extproc.telemetry.health import PodHealth
from extproc.vocabulary import PodView, RequestRecord, Speed


@dataclass(slots=True, frozen=True)
class PodFigures:
    """One pod as /metrics shows it: its fresh view (true running counts) and what was learned of it."""

    view: PodView
    local_running: int          # in flight through this gateway only
    observed: float | None      # AIBrix's observed rate (capacity: observed), tokens/s
    speed: Speed | None         # its fitted speed (capacity: speed)
    output_tokens: int          # this gateway's own tally


class Accounting:
    def __init__(self, shared: SharedState, capacity: CapacityEstimator | None = None,
                 health: PodHealth | None = None, samples: SampleSource = no_samples,
                 speed: SpeedEstimator | None = None, wall: Callable[[], float] = time.time) -> None:
        self.shared = shared
        self.wall = wall  # the clock shared speed evidence is timed by (each gateway's own differs)
        self.capacity = capacity or CapacityEstimator()  # AIBrix's observed rate (capacity: observed)
        self.speed = speed or SpeedEstimator()  # speed at load (capacity: speed, the default)
        self.load = LoadIntegral()
        self._starts: dict[int, tuple[float, float]] = {}  # id(request) -> (routed at, load integral)
        self.health = health or PodHealth()
        self.health.on_change = self._health_changed
        self.output_tokens: dict[PodKey, int] = {}  # this gateway's own tally, for /metrics
        self.view_cache = ViewCache(shared, self.capacity, self.speed, self.health, samples)
        self.busy = BusyClock()
        self._tracked: list[Pod] = []
        self._peers_folded: object = None  # the others' speed evidence as last folded in
        self._speed_shared: dict[PodKey, int] = {}  # pod -> the evidence's version last handed over

    @property
    def samples(self) -> SampleSource:
        """The engine samples: read by the speed fit here and by the views alike (one source)."""
        return self.view_cache.samples

    @samples.setter
    def samples(self, source: SampleSource) -> None:
        self.view_cache.samples = source

    # -- hooks -----------------------------------------------------------------------------------

    def post_choice(self, request: Request, chosen: PodView, now: float) -> None:
        pod = chosen.pod
        self.shared.add_running(pod, 1)
        self._starts[id(request)] = (now, self.load.advance(pod.key, now, self.shared.running(pod.key)))
        self.view_cache.started(pod.key)

    def post_serve(self, request: Request, chosen: Pod, served: Pod, now: float) -> None:
        """A fallback served the request: its in-flight count moves from the pick to the server, and
        its speed is measured against the server's load from now on."""
        self.shared.add_running(chosen, -1)
        self.view_cache.ended(chosen.key)
        self.shared.add_running(served, 1)
        self.view_cache.started(served.key)
        self.load.advance(chosen.key, now, self.shared.running(chosen.key))
        if id(request) in self._starts:
            self._starts[id(request)] = (now, self.load.advance(served.key, now,
                                                                self.shared.running(served.key)))

    def _health_changed(self, key: PodKey, healthy: bool, restarted: bool = False) -> None:
        """A pod left or rejoined routing (a response, scrape or probe): the cached view follows now.
        Back after its address refused connections, it is likely a new engine: re-measured from its
        type's figure (a pod out for slow scrapes keeps what was measured)."""
        if restarted:
            self.speed.restarted(key)
        self.view_cache.health_changed(key, healthy)

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
        self.view_cache.ended(key)

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
        # The same read as a second ago (Redis's are every other heartbeat): what was folded in stands,
        # and the estimator keeps its merges of it (a new list per pod would make each one anew).
        fold = peers is not self._peers_folded or not peers
        self._peers_folded = peers
        offset = self.wall() - now
        summed = isinstance(peers, PeerSums)  # one array (Redis's read): the fit takes it whole
        if fold:
            self.speed.merge_peer_sums(peers if summed else None, -offset)
        shared = self._speed_shared
        for pod in self._tracked:
            key = pod.key
            version = self.speed.version(key)
            if version and shared.get(key) != version:  # else the state holds this very evidence
                evidence = self.speed.export(key)
                if evidence is not None:
                    self.shared.share_speed(key, shifted(evidence, offset))
                    shared[key] = version
            if fold and not summed:
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
        self.view_cache.clear()
        self.capacity.forget(live)
        self.speed.forget(live)
        self.load.forget(live)
        self.health.forget(live)
        self.shared.forget(live)
        for key in [k for k in self._speed_shared if k not in live]:
            del self._speed_shared[key]
        for key in [k for k in self.output_tokens if k not in live]:
            del self.output_tokens[key]

    # -- what /metrics reads ------------------------------------------------------------------------

    def figures(self, pods: Sequence[Pod], now: float) -> list[PodFigures]:
        """Each pod's fresh view (true running counts, not routing's) with what was learned of it."""
        shared, capacity, speed, tokens = self.shared, self.capacity, self.speed, self.output_tokens
        return [PodFigures(view, shared.local_running(view.pod.key), capacity.estimate(view.pod.key),
                           speed.speed(view.pod.key), tokens.get(view.pod.key, 0))
                for view in self.view_cache.build_views(pods, now)]
