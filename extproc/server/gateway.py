"""The gateway's live state: config, pool, strategies, lifecycle hooks, open requests, accounting.

Synchronous and I/O-free: the ext_proc servicer calls `route`, the access-log servicer calls
`complete`, background loops (server/loops.py) call `refresh` and `expire`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics

import extproc.strategies  # noqa: F401  (every strategy registered: a config may name any)
from extproc.config import Config, ConfigError
from extproc.envoy_contract import CLIENT_DESTINATION_HEADERS
from extproc.openai import Request
from extproc.pool import Pool
from extproc.pool.pod import Pod, PodKey
from extproc.ratelimit import RateLimiter
from extproc.routing import Profile, Router, SettingError, StrategySpec, StrategySpecError
from extproc.routing.framework import Hooks
from extproc.routing.outcome import Outcome, Rejected, Routed
from extproc.server.auth import ApiKeys
from extproc.server.metrics import PodMetricsCollector
from extproc.sharing.shared import LocalState, SharedState
from extproc.state.accounting import Accounting, PodFigures
from extproc.state.inflight import OpenRequest, OpenRequests
from extproc.state.reconcile import Reconciler
from extproc.telemetry.engine_metrics import EngineSample
from extproc.vocabulary import PodView, RequestEnd, RequestRecord, Speed

log = logging.getLogger(__name__)

# Headers that steer Envoy's ORIGINAL_DST or AIBrix-style gateways: never accepted from clients.
# (x-envoy-* headers need no stripping here: Envoy refuses their mutation and ORIGINAL_DST follows only
# the configured header.)
CLIENT_FORBIDDEN_HEADERS = frozenset(CLIENT_DESTINATION_HEADERS)

# Requests routed this long before a scrape (beyond its timeout) are in the engine's count when
# the reconciler compares (extproc/state/reconcile.py).
GRACE_MARGIN_SECONDS = 1.0


@dataclass(slots=True)
class _Pending:
    """A scrape that found fewer requests in the engine than counted, waiting to be judged."""
    sample: EngineSample
    others: int     # what other gateways held on the pod then
    counted: int    # what this gateway held there then
    requests: list[tuple[str, OpenRequest]]  # this gateway's, routed before the scrape was sent


def in_subset(address: str, subset: frozenset[str]) -> bool:
    """An endpoint's ip:port is in the subset hint, or its host is (a bare ip allows any port)."""
    return address in subset or address.rpartition(":")[0].strip("[]") in subset


disable_created_metrics()  # *_created series double the scrape for no routing value


