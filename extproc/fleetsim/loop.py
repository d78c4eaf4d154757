"""The discrete-event loop: one strategy, one scenario, virtual time.

Events, earliest first (ties: engine steps, then background ticks, then arrivals, each in a fixed
order, so a seed fixes the whole run):
  * a replica's engine step ends  -> deliver finished/failed requests to the gateway that routed them
    (its access-log path, `Gateway.complete`), then start the next step;
  * per gateway, on the live schedules: engine-metric scrape (the sample routing sees until the next
    one), capacity refresh (`Gateway.refresh`), shared-state sync (several gateways only);
  * a replica loss from the scenario's timeline;
  * an arrival -> `Gateway.route` on the gateway it reached -> the chosen replica's engine.
Arrivals stop at `duration_s`; the run then drains (background loops still running) until every
request has ended, or fails whatever is left after `drain_limit_s`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from extproc.fleetsim.arrivals import Arrival, prompt_text
from extproc.fleetsim.autoscale import FleetScaler, Optimizer, Timeline
from extproc.fleetsim.fleet import Replica, build_replicas
from extproc.fleetsim.gateways import build_gateways, gateway_config
from extproc.fleetsim.scenario import Autoscale, Scenario
from extproc.fleetsim.slo_profiles import load_slo_profiles, virtual_profile
from extproc.gpu_profiles import GpuProfile
from extproc.openai import CHARS_PER_TOKEN, Request
from extproc.routing.outcome import Queued, Rejected, Routed
from extproc.sim.prefix import block_hashes
from extproc.sim.sequences import CapacityError, SeqState, SimRequest
from extproc.slo.queue import Entry
from extproc.slo.room import Room
from extproc.slo.strategy import SloProfile

PENDING, OK, REJECTED, FAILED = 0, 1, 2, 3
STEP, SCRAPE, REFRESH, SYNC, LOSS, EXPIRE, DISPATCH, REPLAN, PROVISIONED, RETIRE = range(10)
BUCKET_S = 5.0  # resolution of the time series (utilization over time)
NAN = math.nan


class Clock:
    """The virtual clock every gateway reads (`Gateway(clock=...)`)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class RunResult:
    strategy: str
    scenario: Scenario
    arrivals: list[Arrival]
    replicas: list[Replica]
    status: list[int]
    replica_of: list[int]
    ttft: list[float]
    tpot: list[float]
    e2e: list[float]
    output: list[int]
    lost_at: dict[int, float] = field(default_factory=dict)  # replica index -> time it disappeared
    # replica index -> [start, end) spans it served (lost or drained: its last span ends then)
    spans: dict[int, list[list[float]]] = field(default_factory=dict)
    autoscale: Timeline | None = None  # the optimizer's re-plans (--optimizer)
    bucket_tokens: dict[str, list[int]] = field(default_factory=dict)  # per GPU type, per BUCKET_S
    bucket_routed: dict[str, list[int]] = field(default_factory=dict)
    end_time: float = 0.0
    gateways: int = 1
    # The first gateway's saturated-capacity estimate per replica (capacity: speed), every BUCKET_S:
    # (virtual time, estimate or NaN per replica index). What the capacity metric would have shown.
    capacity_estimates: list[tuple[float, list[float]]] = field(default_factory=list)
    queue_samples: list[tuple[float, int]] = field(default_factory=list)  # (time, requests in SLO queues)
    gave_up: bool = False  # stopped early (`give_up`): the SLO was already missed for certain


