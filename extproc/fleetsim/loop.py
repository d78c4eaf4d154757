"""The discrete-event loop: one strategy, one scenario, virtual time (FleetRun: one method per event).

Events, earliest first (ties: engine steps, then background ticks, then arrivals, each in a fixed
order, so a seed fixes the whole run):
  * a replica's engine step ends  -> deliver finished/failed requests to the gateway that routed them
    (its access-log path, `Gateway.complete`), then start the next step;
  * per gateway, on the live schedules: engine-metric scrape (the sample routing sees until the next
    one), capacity refresh (`Gateway.refresh`), shared-state sync (several gateways only);
  * a replica loss from the scenario's timeline;
  * an arrival -> `Gateway.route` on the gateway it reached -> admission (extproc.admission): the
    chosen replica's engine, the strategy's waiting room, or a refusal.
Arrivals stop at `duration_s`; the run then drains (background loops still running) until every
request has ended, or fails whatever is left after `drain_limit_s`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from extproc import admission
from extproc.fleetsim.arrivals import Arrival, prompt_text
from extproc.fleetsim.autoscale import FleetScaler, Optimizer
from extproc.fleetsim.fleet import Replica, build_replicas
from extproc.fleetsim.gateways import build_gateways, gateway_config
from extproc.fleetsim.result import BUCKET_S, FAILED, NAN, OK, PENDING, REJECTED, Clock, ProgressFn, RunResult
from extproc.fleetsim.scenario import Autoscale, Scenario
from extproc.fleetsim.shared import SimSharedState
from extproc.fleetsim.slo_profiles import load_slo_profiles, virtual_profile
from extproc.gpu_profiles import GpuProfile
from extproc.openai import CHARS_PER_TOKEN, Request
from extproc.routing.framework import waiting_for
from extproc.routing.outcome import Outcome, Queued, Rejected, Routed
from extproc.sim.prefix import block_hashes
from extproc.sim.sequences import CapacityError, SeqState, SimRequest
from extproc.slo.fleet_factors import decode, factors_key
from extproc.slo.model import tokens_per
from extproc.slo.state import learned
from extproc.vocabulary import TOKENS_FROM_USAGE, RequestEnd

if TYPE_CHECKING:
    from extproc.routing.framework import Held, VirtualRoom

STEP, SCRAPE, REFRESH, SYNC, LOSS, EXPIRE, DISPATCH, REPLAN, PROVISIONED, RETIRE = range(10)
# What a measured request missed (`give_up` counts them): a latency bound of the SLO, or service at all
MISSES = TPOT, TTFT, E2E, TPAT, REFUSED = range(5)

__all__ = ["BUCKET_S", "FAILED", "OK", "PENDING", "REJECTED", "Clock", "FleetRun", "RunResult", "run"]


def run(scenario: Scenario, strategy: str, arrivals: Sequence[Arrival], *, gateways: int = 1,
        share_tokens: bool = True, seed: int = 0, drain_limit_s: float = 600.0,
        progress: ProgressFn | None = None, oracle_capacity: bool = False,
        give_up: bool = False, optimizer: bool = False,
        gpu_profiles: Mapping[str, GpuProfile] | None = None) -> RunResult:
    """Replay `arrivals` through `strategy`. With `give_up`, stop as soon as the scenario's SLO (read
    as the report reads it: p99 TPOT and TTFT of the measured window, nothing rejected or failed) can
    no longer be met, and set `gave_up`: what a rate search needs, at a fraction of a failing run.
    With `optimizer`, the GPU optimizer scales each deployment (fleetsim.autoscale). `strategy@dep`
    runs only deployment `dep` (the spec's Scalar baseline: one GPU type, sized by the optimizer).
    `gpu_profiles` (deployment -> profile) are the optimizer's; default: measured on the engine model."""
    return FleetRun(scenario, strategy, arrivals, gateways=gateways, share_tokens=share_tokens, seed=seed,
                    drain_limit_s=drain_limit_s, progress=progress, oracle_capacity=oracle_capacity,
                    give_up=give_up, optimizer=optimizer, gpu_profiles=gpu_profiles).run()


class FleetRun:
    """One run's state; `run()` pops events and hands each to its method."""

    def __init__(self, scenario: Scenario, strategy: str, arrivals: Sequence[Arrival], *, gateways: int = 1,
                 share_tokens: bool = True, seed: int = 0, drain_limit_s: float = 600.0,
                 progress: ProgressFn | None = None, oracle_capacity: bool = False,
                 give_up: bool = False, optimizer: bool = False,
                 gpu_profiles: Mapping[str, GpuProfile] | None = None) -> None:
        self.scenario, self.arrivals, self.seed, self.gateways = scenario, arrivals, seed, gateways
        self.drain_limit_s, self.progress, self.give_up = drain_limit_s, progress, give_up
        self.clock = clock = Clock()
        name = strategy
        strategy, _, only = strategy.partition("@")
        self.strategy = strategy
        self.replicas = replicas = build_replicas(scenario, seed)
        groups = self._deployments(only, optimizer)
        config = gateway_config(scenario.model, replicas, seed)
        self.by_address = by_address = {r.address: r for r in replicas}
        oracle = {p.key: by_address[p.address].saturated for p in config.pods} if oracle_capacity else None
        self.gws = gws = build_gateways(gateways, config, clock, share_tokens, oracle)
        self.model = model = scenario.model
        # the model's own routingConfig
        self.profiles = [g.gateway.profile(strategy, model) for g in gws]
        self.given = dict(gpu_profiles or {})  # --profiles: the router's and the plan's alike
        self.rooms = self._rooms()
        self.queued: dict[int, tuple[Request, str]] = {}  # arrival index -> (request, prompt text): waiting
        self.keys_of = [[p.key for p in g.gateway.pool.all_pods()] for g in gws]
        self.replicas_of = [[by_address[p.address] for p in g.gateway.pool.all_pods()] for g in gws]
        self.n = n = len(arrivals)
        self.res = res = self._result(name)
        self.decision_key: list[str | None] = [None] * n
        self.warmup, self.duration = warmup, duration = scenario.warmup_s, scenario.duration_s
        bounds = scenario.slo.targets if give_up else {}
        self.slo_tpot, self.slo_ttft, self.slo_e2e, self.slo_tpat = (
            bounds.get(m, math.inf) for m in ("tpot", "ttft", "e2e", "tpat"))
        # p99 (nearest rank) of at most `measured` values exceeds a bound once more than 1 % exceed it
        self.allowed = 0.01 * sum(1 for a in arrivals if warmup <= a.time < duration) if give_up else math.inf
        self.misses = [0] * len(MISSES)  # measured requests, by MISSES
        self.heap: list[tuple[float, int, int, int]] = []  # (time, kind, order, arg)
        self.order = 0
        self.open_count = 0
        self.ai = 0  # the next arrival
        self.next_arrival = arrivals[0].time if n else math.inf
        self.last_progress = 0.0
        self.next_estimate = 0.0
        self._schedule()
        res.spans = {r.index: [[0.0, math.inf]] if r.alive else [] for r in replicas}
        self.scaler = self._autoscaler(groups) if optimizer else None
        self.pod_speed = gws[0].gateway.pod_speed
        self.addr_index = {r.address: r.index for r in replicas}
        # by event kind; a tick returns True to end the run (give_up)
        self.instant = {STEP: self.on_step_end, EXPIRE: self.on_expire, DISPATCH: self.on_dispatch}
        self.ticks = {SCRAPE: self.on_scrape, REFRESH: self.on_refresh, SYNC: self.on_sync,
                      REPLAN: self.on_replan}
        self.one_off = {LOSS: self.on_loss, PROVISIONED: self.on_provisioned, RETIRE: self.on_retire}

    def _deployments(self, only: str, optimizer: bool) -> dict:
        """The deployments this run scales (`strategy@dep`: that one alone); marks what runs at the start."""
        groups = {g.name: g for g in self.scenario.groups if not only or g.name == only}
        if only and not groups:
            raise ValueError(f"{self.strategy}@{only}: no deployment named {only!r} in the fleet")
        ordinal: dict[str, int] = {}
        for r in self.replicas:  # what runs at the start
            k = ordinal[r.deployment] = ordinal.get(r.deployment, -1) + 1
            group = groups.get(r.deployment)
            first = 0 if group is None else (group.initial if optimizer and group.initial is not None
                                             else group.replicas)
            r.alive = k < first
        return groups

    def _rooms(self) -> list[VirtualRoom[int] | None]:
        """Each gateway's waiting room, run in virtual time, for a strategy that holds requests back: its
        payload is the arrival's index."""
        rooms: list[VirtualRoom[int] | None] = []
        for g, p in zip(self.gws, self.profiles):
            waiting = waiting_for(p.name)
            if waiting is None:
                rooms.append(None)
                continue
            load_slo_profiles(self.scenario, g.gateway, self.replicas, self.given)  # on the engine model
            rooms.append(waiting.virtual(g.gateway.router.state))
        return rooms

    def _result(self, name: str) -> RunResult:
        n, scenario = self.n, self.scenario
        res = RunResult(name, scenario, list(self.arrivals), self.replicas, [PENDING] * n, [-1] * n,
                        [NAN] * n, [NAN] * n, [NAN] * n, [0] * n, gateways=self.gateways)
        self.nb = nb = max(1, math.ceil(scenario.duration_s / BUCKET_S))  # time-series buckets
        gpus = sorted({r.gpu for r in self.replicas})
        res.bucket_tokens = {g: [0] * nb for g in gpus}
        res.bucket_routed = {g: [0] * nb for g in gpus}
        return res

    def _schedule(self) -> None:
        """The background ticks' first events, each gateway's phase apart, and the scenario's losses."""
        timing, gateways = self.scenario.timing, self.gateways
        self.periods = {SCRAPE: timing.metrics_refresh_s, REFRESH: timing.capacity_refresh_s,
                        SYNC: timing.sync_interval_s}
        for g in range(gateways):
            phase = g / gateways  # gateway replicas are not in lock-step
            self.push(phase * timing.metrics_refresh_s, SCRAPE, g)
            self.push(timing.capacity_refresh_s * (1 + phase), REFRESH, g)
            self.push(timing.sync_interval_s * (1 + phase), SYNC, g)  # also the busy-time sample, as live
        for loss_i, loss in enumerate(self.scenario.losses):
            self.push(loss.at, LOSS, loss_i)

    def _autoscaler(self, groups: dict) -> FleetScaler:
        """The GPU optimizer in the loop (--optimizer): its hooks on every gateway, its first re-plan."""
        scenario = self.scenario
        auto = scenario.autoscale or Autoscale()
        given = self.given
        measured = {d: given.get(d) or replace(virtual_profile(scenario, g.gpu, d), cost=g.cost)
                    for d, g in groups.items()}
        opt = Optimizer(self.model, groups, measured, auto, self.clock)
        for g in self.gws:
            g.gateway.add_hook(opt.hooks())
        self.res.autoscale = opt.timeline
        scaler = FleetScaler(opt, self.replicas, self.res.spans, self.clock,
                             lambda t, i: self.push(t, PROVISIONED, i), self.reconfigure)
        self.periods[REPLAN] = auto.interval_s
        self.push(auto.interval_s, REPLAN, 0)
        return scaler

    def push(self, t: float, kind: int, arg: int) -> None:
        self.order += 1
        heapq.heappush(self.heap, (t, kind, self.order, arg))

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> RunResult:
        heap, clock, n = self.heap, self.clock, self.n
        instant, ticks, one_off, periods = self.instant, self.ticks, self.one_off, self.periods
        stop_at = self.duration + self.drain_limit_s
        while True:
            if heap and heap[0][0] <= self.next_arrival:
                t, kind, _, arg = heapq.heappop(heap)
                clock.now = t
                handler = instant.get(kind)
                if handler is not None:
                    handler(arg, t)
                    continue
                if self.ai >= n and self.open_count == 0 and not self.queued:
                    break  # only background ticks left
                if t > stop_at:
                    break
                change = one_off.get(kind)
                if change is not None:
                    change(arg)
                    continue
                if ticks[kind](arg, t):
                    break
                self.push(t + periods[kind], kind, arg)
                continue
            if self.ai >= n:
                break
            self.on_arrival()
        return self.finish()

    def finish(self) -> RunResult:
        res = self.res
        for i in list(self.queued):  # still waiting when the run ended: never served
            res.status[i] = REJECTED
        # Anything still open after the drain limit ends as a failure, so every request is accounted for.
        for r in self.replicas:
            for rid, i in list(r.open.items()):
                seq = r.driver.engine.get(rid)
                r.driver.abort(rid)
                self.end_request(i, r, seq, FAILED, 0)
            r.open.clear()
        res.end_time = self.clock.now
        return res

    # -- arrivals and admission (extproc.admission) ---------------------------------------------------

    def on_arrival(self) -> None:
        arrivals = self.arrivals
        i = self.ai
        a = arrivals[i]
        self.ai += 1
        self.next_arrival = arrivals[self.ai].time if self.ai < self.n else math.inf
        self.clock.now = t = a.time
        text = prompt_text(a, i) if a.group >= 0 else ""
        request = Request(self.model, "/v1/chat/completions", stream=True, prompt_tokens=a.prompt_tokens,
                          max_tokens=self.scenario.streams[a.stream].max_tokens, prompt=text)
        outcome = self.gws[a.gateway].gateway.route(request, self.profiles[a.gateway], str(i))
        if isinstance(outcome, Queued):
            outcome.entry.payload = i  # for the room's dispatch and expiry to name the arrival
        self.admitted(i, request, text, t, admission.admit(outcome, self.rooms[a.gateway]))

    def admitted(self, i: int, request: Request, text: str, t: float, outcome: Outcome) -> None:
        """What admission made of arrival `i`: an engine, the waiting room, or a refusal."""
        match outcome:
            case Routed():
                self.start(i, outcome, text, t)
            case None:
                self.reject(i)  # no routable pod: the client gets a 503 from the gateway
            case Queued():
                self.queued[i] = (request, text)
                self.push(outcome.entry.deadline, EXPIRE, self.arrivals[i].gateway)
            case Rejected():
                self.refuse(i, outcome)  # a 429: slo_breached, queue_full

    def refuse(self, i: int, rejected: Rejected) -> None:
        """A 429: the arrival's gateway tells its hooks (the optimizer's traces count it), as live."""
        self.gws[self.arrivals[i].gateway].gateway.refused(self.model, rejected)
        self.reject(i)

    def reject(self, i: int) -> None:
        self.res.status[i] = REJECTED
        if self.warmup <= self.arrivals[i].time < self.duration:
            self.misses[REFUSED] += 1

    def start(self, i: int, decision: Routed, text: str, t: float) -> None:
        a = self.arrivals[i]
        r = self.by_address[decision.pod.address]
        res = self.res
        res.replica_of[i] = r.index
        self.decision_key[i] = decision.key
        self.open_count += 1
        res.bucket_routed[r.gpu][min(self.nb - 1, int(t // BUCKET_S))] += 1
        try:
            hashes = block_hashes(text, r.driver.engine.config.block_size * CHARS_PER_TOKEN) if text else ()
            r.driver.add(SimRequest(str(i), a.prompt_tokens, a.output_tokens, hashes), t)
        except CapacityError:
            self.end_request(i, r, None, REJECTED, 400)  # too long for this engine: vLLM's 400
            return
        r.open[str(i)] = i
        if r.scheduled < 0:
            self.advance(r, t)  # idle engine: start a step now

    def end_request(self, i: int, r: Replica, seq: SeqState | None, status: int, code: int) -> None:
        self.open_count -= 1
        res, misses = self.res, self.misses
        res.status[i] = status
        arrival = self.arrivals[i]
        measured = self.warmup <= arrival.time < self.duration
        if measured and status != OK:
            misses[REFUSED] += 1
        out = seq.num_output if seq is not None else 0
        res.output[i] = out
        ttfb = None
        if seq is not None and seq.first_token_time is not None:
            ttfb = seq.first_token_time - arrival.time
            finish = seq.finish_time
            if status == OK and finish is not None:  # (an OK sequence has always finished)
                res.ttft[i] = ttfb
                res.e2e[i] = finish - arrival.time
                if out > 1:
                    res.tpot[i] = (finish - seq.first_token_time) / (out - 1)
                    if measured and res.tpot[i] > self.slo_tpot:
                        misses[TPOT] += 1
                if measured:
                    misses[TTFT] += ttfb > self.slo_ttft
                    misses[E2E] += res.e2e[i] > self.slo_e2e
                    tpat = res.e2e[i] / tokens_per("tpat", arrival.prompt_tokens, out)
                    misses[TPAT] += tpat > self.slo_tpat
        key = self.decision_key[i]
        now = self.clock.now
        if not r.ready and not r.open:
            self.push(now, RETIRE, r.index)  # the last request of a draining replica
        if self.rooms[arrival.gateway] is not None:
            self.push(now, DISPATCH, arrival.gateway)  # capacity may have freed: the queue goes next
        if key is not None:
            self.gws[arrival.gateway].gateway.complete(key, RequestEnd(
                code, output_tokens=out, token_source=TOKENS_FROM_USAGE, ttfb_s=ttfb,
                e2e_s=now - arrival.time, aborted=status == FAILED and code == 0))

    # -- engine steps ----------------------------------------------------------------------------

    def on_step_end(self, index: int, t: float) -> None:
        r = self.replicas[index]
        if r.alive and r.scheduled == t:
            r.scheduled = -1.0
            self.advance(r, t)

    def advance(self, r: Replica, t: float) -> None:
        """Run the replica's engine to `t`: its steps' tokens counted, finished and failed requests
        ended; its next step scheduled."""
        driver = r.driver
        tokens = self.res.bucket_tokens[r.gpu]
        warmup, duration = self.warmup, self.duration
        for step in driver.advance_to(t):
            emitted = len(step.emitted)
            end = step.end
            if end < duration:
                tokens[int(end // BUCKET_S)] += emitted
                if end >= warmup:
                    r.tokens += emitted
                    r.busy_s += end - max(step.start, warmup)
                    r.preemptions += len(step.preempted)
            for seq in step.finished:
                self.end_request(r.open.pop(seq.request.request_id), r, seq, OK, 200)
            for seq in step.failed:
                self.end_request(r.open.pop(seq.request.request_id), r, seq, FAILED, 503)
        engine = driver.engine
        if warmup <= t < duration and len(engine.waiting) > r.peak_waiting:
            r.peak_waiting = len(engine.waiting)
        nxt = driver.next_event_time()
        if nxt is not None and nxt != r.scheduled:
            r.scheduled = nxt
            self.push(nxt, STEP, r.index)

    # -- the waiting rooms (slo/room.py, in virtual time) ------------------------------------------

    def on_expire(self, g: int, t: float) -> None:
        room = self.rooms[g]
        if room is not None:  # (only a gateway with a room queues, and so schedules an expiry)
            for entry, rejected in room.expire(self.model, t):
                self.queued.pop(entry.payload)
                self.refuse(entry.payload, rejected)  # a 429: SLO breached
        self.push(t, DISPATCH, g)

    def on_dispatch(self, g: int, t: float) -> None:
        """The waiting room dispatches, as the live one does (extproc.slo.room)."""
        room, model = self.rooms[g], self.model
        if room is None or not room.length(model):
            return
        gateway, profile, queued = self.gws[g].gateway, self.profiles[g], self.queued

        def route(entry: Held[int]) -> Outcome:
            request, _ = queued[entry.payload]
            return gateway.route(request, profile, str(entry.payload), queued=True)

        for entry, result in room.dispatch(model, t, route):
            i = entry.payload
            request, text = queued.pop(i)
            self.admitted(i, request, text, t, admission.admit(result, room))

    # -- background ticks (rescheduled on their period) -------------------------------------------

    def on_scrape(self, g: int, t: float) -> bool:
        self.gws[g].samples.scrape(self.replicas_of[g], self.keys_of[g])
        return False

    def on_refresh(self, g: int, t: float) -> bool:
        self.gws[g].gateway.refresh()
        res, misses = self.res, self.misses
        if g == 0 and t >= self.next_estimate:
            self.record_estimates(t)
            res.queue_samples.append((t, len(self.queued)))
            self.next_estimate = t + BUCKET_S
        if self.give_up and (misses[REFUSED] or max(misses[TPOT], misses[TTFT], misses[E2E], misses[TPAT])
                             > self.allowed):
            res.gave_up = True
            return True
        if self.progress is not None and g == 0 and t - self.last_progress >= 5.0:
            self.progress(min(t, self.duration))
            self.last_progress = t
        return False

    def record_estimates(self, t: float) -> None:
        row = [NAN] * len(self.replicas)
        pod_speed, addr_index = self.pod_speed, self.addr_index
        for p in self.gws[0].gateway.pool.all_pods():
            sp = pod_speed(p.key)
            if sp is not None:
                row[addr_index[p.address]] = sp.saturated
        self.res.capacity_estimates.append((t, row))

    def on_sync(self, g: int, t: float) -> bool:
        shared = self.gws[g].shared
        if isinstance(shared, SimSharedState):  # several gateways: the Redis-like sync
            shared.sync(t)
        self.gws[g].gateway.sample_busy()
        return False

    def on_replan(self, _: int, t: float) -> bool:
        if self.scaler is not None:  # (scheduled only with --optimizer)
            # the gauges each live gateway reports with its windows (merged in Redis, they add up)
            self.scaler.optimizer.recorder.snapshot(
                self.model, sum(len(r.open) for r in self.replicas),
                sum(room.length(self.model) for room in self.rooms if room is not None))
            self.scaler.replan(t)
            # every gateway's SLO router reads the optimizer's cuts, as the live ones do from Redis
            cuts = decode(self.scaler.optimizer.redis.get(factors_key(self.model)))
            for g in self.gws:
                state = learned(g.gateway.router.state.store) if g.gateway.router is not None else None
                if state is not None:
                    state.set_cuts(self.model, cuts)
        return False

    # -- fleet changes ---------------------------------------------------------------------------

    def on_loss(self, loss_i: int) -> None:
        loss = self.scenario.losses[loss_i]
        now = self.clock.now
        group = [r for r in self.replicas if r.gpu == loss.gpu and r.alive]
        count = max(1, round(len(group) * loss.fraction))
        for r in group[len(group) - count:]:
            r.alive = False
            self.res.lost_at[r.index] = now
            self.res.spans[r.index][-1][1] = now
            for rid, i in list(r.open.items()):
                seq = r.driver.engine.get(rid)  # what it streamed so far is all the client got
                r.driver.abort(rid)
                self.end_request(i, r, seq, FAILED, 0)
            r.open.clear()
        self.reconfigure()

    def on_provisioned(self, index: int) -> None:
        if self.scaler is not None:  # (a replica is provisioned only with --optimizer)
            self.scaler.provisioned(self.replicas[index])

    def on_retire(self, index: int) -> None:
        if self.scaler is not None:  # (a replica drains only with --optimizer)
            self.scaler.drained(self.replicas[index])

    def reconfigure(self) -> None:
        """The fleet changed: every gateway gets the new pod list, as from discovery."""
        cfg = gateway_config(self.model, self.replicas, self.seed)
        gws, model, by_address = self.gws, self.model, self.by_address
        for g in gws:
            g.gateway.apply(cfg)
        # apply() rebuilds profiles from names: take the new ones, as the live server would
        self.profiles[:] = [g.gateway.profile(self.strategy, model) for g in gws]
        self.keys_of[:] = [[p.key for p in g.gateway.pool.all_pods()] for g in gws]
        self.replicas_of[:] = [[by_address[p.address] for p in g.gateway.pool.all_pods()] for g in gws]