class Gateway:
    def __init__(self, config: Config, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic, shared: SharedState | None = None,
                 accounting: Accounting | None = None, limiter: RateLimiter | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.clock = clock
        # Per-key limits, checked before routing (extproc/ratelimit/); in process unless given a Redis one
        self.limiter = limiter or RateLimiter(config.rate_limits, self.registry, clock=clock)
        self.accounting = accounting or Accounting(shared or LocalState())
        # The accounting's parts the gateway drives itself: the counts shared with other gateways and
        # the views routing reads.
        self.shared: SharedState = self.accounting.shared
        self.view_cache = self.accounting.view_cache
        self.open = OpenRequests()
        # Keys unique per process and request, "<origin>.<n>"; clients never see or choose them. The
        # origin names this process, so a gateway that receives another's record knows whose it is.
        self.origin = f"{os.getpid():x}.{time.time_ns():x}"
        self._keys = (f"{self.origin}.{n:x}" for n in itertools.count())
        self.shared.listen(self.origin)
        self.requests_total = Counter("extproc_requests", "Requests handled, by outcome",
                                      ["model", "pod", "strategy", "code"], registry=self.registry)
        self._series: dict[tuple[str, str], set[tuple[str, str]]] = {}  # (model, pod) -> (strategy, code)
        self.api_keys = ApiKeys(env_keys=config.api_keys)  # apply() adds a config's key file
        self._keys_file: str | None = None
        self.unmatched_records = Counter(
            "extproc_unmatched_access_logs", "Access-log records of requests this process did not "
            "route (it restarted while they streamed): tokens credited, no in-flight count to release",
            registry=self.registry)
        self.expired_requests = Counter(
            "extproc_expired_requests", "Routed requests whose access-log record never came; their "
            "in-flight count was released after gateway.request_timeout_seconds", registry=self.registry)
        self.released_requests = Counter(
            "extproc_released_requests", "Routed requests released without their access-log record, by "
            "cause: engine_count (the engine held fewer requests than counted, several scrapes running), "
            "timeout (gateway.request_timeout_seconds)", ["cause"], registry=self.registry)
        self.peer_records = Counter(
            "extproc_peer_access_logs", "Access-log records of requests another gateway process routed "
            "(one Envoy sends its log stream to one replica), passed on through Redis or the workers' "
            "segment: sent by this gateway, or received and their requests released here", ["direction"],
            registry=self.registry)
        self.reconciler = Reconciler()
        self._pending: dict[PodKey, _Pending] = {}
        self.registry.register(PodMetricsCollector(self))
        self.open_streams = 0
        # Envoy's bootstrap names the header ORIGINAL_DST follows; changing only ours on a reload would
        # let clients set the one Envoy still follows.
        self._destination_header = config.destination_header
        self._extra_hooks: list[object] = []  # the gateway's own learners (traces, ...), kept across rebuilds
        self.hooks = Hooks()
        self.spans: Any = None  # server.otel.RequestSpans when OpenTelemetry is on (add_spans)
        self.router: Router | None = None
        self.apply(config)

    def apply(self, config: Config) -> None:
        """Swap in a new config. Learned state (capacity, counts, health) and open requests stay."""
        if config.destination_header != self._destination_header:
            raise ConfigError("destination_header cannot change without a restart "
                              f"(Envoy follows {self._destination_header!r})")
        try:
            router = (Router(config.routing_settings) if self.router is None
                      else self.router.reconfigured(config.routing_settings))
            router.on_plugin = None
            router.validate(config.models)  # every strategy built now: a bad setting refuses the reload
        except (StrategySpecError, SettingError, ValueError) as exc:
            raise ConfigError(f"routing: {exc}") from None
        self.router = router
        self.pool = Pool(config.pods, config.models)
        if config.api_keys_file != self._keys_file:  # re-read only when the setting changes
            self.api_keys = ApiKeys(Path(config.api_keys_file) if config.api_keys_file else None,
                                   config.api_keys)
            self._keys_file = config.api_keys_file
        self.config = config
        self.limiter.apply(config.rate_limits)
        # A sample is stamped when its scrape returns: the engine's count may be up to the scrape
        # timeout older, and a request takes milliseconds from the decision to the engine's queue.
        self.reconciler.grace_s = config.metrics_timeout_seconds + GRACE_MARGIN_SECONDS
        self.client_forbidden_headers = sorted(CLIENT_FORBIDDEN_HEADERS | {config.destination_header})
        self._rebuild_hooks()
        live = {p.key for p in config.pods} | {o.pod.key for o in self.open}
        # ("", "") and (model, ""): requests refused before a model or a pod was known
        self._drop_series({(m, n) for m, n, _ in live} | {(m, "") for m in ("", *config.models)})
        self.accounting.forget(live)
        self.reconciler.forget(live)
        self._pending = {k: v for k, v in self._pending.items() if k in live}
        settings = config.routing_settings
        self.view_cache.configure(settings.load_balance.capacity,
                                  {m: r.load_balance.capacity for m, r in settings.models.items()})
        self.router.state.forget(live)  # what strategies learned of a departed pod went with it
        self.shared.track(config.pods)

    def add_hook(self, plugin: object) -> None:
        """Register a lifecycle hook (post_arrival, post_choice, post_response, ...) that is not part of
        any strategy."""
        self._extra_hooks.append(plugin)
        self.hooks.add(plugin)

    def add_spans(self, spans: Any) -> None:
        """OpenTelemetry: a span per routed request, its traceparent in the routing decision."""
        self.spans = spans
        self.add_hook(spans)

    def _rebuild_hooks(self) -> None:
        hooks = Hooks()
        hooks.add(self.accounting)
        for plugin in self._extra_hooks:
            hooks.add(plugin)
        for plugin in self.router.plugins():
            hooks.add(plugin)
        self.router.on_plugin = hooks.add  # strategies built later (per model, per blend) learn too
        self.hooks = hooks

    def strategy(self, header: str | None) -> StrategySpec:
        """The routing-strategy header value parsed (None: the default); raises StrategySpecError."""
        return self.router.parse(header)

    def profile(self, spec: StrategySpec | str | None, model: str = "") -> Profile:
        """The compiled Profile for a strategy spec and model (blends, auto-blend, gate included)."""
        return self.router.profile_for(spec, model)

    # -- the request path -------------------------------------------------------------------------

    def route(self, request: Request, profile: Profile, request_id: str, queued: bool = False) -> Outcome:
        """Choose a pod: Routed, and the request counts as in flight until `complete` or `abort`. Or
        what the strategy says instead (Queued, Rejected), passed on for the waiting room; None: no
        ready pod. `queued`: the request is leaving the waiting room (extproc.slo.room). With the data
        plane's subset hint (`request.endpoint_subset`), only the pods at those addresses are eligible."""
        now = self.clock()
        if not queued:
            self.hooks.post_arrival(request, now)
        candidates = self._eligible(request, now)
        if not candidates:
            return None
        chosen = profile.pick(request, candidates, now, queued)
        if chosen.__class__ is not PodView:
            return chosen  # type: ignore[return-value]  (None, Queued or Rejected)
        self.hooks.post_choice(request, chosen, now)
        key = next(self._keys)
        self.open.open(key, OpenRequest(request, chosen.pod, profile.name, request_id, now))
        return Routed(chosen.pod, key)

    def _eligible(self, request: Request, now: float) -> list[PodView]:
        """The pods a pick may choose from: the routable ones (unhealthy pods left out, unless that
        leaves none: a health signal must never cause a total outage), within the data plane's subset
        hint when it sent one."""
        candidates = self.view_cache.routable(request.model, self.pool.ready_pods(request.model), now)
        subset = request.endpoint_subset
        if subset is not None:
            candidates = [v for v in candidates if in_subset(v.pod.address, subset)]
        return candidates

    def fallbacks(self, request: Request, profile: Profile, first: Pod) -> list[Pod]:
        """The next-best pods after `first` by the same strategy, for the protocol's ordered endpoint
        list (gateway.fallback_endpoints - 1 of them): each picked from the eligible pods not yet
        listed. Nothing is counted on them: the request is accounted to the pod that serves it
        (`served_by`)."""
        n = self.config.fallback_endpoints - 1
        if n <= 0 or len(self.pool.ready_pods(request.model)) < 2:
            return []  # nothing to list after the pick: spare the views and the scoring
        now = self.clock()
        eligible = self._eligible(request, now)
        # A picker with state of its own (round robin) names what follows its pick without moving; a
        # scoring one orders every pod in one pass; the others are asked again, over what is left.
        following = getattr(getattr(profile, "picker", None), "following", None)
        chosen = next((v for v in eligible if v.pod is first), None)
        if following is not None and chosen is not None:
            return [v.pod for v in following(eligible, chosen)[:n]]
        left = [v for v in eligible if v is not chosen]
        if (order := profile.ranked(request, left, now, n)) is not None:
            return [v.pod for v in order]
        out: list[Pod] = []
        while left and len(out) < n:
            nxt = profile.pick(request, left, now, True)
            if nxt.__class__ is not PodView:
                break  # a strategy that would hold the request back has no next-best to offer
            out.append(nxt.pod)  # type: ignore[union-attr]
            left = [v for v in left if v is not nxt]
        return out

    def served_by(self, key: str, address: str) -> bool:
        """The data plane reports the endpoint that served the request (a fallback, after the first
        pick refused the connection): the request is accounted there from now on, its count moved
        once. False when the address is the pick's already, unknown, or the request is not open."""
        entry = self.open.get(key)
        if entry is None or entry.pod.address == address:
            return False
        pod = self.pool.pod_at(address)
        if pod is None or pod.model != entry.pod.model:
            return False
        self.hooks.post_serve(entry.request, entry.pod, pod, self.clock())
        entry.pod = pod
        return True

    def refused(self, model: str, rejected: Rejected) -> None:
        """A request of `model` was refused (a 429), now or after waiting: the hooks hear of it (the
        request traces count it for the GPU optimizer)."""
        self.hooks.post_reject(model, rejected, self.clock())

    def abort(self, key: str) -> None:
        """The routing stream was cancelled: Envoy may never have used the decision."""
        entry = self.open.close(key)
        if entry is not None:
            self._finish(entry, RequestEnd.released())

    def complete(self, key: str, end: RequestEnd) -> None:
        """A request's access-log record arrived: release it and teach every post-response hook."""
        entry = self.open.close(key)
        if entry is not None:
            self._finish(entry, end)
            return
        self.unmatched_records.inc()
        # Routed by another gateway process behind the same Envoy: it releases its count when this
        # reaches it (through Redis). The tokens are credited here, once.
        owner = key.rpartition(".")[0]
        if owner and owner != self.origin and self.shared.forward(owner, key, end.status):
            self.peer_records.labels("sent").inc()
        pod = self.pool.pod_at(end.upstream) if end.upstream else None
        if pod is not None:
            self.accounting.credit(pod, end.output_tokens)

    def release_forwarded(self) -> int:
        """Release this process's requests whose records another gateway received and passed on.
        Their tokens were credited there; here the count, health and the request series."""
        n = 0
        for key, status in self.shared.take_forwarded():
            entry = self.open.close(key)
            if entry is not None:
                self._finish(entry, RequestEnd(status))
                n += 1
        if n:
            self.peer_records.labels("released").inc(n)
        return n

    def _finish(self, entry: OpenRequest, end: RequestEnd) -> None:
        """The request's end, with what this gateway knows of it, as every post-response hook's record."""
        now = self.clock()
        e2e_s, prompt_tokens, request = end.e2e_s, end.prompt_tokens, entry.request
        entry.ended = now if e2e_s is None else min(now, entry.started + e2e_s)
        record = RequestRecord(
            request_id=entry.request_id, model=request.model, pod=entry.pod, strategy=entry.strategy,
            status=end.status, prompt_tokens=prompt_tokens if prompt_tokens is not None
            else request.prompt_tokens, output_tokens=end.output_tokens, token_source=end.token_source,
            ttfb_s=end.ttfb_s, e2e_s=e2e_s if e2e_s is not None else now - entry.started,
            connect_failure=end.connect_failure, aborted=end.aborted, stream=request.stream,
            request=request)
        self.hooks.post_response(record, now)
        self.count(request.model, entry.pod.name, entry.strategy,
                   "aborted" if end.aborted else str(end.status))

    def count(self, model: str, pod: str, strategy: str, code: str) -> None:
        self.requests_total.labels(model, pod, strategy, code).inc()
        self._series.setdefault((model, pod), set()).add((strategy, code))

    def _drop_series(self, live: set[tuple[str, str]]) -> None:
        """Pods gone from the config lose their request series: pod churn must not grow the scrape."""
        for model, pod in [k for k in self._series if k not in live]:
            for strategy, code in self._series.pop((model, pod)):
                self.requests_total.remove(model, pod, strategy, code)

    # -- background ---------------------------------------------------------------------------------

    def refresh(self) -> None:
        self.accounting.refresh(self.pool.all_pods(), self.clock())

    def reconcile(self, key: PodKey, sample: EngineSample | None) -> int:
        """Release this gateway's requests on a pod that its engine no longer holds
        (extproc/state/reconcile.py): their Envoy died with the access-log records. Called with each
        scrape as it arrives; a scrape is judged at the next one, once the records of requests that
        had ended before it was read have come in. A record that still arrives after its request was
        released finds nothing open and only credits its tokens (`complete`): nothing counts twice."""
        n = self._judge(key, self._pending.pop(key, None))
        shared, reconciler = self.shared, self.reconciler
        if sample is not None and reconciler.suspect(key, shared.running(key), sample):
            self._pending[key] = _Pending(sample, shared.running(key) - shared.local_running(key),
                                          shared.local_running(key),
                                          self.open.on_pod(key, reconciler.cutoff(sample)))
        if n:
            self.released_requests.labels("engine_count").inc(n)
        return n

    def _judge(self, key: PodKey, pending: _Pending | None) -> int:
        if pending is None:
            return 0
        sent = self.reconciler.cutoff(pending.sample)
        # in the engine when it was read, unless lost: still open, or ended after the scrape was sent
        held = [(k, e) for k, e in pending.requests if e.ended is None or e.ended > sent]
        n = self.reconciler.excess(key, len(held), max(0, pending.others), pending.sample, pending.counted)
        released = 0
        for request_key, entry in held:  # oldest first: phantoms predate the fault
            if released == n:
                break
            if self.open.close(request_key) is not None:
                log.warning("request %s on %s: the engine no longer holds it (its access-log "
                            "record is lost), released", entry.request_id, entry.pod.name)
                self._finish(entry, RequestEnd.released())
                released += 1
        return released

    def sample_busy(self) -> None:
        self.accounting.sample_busy(self.clock())

    def observe_scrape(self, key: PodKey, ok: bool, refused: bool) -> None:
        """A metrics scrape of the pod answered (`ok`) or not (`refused`: nothing listening)."""
        self.accounting.health.observe_scrape(key, ok, refused, self.clock())

    # -- what /metrics and the simulation read --------------------------------------------------------

    def views(self, model: str, now: float) -> Sequence[PodView]:
        """The model's ready pods as routing sees them (cached views)."""
        return self.view_cache.views(model, self.pool.ready_pods(model), now)

    def pod_figures(self, now: float) -> list[PodFigures]:
        """Every pod's fresh view and what was learned of it."""
        return self.accounting.figures(self.pool.all_pods(), now)

    def pod_speed(self, key: PodKey) -> Speed | None:
        """The pod's fitted speed (capacity: speed); None until it is measured."""
        return self.accounting.speed.speed(key)

    def expire(self) -> int:
        """Release requests whose record never came (Envoy restarted, access log lost)."""
        deadline = self.clock() - self.config.request_timeout_seconds
        n = 0
        for _, entry in self.open.expired(deadline):
            log.warning("request %s on %s: no access-log record after %gs, released", entry.request_id,
                        entry.pod.name, self.config.request_timeout_seconds)
            self._finish(entry, RequestEnd.released())
            n += 1
        self.expired_requests.inc(n)
        if n:
            self.released_requests.labels("timeout").inc(n)
        return n