ProgressFn = Callable[[float], None]


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
    clock = Clock()
    name = strategy
    strategy, _, only = strategy.partition("@")
    replicas = build_replicas(scenario, seed)
    groups = {g.name: g for g in scenario.groups if not only or g.name == only}
    if only and not groups:
        raise ValueError(f"{strategy}@{only}: no deployment named {only!r} in the fleet")
    ordinal: dict[str, int] = {}
    for r in replicas:  # what runs at the start
        k = ordinal[r.deployment] = ordinal.get(r.deployment, -1) + 1
        group = groups.get(r.deployment)
        first = 0 if group is None else (group.initial if optimizer and group.initial is not None
                                         else group.replicas)
        r.alive = k < first
    config = gateway_config(scenario.model, replicas, seed)
    by_addr = {r.address: r for r in replicas}
    oracle = {p.key: by_addr[p.address].saturated for p in config.pods} if oracle_capacity else None
    gws = build_gateways(gateways, config, clock, share_tokens, oracle)
    profiles = [g.gateway.profile(strategy, scenario.model) for g in gws]  # the model's own routingConfig
    # the SLO waiting room of each gateway (slo* strategies), run in virtual time
    rooms = [Room(load_slo_profiles(scenario, g.gateway, replicas).queues) if isinstance(p, SloProfile)
             else None for g, p in zip(gws, profiles)]
    queued: dict[int, tuple[Request, str]] = {}  # arrival index -> (request, prompt text): SLO queue
    by_address = {r.address: r for r in replicas}
    keys_of = [[p.key for p in g.gateway.pool.all_pods()] for g in gws]
    replicas_of = [[by_address[p.address] for p in g.gateway.pool.all_pods()] for g in gws]
    n = len(arrivals)
    res = RunResult(name, scenario, list(arrivals), replicas, [PENDING] * n, [-1] * n, [NAN] * n,
                    [NAN] * n, [NAN] * n, [0] * n, gateways=gateways)
    nb = max(1, math.ceil(scenario.duration_s / BUCKET_S))
    gpus = sorted({r.gpu for r in replicas})
    res.bucket_tokens = {g: [0] * nb for g in gpus}
    res.bucket_routed = {g: [0] * nb for g in gpus}
    decision_key: list[str | None] = [None] * n
    warmup, duration = scenario.warmup_s, scenario.duration_s
    slo_tpot = scenario.slo.tpot_s if give_up and scenario.slo.tpot_s is not None else math.inf
    slo_ttft = scenario.slo.ttft_s if give_up and scenario.slo.ttft_s is not None else math.inf
    # p99 (nearest rank) of at most `measured` values exceeds a bound once more than 1 % exceed it
    allowed = 0.01 * sum(1 for a in arrivals if warmup <= a.time < duration) if give_up else math.inf
    misses = [0, 0, 0]  # measured requests over the TPOT bound, over the TTFT bound, rejected or failed
    streams = scenario.streams
    model = scenario.model
    heap: list[tuple[float, int, int, int]] = []  # (time, kind, order, arg)
    order = 0
    open_count = 0

    def push(t: float, kind: int, arg: int) -> None:
        nonlocal order
        order += 1
        heapq.heappush(heap, (t, kind, order, arg))

    timing = scenario.timing
    periods = {SCRAPE: timing.metrics_refresh_s, REFRESH: timing.capacity_refresh_s,
               SYNC: timing.sync_interval_s}
    for g in range(gateways):
        phase = g / gateways  # gateway replicas are not in lock-step
        push(phase * timing.metrics_refresh_s, SCRAPE, g)
        push(timing.capacity_refresh_s * (1 + phase), REFRESH, g)
        push(timing.sync_interval_s * (1 + phase), SYNC, g)  # also the busy-time sample, as live
    for loss_i, loss in enumerate(scenario.losses):
        push(loss.at, LOSS, loss_i)
    res.spans = {r.index: [[0.0, math.inf]] if r.alive else [] for r in replicas}

    def reconfigure() -> None:
        """The fleet changed: every gateway gets the new pod list, as from discovery."""
        cfg = gateway_config(model, replicas, seed)
        for g in gws:
            g.gateway.apply(cfg)
        # apply() rebuilds profiles from names: take the new ones, as the live server would
        profiles[:] = [g.gateway.profile(strategy, model) for g in gws]
        keys_of[:] = [[p.key for p in g.gateway.pool.all_pods()] for g in gws]
        replicas_of[:] = [[by_address[p.address] for p in g.gateway.pool.all_pods()] for g in gws]

    scaler: FleetScaler | None = None
    if optimizer:
        auto = scenario.autoscale or Autoscale()
        given = gpu_profiles or {}
        measured = {d: given.get(d) or replace(virtual_profile(scenario, g.gpu, d), cost=g.cost)
                    for d, g in groups.items()}
        opt = Optimizer(model, groups, measured, auto, clock)
        for g in gws:
            g.gateway.add_hook(opt.hooks())
        res.autoscale = opt.timeline
        scaler = FleetScaler(opt, replicas, res.spans, clock, lambda t, i: push(t, PROVISIONED, i),
                             reconfigure)
        periods[REPLAN] = auto.interval_s
        push(auto.interval_s, REPLAN, 0)

    def reject(i: int) -> None:
        res.status[i] = REJECTED
        if warmup <= arrivals[i].time < duration:
            misses[2] += 1

    def end_request(i: int, r: Replica, seq: SeqState | None, status: int, code: int) -> None:
        nonlocal open_count
        open_count -= 1
        res.status[i] = status
        measured = warmup <= arrivals[i].time < duration
        if measured and status != OK:
            misses[2] += 1
        out = seq.num_output if seq is not None else 0
        res.output[i] = out
        arrival = arrivals[i]
        ttfb = None
        if seq is not None and seq.first_token_time is not None:
            ttfb = seq.first_token_time - arrival.time
            if status == OK:
                res.ttft[i] = ttfb
                res.e2e[i] = seq.finish_time - arrival.time  # type: ignore[operator]
                if out > 1:
                    res.tpot[i] = (seq.finish_time - seq.first_token_time) / (out - 1)  # type: ignore[operator]
                    if measured and res.tpot[i] > slo_tpot:
                        misses[0] += 1
                if measured and ttfb > slo_ttft:
                    misses[1] += 1
        key = decision_key[i]
        if not r.ready and not r.open:
            push(clock.now, RETIRE, r.index)  # the last request of a draining replica
        if rooms[arrival.gateway] is not None:
            push(clock.now, DISPATCH, arrival.gateway)  # capacity may have freed: the queue goes next
        if key is not None:
            gws[arrival.gateway].gateway.complete(
                key, status=code, output_tokens=out, token_source="usage", ttfb_s=ttfb,
                e2e_s=clock.now - arrival.time, aborted=status == FAILED and code == 0)

    def on_step(r: Replica, t: float) -> None:
        driver = r.driver
        tokens = res.bucket_tokens[r.gpu]
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
                end_request(r.open.pop(seq.request.request_id), r, seq, OK, 200)
            for seq in step.failed:
                end_request(r.open.pop(seq.request.request_id), r, seq, FAILED, 503)
        engine = driver.engine
        if warmup <= t < duration and len(engine.waiting) > r.peak_waiting:
            r.peak_waiting = len(engine.waiting)
        nxt = driver.next_event_time()
        if nxt is not None and nxt != r.scheduled:
            r.scheduled = nxt
            push(nxt, STEP, r.index)

    def lose(loss_i: int) -> None:
        loss = scenario.losses[loss_i]
        group = [r for r in replicas if r.gpu == loss.gpu and r.alive]
        count = max(1, round(len(group) * loss.fraction))
        for r in group[len(group) - count:]:
            r.alive = False
            res.lost_at[r.index] = clock.now
            res.spans[r.index][-1][1] = clock.now
            for rid, i in list(r.open.items()):
                seq = r.driver.engine.get(rid)  # what it streamed so far is all the client got
                r.driver.abort(rid)
                end_request(i, r, seq, FAILED, 0)
            r.open.clear()
        reconfigure()

    def start(i: int, decision: Routed | None, text: str, t: float) -> None:
        if decision is None:
            reject(i)  # no routable pod: the client gets a 503 from the gateway
            return
        nonlocal open_count
        a = arrivals[i]
        r = by_address[decision.pod.address]
        res.replica_of[i] = r.index
        decision_key[i] = decision.key
        open_count += 1
        res.bucket_routed[r.gpu][min(nb - 1, int(t // BUCKET_S))] += 1
        try:
            hashes = block_hashes(text, r.driver.engine.config.block_size * CHARS_PER_TOKEN) if text else ()
            r.driver.add(SimRequest(str(i), a.prompt_tokens, a.output_tokens, hashes), t)
        except CapacityError:
            end_request(i, r, None, REJECTED, 400)  # too long for this engine: vLLM's 400
            return
        r.open[str(i)] = i
        if r.scheduled < 0:
            on_step(r, t)  # idle engine: start a step now

    def drain(g: int, t: float) -> None:
        """The SLO waiting room dispatches, as the live one does (extproc.slo.room)."""
        room = rooms[g]
        if room is None or not room.queues.length(model):
            return

        def route(entry: Entry) -> object:
            request, _ = queued[entry.payload]  # type: ignore[index]
            return gws[g].gateway.route(request, profiles[g], str(entry.payload), queued=True)

        for entry, result in room.dispatch(model, t, route):  # type: ignore[arg-type]
            i = entry.payload
            _, text = queued.pop(i)  # type: ignore[arg-type]
            if type(result) is Rejected:
                reject(i)  # type: ignore[arg-type]
            else:
                start(i, result, text, t)  # type: ignore[arg-type]

    pod_speed = gws[0].gateway.pod_speed
    addr_index = {r.address: r.index for r in replicas}
    next_estimate = 0.0

    def record_estimates(t: float) -> None:
        row = [NAN] * len(replicas)
        for p in gws[0].gateway.pool.all_pods():
            sp = pod_speed(p.key)
            if sp is not None:
                row[addr_index[p.address]] = sp.saturated
        res.capacity_estimates.append((t, row))

    ai = 0
    next_arrival = arrivals[0].time if n else math.inf
    last_progress = 0.0
    while True:
        if heap and heap[0][0] <= next_arrival:
            t, kind, _, arg = heapq.heappop(heap)
            clock.now = t
            if kind == STEP:
                r = replicas[arg]
                if r.alive and r.scheduled == t:
                    r.scheduled = -1.0
                    on_step(r, t)
                continue
            if kind == EXPIRE:
                for entry, _ in rooms[arg].expire(model, t):  # type: ignore[union-attr]
                    queued.pop(entry.payload)  # type: ignore[arg-type]
                    reject(entry.payload)  # type: ignore[arg-type]  (a 429: SLO breached)
                push(t, DISPATCH, arg)
                continue
            if kind == DISPATCH:
                drain(arg, t)
                continue
            if ai >= n and open_count == 0 and not queued:
                break  # only background ticks left
            if t > duration + drain_limit_s:
                break
            if kind == SCRAPE:
                gws[arg].samples.scrape(replicas_of[arg], keys_of[arg])
            elif kind == REFRESH:
                gws[arg].gateway.refresh()
                if arg == 0 and t >= next_estimate:
                    record_estimates(t)
                    res.queue_samples.append((t, len(queued)))
                    next_estimate = t + BUCKET_S
                if give_up and (misses[2] or misses[0] > allowed or misses[1] > allowed):
                    res.gave_up = True
                    break
                if progress is not None and arg == 0 and t - last_progress >= 5.0:
                    progress(min(t, duration))
                    last_progress = t
            elif kind == SYNC:
                if gateways > 1:
                    gws[arg].shared.sync(t)  # type: ignore[attr-defined]
                gws[arg].gateway.sample_busy()
            elif kind == REPLAN:
                scaler.replan(t)  # type: ignore[union-attr]
            elif kind == LOSS:
                lose(arg)
                continue
            elif kind == PROVISIONED:
                scaler.provisioned(replicas[arg])  # type: ignore[union-attr]
                continue
            elif kind == RETIRE:
                scaler.drained(replicas[arg])  # type: ignore[union-attr]
                continue
            push(t + periods[kind], kind, arg)
            continue
        if ai >= n:
            break
        a = arrivals[ai]
        i = ai
        ai += 1
        next_arrival = arrivals[ai].time if ai < n else math.inf
        clock.now = t = a.time
        text = prompt_text(a, i) if a.group >= 0 else ""
        request = Request(model, "/v1/chat/completions", stream=True, prompt_tokens=a.prompt_tokens,
                          max_tokens=streams[a.stream].max_tokens, prompt=text)
        outcome = gws[a.gateway].gateway.route(request, profiles[a.gateway], str(i))
        if type(outcome) is Queued:  # wait in this gateway's room
            outcome.entry.payload = i
            outcome = rooms[a.gateway].admit(outcome)  # type: ignore[union-attr]
            if type(outcome) is Queued:
                queued[i] = (request, text)
                push(outcome.entry.deadline, EXPIRE, a.gateway)
                continue
        if type(outcome) is Rejected:
            reject(i)  # a 429: slo_breached, queue_full
            continue
        start(i, outcome, text, t)  # type: ignore[arg-type]
    for i in list(queued):  # still waiting when the run ended: never served
        res.status[i] = REJECTED
    # Anything still open after the drain limit ends as a failure, so every request is accounted for.
    for r in replicas:
        for rid, i in list(r.open.items()):
            seq = r.driver.engine.get(rid)
            r.driver.abort(rid)
            end_request(i, r, seq, FAILED, 0)
        r.open.clear()
    res.end_time = clock.now
    return res
