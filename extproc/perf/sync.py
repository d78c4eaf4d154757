"""`extproc bench sync`: what sharing in-flight counts and tokens through Redis costs, G gateways x P pods.

A real `redis-server` on a free loopback port; G of the project's own `RedisState` objects, built as
`server/app.py` builds them, in this one process. Every pod holds `inflight` requests spread over the
gateways and completes `rate` of them a second fleet-wide (each replaced by a new one at a random
gateway, with its tokens credited and, unless --no-speed, that gateway's speed evidence on the pod
changed), so the fleet changes at a stated rate.

A fleet turn is one sync of every gateway, one after another: each gateway's CPU is this process's CPU
across its own `sync_once` (Redis runs in another process), its latency the wall time of that call,
and a turn that takes longer than the gateway's timeout (0.5 s) fails as it would in a gateway.
Redis's CPU, commands (those run inside scripts included) and bytes come from its INFO, taken per
fleet turn; the real fleet runs 1/interval fleet turns a second, so Redis's cores = its CPU per fleet
turn / interval. Gateways that run one after another do not queue behind each other in Redis, so
latency here is the floor. The gateways' clock is virtual (turn x interval).

Sharing also costs each gateway outside `sync_once`: once a second its refresh loop hands its speed
evidence to the shared state and folds in the others' (`Accounting._share_speed`), and the speed fit
merges the others' sums into each pod's (`SpeedEstimator.refresh`). `speed_sharing` times those with
the project's own objects for one gateway over a few seconds of the fleet's life (its records reaching
rate/G of each pod a second, a new read of the others' sums every other second); the summary's
`whole_core_share` is the sync's share of a core plus theirs. Runs are whole cycles of the speed read,
so its costlier turns count at their share.

Freshness: after each gateway's sync, its view of every pod's other gateways (`running` less its own)
is held against what those gateways last wrote (`wrong_views`: pods that differ; 0 means each view is
exact as of its read, so in a real fleet, where gateways sync side by side, a count is at most two
intervals plus a turn's latency old when routing reads it). Tokens: each gateway's counted deltas,
summed over the run (a first read before any token sets every baseline at 0; the closing heartbeats
let every gateway write and read), must equal the tokens the fleet completed on each pod
(`wrong_token_counts`). Speed sums: after a closing cycle of share writes and a read, each gateway's
view of each pod's others' sums must equal the sum, worked out here apart from Redis's script, of every
other gateway's share as its ledger holds it, within float tolerance (`wrong_speed_sums`).

The collector: G gateways' state and the fleet's estimators share this process's heap, so a
collection that a gateway's allocations set off walks all G gateways' objects (a real gateway's
process holds one's): with the collector `on` the per-gateway CPU is an upper bound. `frozen` moves the
heap as of the warm-up out of the collector's walks (`gc.freeze`), so a turn pays for collecting only
what was allocated since: a lower bound (a real gateway's own long-lived state is walked too). At 50 x
5,000 the two differed by no more than the noise (docs/benchmarks.md): the figure is the gateway's own.

`age_ms` is the read's wall time less the oldest contributor's write: here that is the serial fleet
turn's length, not a real fleet's staleness.

`--processes` runs the gateways side by side instead, a process each (extproc/perf/sync_procs.py);
`--redis-cluster` runs against a Redis Cluster's masters instead of a redis-server of its own.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from extproc.localstack import Proc, free_port, wait_until
from extproc.pool.pod import Pod
from extproc.redis_connect import RedisTarget
from extproc.sharing import speed_sums
from extproc.sharing.redis_sync import RedisState
from extproc.sharing.shared import LocalState

try:  # a --baseline checkout older than the every-other-heartbeat read
    from extproc.sharing.sync_core import SPEED_READ_HEARTBEATS, SPEED_WRITE_HEARTBEATS
except ImportError:
    SPEED_READ_HEARTBEATS, SPEED_WRITE_HEARTBEATS = 1, 5
from extproc.state.speed import SpeedEstimator

TOKENS_PER_REQUEST = 200


@dataclass(slots=True)
class SyncRun:
    gateways: int
    pods: int
    models: int
    rate: float                       # completions per pod per second, fleet-wide
    inflight: int                     # requests held per pod, fleet-wide
    interval: float
    turns: int
    cpu_ms: list[float] = field(default_factory=list)       # per gateway turn
    latency_ms: list[float] = field(default_factory=list)   # per gateway turn
    timeouts: int = 0
    failures: int = 0
    wrong: int = 0                    # views that disagreed with the truth of their own moment
    wrong_tokens: int = -1            # (gateway, pod) token counts that missed the fleet's at the end
    wrong_speed: int = -1             # (gateway, pod) views of the others' speed sums that missed theirs
    speed_checked: int = 0            # (gateway, pod) speed views held against the truth
    collector: str = "on"             # "on", or "frozen": the heap as of the warm-up out of collections
    age_ms: list[float] = field(default_factory=list)       # oldest value in a view, per gateway turn
    redis_cpu_ms: list[float] = field(default_factory=list)  # per fleet turn
    shard_cpu_ms: list[list[float]] = field(default_factory=list)  # per fleet turn, per master
    commands: list[int] = field(default_factory=list)        # per fleet turn
    bytes_out: list[int] = field(default_factory=list)       # per fleet turn (replies)
    bytes_in: list[int] = field(default_factory=list)        # per fleet turn (requests)
    keys: int = 0
    redis_memory: int = 0
    code: str = "this"                # or "baseline": another checkout's RedisState (--baseline)

    def summary(self) -> dict[str, float | int | str]:
        """Medians per turn; shares of a core and rates from means (heartbeat turns cost more)."""
        turns_per_second = 1 / self.interval
        redis_cpu = statistics.fmean(self.redis_cpu_ms)
        return {
            "code": self.code,
            "gateways": self.gateways, "pods": self.pods, "models": self.models, "rate": self.rate,
            "inflight": self.inflight, "interval_s": self.interval, "turns": self.turns,
            "sync_cpu_ms_median": round(statistics.median(self.cpu_ms), 2),
            "sync_cpu_ms_p99": round(_quantile(self.cpu_ms, 0.99), 2),
            "sync_cpu_ms_mean": round(statistics.fmean(self.cpu_ms), 2),
            "sync_core_share": round(statistics.fmean(self.cpu_ms) / 1000 * turns_per_second, 3),
            "turn_latency_ms_median": round(statistics.median(self.latency_ms), 2),
            "turn_latency_ms_max": round(max(self.latency_ms), 2),
            "timeouts": self.timeouts, "failures": self.failures, "wrong_views": self.wrong,
            "wrong_token_counts": self.wrong_tokens, "wrong_speed_sums": self.wrong_speed,
            "speed_sums_checked": self.speed_checked, "collector": self.collector,
            "age_ms_median": round(statistics.median(self.age_ms), 1) if self.age_ms else -1,
            "age_ms_max": round(max(self.age_ms), 1) if self.age_ms else -1,
            "redis_cpu_ms_per_fleet_turn": round(redis_cpu, 2),
            "redis_cores": round(redis_cpu / 1000 * turns_per_second, 3),
            "redis_cores_per_shard": [round(statistics.fmean(shard) / 1000 * turns_per_second, 3)
                                      for shard in zip(*self.shard_cpu_ms)],
            "redis_commands_per_s": round(statistics.fmean(self.commands) * turns_per_second),
            "reply_bytes_per_s": round(statistics.fmean(self.bytes_out) * turns_per_second),
            "request_bytes_per_s": round(statistics.fmean(self.bytes_in) * turns_per_second),
            "redis_keys": self.keys, "redis_memory_bytes": self.redis_memory,
        }


class Fleet:
    """G gateways' own counts on P pods, moved at the stated rate, and what each gateway last wrote:
    the truth every view is held against."""

    def __init__(self, states: list[RedisState], pods: list[Pod], inflight: int, seed: int,
                 speed: bool, clock: Callable[[], float] = time.time) -> None:
        self.states = states
        self.clock = clock
        self.estimators = [SpeedEstimator() for _ in states]  # each gateway's own speed evidence
        self.pods = pods
        self.rng = random.Random(seed)
        self.held: list[list[int]] = [[0] * len(pods) for _ in states]   # gateway -> pod -> requests
        self.written: list[list[int]] = [[0] * len(pods) for _ in states]
        self.total = [0] * len(pods)                                      # sum of `written`
        self.credited = [0] * len(pods)  # output tokens completed on each pod, fleet-wide
        for state in states:
            state.track(pods)
        for p in range(len(pods)):
            for _ in range(inflight):
                self._start(p)
        self.speed = speed
        for g, state in enumerate(states):  # each gateway's speed evidence on the pods it routed to
            for p in range(len(pods)):
                if self.held[g][p]:
                    self._measured(g, p)

    def _measured(self, g: int, p: int) -> None:
        """A record reached gateway g: its evidence on the pod changes, as accounting's export does."""
        if self.speed:
            key, now, rng, estimator = self.pods[p].key, self.clock(), self.rng, self.estimators[g]
            estimator.observe(key, 0.02 * (1 + 0.05 * rng.random()), rng.uniform(1, 32), 199, now)
            estimator.observe_prefill(key, 0.05 * rng.random(), rng.uniform(100, 2000), 200, now)
            self.states[g].share_speed(key, estimator.export(key))  # type: ignore[arg-type]

    def _start(self, p: int) -> None:
        g = self.rng.randrange(len(self.states))
        self.held[g][p] += 1
        self.states[g].add_running(self.pods[p], 1)

    def step(self, completions: float) -> None:
        """`completions` requests end fleet-wide (a fraction is carried as a probability), each at the
        gateway that routed it, and as many start at random gateways."""
        whole = int(completions)
        whole += self.rng.random() < completions - whole
        for _ in range(whole):
            p = self.rng.randrange(len(self.pods))
            weights = [column[p] for column in self.held]
            if any(weights):
                g = self.rng.choices(range(len(weights)), weights=weights)[0]
                self.held[g][p] -= 1
                self.states[g].add_running(self.pods[p], -1)
                self.states[g].add_tokens(self.pods[p], TOKENS_PER_REQUEST)
                self.credited[p] += TOKENS_PER_REQUEST
                self._measured(g, p)
            self._start(p)

    def wrote(self, g: int) -> None:
        """Gateway g's sync succeeded: Redis now holds its counts of this moment."""
        old, new = self.written[g], self.held[g][:]
        self.total = [t - a + b for t, a, b in zip(self.total, old, new)]
        self.written[g] = new

    def wrong_views(self, g: int) -> int:
        """Pods where gateway g's view of the others differs from what they last wrote."""
        state, mine = self.states[g], self.written[g]
        return sum(state.running(pod.key) - state.local_running(pod.key) != self.total[p] - mine[p]
                   for p, pod in enumerate(self.pods))


def wrong_speed_sums(states: list[RedisState], pods: list[Pod]) -> tuple[int, int]:
    """(views that missed, views checked): each gateway's view of each pod's others' speed sums held
    against the sum, worked out here in Python, of every other gateway's share as its ledger holds it
    (what it last wrote), each decayed to the latest time; within 1e-6 relative (Redis sums in a
    different order). Call it when no share was written since the gateways' last read of the sums."""
    import numpy as np

    written = [state.core._written_speed for state in states]  # noqa: SLF001 (what each ledger holds)
    wrong = checked = 0
    for pod in pods:
        key = pod.key
        total = None
        for shares in written:
            total = speed_sums.move(total, None, shares.get(key))
        for g, state in enumerate(states):
            truth = speed_sums.others(total, written[g].get(key)) if total is not None else None
            view = state.peer_speed().get(key)
            checked += 1
            if truth is None or view is None:
                wrong += (truth is None) != (view is None)
            else:
                # A sum rounding left at 0 on one side and not the other: tiny against the vector.
                atol = 1e-9 * max(1.0, float(np.abs(truth).max()))
                wrong += len(view) != 1 or not np.allclose(view[0], truth, rtol=1e-6, atol=atol)
    return wrong, checked


class _PeerSums(LocalState):
    """A gateway's shared state as the speed sharing sees it after a read: the others' sums, one vector
    per pod (what RedisState's read gives), and this gateway's own evidence kept for the next write."""

    __slots__ = ("peers", "written")

    def __init__(self, peers: dict) -> None:
        super().__init__()
        self.peers, self.written = peers, 0

    def peer_speed(self) -> dict:
        return self.peers

    def share_speed(self, key, evidence) -> None:  # noqa: ANN001
        self.written += 1


def speed_sharing(pods: int, models: int, gateways: int = 50, rate: float = 10.0, seconds: int = 6,
                  seed: int = 1) -> dict[str, float]:
    """What one gateway spends once a second because speed evidence is shared, beside `sync_once`:
    `Accounting._share_speed` (export, shift and hand over its evidence, fold in the others') and the
    merge of the others' sums in `SpeedEstimator.refresh` (its refresh less a twin's that has no
    peers). CPU ms per second, the mean over `seconds` of the fleet's life: each second the gateway's
    records reach rate/gateways of each pod (its evidence on those moves), and every other second a
    new read of the others' sums arrives (RedisState reads them every other heartbeat)."""
    # The work itself, without the collector: when it runs, and what it then walks, depend on the whole
    # heap (here, the sync run's leftovers), which would land on whichever step happened to allocate.
    gc.collect()
    gc.disable()
    try:
        return _speed_sharing(pods, models, gateways, rate, seconds, seed)
    finally:
        gc.enable()


def _speed_sharing(pods: int, models: int, gateways: int, rate: float, seconds: int,
                   seed: int) -> dict[str, float]:
    import numpy as np

    from extproc.state.accounting import Accounting

    rng, now = random.Random(seed), time.time()
    fleet = make_pods(pods, models)
    own, others, twin = SpeedEstimator(), SpeedEstimator(), SpeedEstimator()

    def measure(estimators: tuple[SpeedEstimator, ...], share: float) -> None:
        for pod in fleet:
            if rng.random() < share:
                tpot, batch = 0.02 * (1 + 0.05 * rng.random()), rng.uniform(1, 32)
                ttft, prompt = 0.05 * rng.random(), rng.uniform(100, 2000)
                for estimator in estimators:
                    estimator.observe(pod.key, tpot, batch, 199, now)
                    estimator.observe_prefill(pod.key, ttft, prompt, 200, now)

    measure((own, twin), 1.0)
    measure((others,), 1.0)
    shared = _PeerSums({})
    accounting = Accounting(shared, speed=own, wall=lambda: now)
    accounting._tracked = fleet  # noqa: SLF001 (what its refresh loop tracks)
    share_ms = merged_ms = alone_ms = 0.0
    for second in range(seconds):
        now += 1.0
        measure((own, twin), min(1.0, rate / gateways))
        if second % 2 == 0:  # a new read of the others' sums
            measure((others,), min(1.0, rate * (gateways - 1) / gateways))
            # As RedisState's read hands them: one array, a row per pod (a --baseline checkout from
            # before the array: a list per pod)
            if hasattr(speed_sums, "PeerSums"):
                shared.peers = speed_sums.PeerSums({pod.key: row for row, pod in enumerate(fleet)},
                                                   np.array([others.export(pod.key) for pod in fleet]))
            else:
                shared.peers = {pod.key: [others.export(pod.key)] for pod in fleet}
        c0 = time.process_time()
        accounting._share_speed(now)  # noqa: SLF001 (the refresh loop's own step, timed)
        c1 = time.process_time()
        own.refresh(fleet, now)
        c2 = time.process_time()
        twin.refresh(fleet, now)
        c3 = time.process_time()
        share_ms += (c1 - c0) * 1000
        merged_ms += (c2 - c1) * 1000
        alone_ms += (c3 - c2) * 1000
    share, merge = share_ms / seconds, max(0.0, merged_ms - alone_ms) / seconds
    return {"share_ms": round(share, 1), "peer_merge_ms": round(merge, 1),
            "refresh_alone_ms": round(alone_ms / seconds, 1),
            "speed_core_share": round((share + merge) / 1000, 3)}


def _one(target: RedisTarget, options: dict, side_by_side: Callable[..., dict] | None,
         progress) -> dict:  # noqa: ANN001
    """One size's run: the gateways one after another in this process, or side by side (`side_by_side`,
    perf/sync_procs.py's `run_processes`: a process each)."""
    if side_by_side is not None:
        return side_by_side(target, progress=progress, **options)
    return asyncio.run(run_one(target, progress=progress, **options)).summary()


def _options(sizes: list[tuple[int, int]], models: int, rate: float, inflight: int, interval: float,
             turns: int, speed: bool, collector: str) -> list[dict]:
    return [{"gateways": gateways, "pods": pods, "models": models, "rate": rate, "inflight": inflight,
             "interval": interval, "turns": turns, "speed": speed, "collector": collector}
            for gateways, pods in sizes]


def with_speed_sharing(summary: dict, options: dict) -> dict:
    """The run's summary with the other half of sharing's cost (`speed_sharing`, once a second per
    gateway) and the whole: the sync's share of a core plus it."""
    if not options["speed"]:
        return summary
    sharing = speed_sharing(options["pods"], options["models"], options["gateways"], options["rate"])
    return summary | sharing | {"whole_core_share": round(summary["sync_core_share"]
                                                          + sharing["speed_core_share"], 3)}


def start_redis(log_dir: Path) -> tuple[Proc, int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = Proc(f"redis-{port}", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--dir", str(log_dir)], log_dir)
    proc.wait_ready(lambda: _pong(port), timeout=15)
    return proc, port


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _shards(target: RedisTarget) -> list[redis.Redis]:
    """A client per Redis that holds keys: the server, or each master of a cluster."""
    if not target.cluster:
        return [redis.Redis.from_url(target.url)]
    host, port = target.nodes[0]
    seed = redis.Redis(host=host, port=port)
    try:
        nodes = seed.execute_command("CLUSTER NODES")  # address -> {"flags": ...}, as redis-py parses it
    finally:
        seed.close()
    masters = [address.split("@")[0] for address, node in nodes.items()
               if "master" in node["flags"] and "fail" not in node["flags"]]
    return [redis.Redis(host=address.rsplit(":", 1)[0], port=int(address.rsplit(":", 1)[1]))
            for address in sorted(masters)]


def _redis_counters(client: redis.Redis) -> tuple[float, int, int, int]:
    info = client.info()
    return (float(info["used_cpu_sys"]) + float(info["used_cpu_user"]), int(info["total_commands_processed"]),
            int(info["total_net_output_bytes"]), int(info["total_net_input_bytes"]))


def make_pods(count: int, models: int) -> list[Pod]:
    return [Pod(model=f"model-{i % models}", name=f"pod-{i}",
                address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000") for i in range(count)]


async def run_one(url: str | RedisTarget, gateways: int, pods: int, *, models: int = 1, rate: float = 10.0,
                  inflight: int = 32, interval: float = 0.1, turns: int = 30, warmup: int = 5,
                  seed: int = 1, speed: bool = True, collector: str = "on", progress=None) -> SyncRun:
    logging.getLogger("extproc.state").setLevel(logging.WARNING)  # one "reachable" line per gateway
    target = url if isinstance(url, RedisTarget) else RedisTarget(url)
    admins = _shards(target)  # Redis's own figures: summed over a cluster's masters
    for admin in admins:
        admin.flushall()
    # The gateways' clock is the fleet's virtual one (turn x interval), so heartbeats (and the reads that
    # come with them) fall once every 1/interval turns as they would, however long a fleet turn takes
    # here; liveness is long enough that a slow fleet turn never makes a gateway look dead.
    # Whole cycles of the speed read (the costliest turns), so a run samples them at their share
    cycle = max(1, round(1.0 / interval)) * SPEED_READ_HEARTBEATS  # the gateways' heartbeat: 1 s
    turns = -(-turns // cycle) * cycle
    now = [time.time()]
    states = [RedisState(target, f"bench-gw-{g}", sync_interval=interval, gateway_ttl=3600.0,
                         clock=lambda: now[0]) for g in range(gateways)]
    fleet = Fleet(states, make_pods(pods, models), inflight, seed, speed, clock=lambda: now[0])
    run = SyncRun(gateways, pods, models, rate, inflight, interval, turns)
    written: list[float] = [0.0] * gateways  # when each gateway last wrote
    # Each gateway's token deltas as capacity would take them, summed: at the end, once every gateway
    # wrote and read again, each must have counted every token the fleet completed, once.
    counted: list[dict] = [{} for _ in states]

    def take_tokens(g: int) -> None:
        for key, delta in states[g].take_token_deltas().items():
            counted[g][key] = counted[g].get(key, 0) + delta

    try:
        for g, state in enumerate(states):  # a first read before any token: every baseline is 0
            await _first_sync(state)
            fleet.wrote(g)
        for turn in range(warmup + turns):
            if turn == warmup and collector == "frozen":
                # What one gateway's collector would walk, roughly: the G gateways' and the fleet's heap
                # as of the warm-up leaves the collections, so a turn pays for what it allocates, not
                # for walking the other gateways' state (an upper bound on this machine otherwise).
                gc.collect()
                gc.freeze()
            now[0] += interval
            fleet.step(rate * pods * interval)
            measured = turn >= warmup
            before = [_redis_counters(admin) for admin in admins]
            for g, state in enumerate(states):
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    await state.sync_once()
                except TimeoutError:
                    run.timeouts += measured
                    _failed(state, TimeoutError("op_timeout"))
                    continue
                except Exception as exc:
                    run.failures += measured
                    _failed(state, exc)
                    continue
                c1, t1 = time.process_time(), time.perf_counter()
                written[g] = t1
                take_tokens(g)
                if not measured:
                    fleet.wrote(g)
                    continue
                run.cpu_ms.append((c1 - c0) * 1000)
                run.latency_ms.append((t1 - t0) * 1000)
                # The view was read in this sync, before this gateway's own write of this moment
                # counted: held against the others' last writes.
                run.wrong += fleet.wrong_views(g)
                fleet.wrote(g)
                contributors = [written[o] for o in range(gateways) if o != g]
                if contributors:
                    run.age_ms.append((t1 - min(contributors)) * 1000)
            if measured:
                after = [_redis_counters(admin) for admin in admins]
                cpu = [(a[0] - b[0]) * 1000 for a, b in zip(after, before)]
                run.redis_cpu_ms.append(sum(cpu))
                run.shard_cpu_ms.append(cpu)
                run.commands.append(sum(a[1] - b[1] - 1 for a, b in zip(after, before)))  # less our INFO
                run.bytes_out.append(sum(a[2] - b[2] for a, b in zip(after, before)))
                run.bytes_in.append(sum(a[3] - b[3] for a, b in zip(after, before)))
            if progress and turn % 10 == 0:
                progress(f"  G={gateways} P={pods}: turn {turn + 1}/{warmup + turns}")
        # All write, then all read what the others wrote (totals: on heartbeats). The speed shares: a
        # whole cycle of writes (a pod's share goes on its turn among the heartbeats), then a read.
        closing = SPEED_WRITE_HEARTBEATS + SPEED_READ_HEARTBEATS + 1 if speed else 2
        for _ in range(closing):
            now[0] += 1.0
            for g, state in enumerate(states):
                await state.sync_once()
                take_tokens(g)
        run.wrong_tokens = sum(counted[g].get(pod.key, 0) != fleet.credited[p]
                               for g in range(gateways) for p, pod in enumerate(fleet.pods))
        if speed and hasattr(states[0].core, "_written_speed"):  # a --baseline checkout may predate it
            run.wrong_speed, run.speed_checked = wrong_speed_sums(states, fleet.pods)
        run.keys = sum(int(admin.dbsize()) for admin in admins)
        run.redis_memory = sum(int(admin.info("memory")["used_memory"]) for admin in admins)
    finally:
        if collector == "frozen":
            gc.unfreeze()
        for state in states:
            await state.close()
        for admin in admins:
            admin.close()
    run.collector = collector
    return run


# The --baseline child: that checkout's `extproc` first on the path, this bench loaded from its file.
_CHILD = """
import asyncio, importlib.util, json, sys
base, bench, url, options = sys.argv[1:5]
sys.path.insert(0, base)
spec = importlib.util.spec_from_file_location("bench_sync", bench)
module = sys.modules["bench_sync"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
options = json.loads(options)
run = asyncio.run(module.run_one(url, **options))
run.code = "baseline"
print(json.dumps(module.with_speed_sharing(run.summary(), options)))
"""


def run(sizes: list[tuple[int, int]], *, models: int, rate: float, inflight: int, interval: float,
        turns: int, speed: bool = True, collector: str = "on", baseline: Path | None = None,
        cluster: list[str] | None = None, side_by_side: Callable[..., dict] | None = None,
        progress=print) -> list[dict]:
    """Each size with this checkout's RedisState, after the --baseline checkout's when given, one
    after the other against the same redis-server (or the Redis Cluster whose seed nodes are given:
    it is flushed)."""
    if cluster:
        from extproc import redis_connect

        target = redis_connect.target(None, "cluster", cluster, where="--redis-cluster")
        out = []
        for options in _options(sizes, models, rate, inflight, interval, turns, speed, collector):
            out.append(with_speed_sharing(_one(target, options, side_by_side, progress), options))
            progress(format_row(out[-1]))
        return out
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        proc, port = start_redis(Path(tmp))
        url = f"redis://127.0.0.1:{port}/0"
        try:
            out: list[dict] = []
            for options in _options(sizes, models, rate, inflight, interval, turns, speed, collector):
                if baseline is not None:
                    child = subprocess.run([sys.executable, "-c", _CHILD, str(baseline.resolve()), __file__,
                                            url, json.dumps(options)], cwd=baseline, capture_output=True,
                                           text=True)
                    if child.returncode:
                        raise RuntimeError(f"the baseline's run failed:\n{child.stderr[-3000:]}")
                    out.append(json.loads(child.stdout.strip().splitlines()[-1]))
                    progress(format_row(out[-1]))
                one = _one(RedisTarget(url), options, side_by_side, progress)
                out.append(with_speed_sharing(one, options))
                progress(format_row(out[-1]))
            return out
        finally:
            proc.stop()
            wait_until(lambda: not _pong(port), 5, "redis stopped")


HEADER = ("code", "G", "P", "sync CPU ms/turn (med, p99)", "core (mean)", "latency ms (med, max)", "timeouts",
          "wrong (views, token counts, speed sums)", "age ms (med, max)", "Redis ms/fleet turn",
          "Redis cores", "cmds/s", "reply MB/s",
          "speed sharing ms/s (share + peer merge)", "whole core")


def format_row(s: dict[str, float | int]) -> str:
    return " | ".join(str(x) for x in (
        s["code"], s["gateways"], s["pods"], f"{s['sync_cpu_ms_median']}, {s['sync_cpu_ms_p99']}",
        s["sync_core_share"],
        f"{s['turn_latency_ms_median']}, {s['turn_latency_ms_max']}", s["timeouts"],
        f"{s['wrong_views']}, {s.get('wrong_token_counts', '-')}, {s.get('wrong_speed_sums', '-')}",
        f"{s['age_ms_median']}, {s['age_ms_max']}", s["redis_cpu_ms_per_fleet_turn"],
        s["redis_cores"] if len(s.get("redis_cores_per_shard", ())) < 2
        else f"{s['redis_cores']} ({' + '.join(map(str, s['redis_cores_per_shard']))})",
        s["redis_commands_per_s"], round(int(s["reply_bytes_per_s"]) / 1e6, 2),
        f"{s['share_ms']} + {s['peer_merge_ms']}" if "share_ms" in s else "-",
        s.get("whole_core_share", "-")))


async def _first_sync(state: RedisState, attempts: int = 5) -> None:
    """A gateway's first turn writes every pod: on a loaded machine it can miss the 0.5 s timeout, and
    a gateway would simply try again."""
    for attempt in range(attempts):
        try:
            await state.sync_once()
            return
        except (TimeoutError, redis.exceptions.TimeoutError) as exc:  # ours, or the socket's
            if attempt == attempts - 1:
                raise
            _failed(state, exc)


def _failed(state: RedisState, exc: BaseException) -> None:
    # `turn_failed` is new with issue 34; a --baseline checkout has only the private name.
    (getattr(state, "turn_failed", None) or state._on_failure)(exc)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
