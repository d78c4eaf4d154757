"""RedisState: the shared state kept in step with Redis by one background loop.

The request path only touches in-memory counts (`LocalCounts`, `SyncCore`). Every `sync_interval`
`run()` sends one pipeline — this gateway's changed values (one script per model that changed), the
heartbeat, then one read of each tracked model's totals — and turns the replies into the snapshot
routing reads. Any failure (refused, timed out, auth, a restart) makes the gateway use its local
counts until a tick succeeds again, counted in `extproc_redis_sync_failures_total` and logged once
per outage; nothing here ever raises into a caller or waits on the request path.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.client import NEVER_DECODE
from redis.exceptions import NoScriptError

from extproc import redis_connect
from extproc.cancellation import raise_if_cancelled
from extproc.pool.pod import Pod, PodKey
from extproc.redis_connect import RedisTarget
from extproc.sharing import redis_scripts
from extproc.sharing.packed_totals import SlotMap, as_bytes
from extproc.sharing.shared import LocalCounts
from extproc.sharing.sync_core import (
    AIBRIX_POD_PATTERN,
    AIBRIX_POD_PREFIX,
    AIBRIX_SNAPSHOT_TTL_MS,
    EXTPROC_MARK,
    FORWARD_PREFIX,
    FORWARD_TTL_SECONDS,
    GATEWAY_RETENTION_SECONDS,
    GATEWAYS_KEY,
    KEY_TTL_SECONDS,
    MAX_RECEIVE,
    SharedSnapshot,
    SyncCore,
    SyncedState,
    WriteBatch,
    aibrix_pod_key,
    ledger_key,
    members_key,
    names_key,
    packed_key,
    parse_int,
    pod_id,
    running_key,
    slots_key,
    speed_key,
    tokens_key,
)

log = logging.getLogger(__name__)
# Redis back, sharing resumes within this (plus jitter and a tick): gateways converge within 2 s.
MAX_BACKOFF_SECONDS = 1.0
SCAN_COUNT = 500


def default_instance() -> str:
    """Without POD_NAME (Config.redis_instance), AIBrix names a gateway instance by its hostname."""
    return socket.gethostname() or "unknown-gateway"


class RedisState(SyncedState):
    def __init__(self, url: str | RedisTarget, instance: str | None = None, *, sync_interval: float = 0.1,
                 heartbeat_interval: float = 1.0, gateway_ttl: float = 3.0, op_timeout: float = 0.5,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.time,
                 aibrix_snapshots: bool = False) -> None:
        self.target = url if isinstance(url, RedisTarget) else RedisTarget(url)
        self.url = self.target.url
        self.instance = instance or default_instance()
        # "<instance>:<start ns>": a restarted gateway is a new field, never a continuation of its
        # predecessor's counts. Taken per object, so two states in one process stay distinct.
        self.field = f"{self.instance}:{time.time_ns()}"
        self.sync_interval = sync_interval
        self.heartbeat_interval = heartbeat_interval
        self.op_timeout = op_timeout
        self.clock = clock
        self.counts = LocalCounts()
        self.core = SyncCore(self.field, self.counts, gateway_ttl=gateway_ttl,
                             heartbeat_interval=heartbeat_interval, aibrix_snapshots=aibrix_snapshots)
        self._gauge = Gauge("extproc_redis_up", "1 while in-flight counts and tokens are shared "
                            "through Redis", registry=registry)
        self._gauge.set(0)
        self._failed_turns = Counter("extproc_redis_sync_failures", "Redis sync turns that failed "
                                     "(reason: timeout = no answer within redis.timeout_seconds); the "
                                     "gateway routes on its own counts until a turn succeeds",
                                     ["reason"], registry=registry)
        self._last_turn = Gauge("extproc_redis_sync_seconds", "Wall time of the last successful Redis "
                                "sync turn", registry=registry)
        self._client: aioredis.Redis | None = None
        self._scripts_loaded = False
        self._model_pods: dict[str, dict[str, PodKey]] = {}
        self._where: dict[PodKey, tuple[str, bytes]] = {}  # tracked pod -> its model and "ns/pod"
        self._layout = -1
        self._slot_maps: dict[str, SlotMap] = {}  # per tracked model: where its pods are packed
        self._offset = 0.0               # Redis server clock minus ours, for skew-free heartbeats
        self._aibrix_keys: list[str] = []
        self._last_scan: float | None = None
        self._failures = 0
        self._reported_down = False      # a failure was logged; the next success logs recovery
        self._ever_up = False
        self._lock = asyncio.Lock()
        self._closed = False
        self._closing: set[asyncio.Task[None]] = set()


    # -- the loop ------------------------------------------------------------------------------------

    def turn_failed(self, exc: BaseException) -> None:
        """A turn driven from outside `run()` (the sync bench) failed: as `run()` handles it."""
        self._on_failure(exc)

    async def run(self) -> None:
        """Sync every `sync_interval` while Redis answers; back off (up to 1 s) while it does not."""
        log.info("sharing state through Redis at %s as %s", self.target.describe(), self.field)
        loop = asyncio.get_running_loop()
        while not self._closed:
            started = loop.time()
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never out of the loop: Redis is an optimisation
                self._on_failure(exc)
            if self.core.up:
                pause = self.sync_interval - (loop.time() - started)
            else:
                pause = retry_pause(self._failures, self.sync_interval, random.uniform(0.8, 1.2))
            raise_if_cancelled()  # redis-py's wait_for can swallow a cancel (extproc/cancellation.py)
            await asyncio.sleep(max(0.0, pause))

    async def sync_once(self) -> None:
        """One tick: push, heartbeat, read. Raises on any failure (run() handles it)."""
        async with self._lock:
            if self._closed:
                return
            client = self._connect()
            now = self.clock()
            batch = self.core.plan(now)
            try:
                await self._sync(client, batch, now)
            except BaseException:
                self.core.unsent(batch)
                raise

    async def _sync(self, client: aioredis.Redis, batch: WriteBatch, now: float) -> None:
        if not self._scripts_loaded:  # a new connection: Redis may have restarted without them
            async with asyncio.timeout(self.op_timeout):
                await client.script_load(redis_scripts.WRITE)
                await client.script_load(redis_scripts.REAP)
                await client.script_load(redis_scripts.SPEED)
                await client.script_load(redis_scripts.CLOCK)
                await client.script_load(redis_scripts.READ)
            self._scripts_loaded = True
        if self.core.aibrix_snapshots and (self._last_scan is None
                                           or now - self._last_scan >= self.heartbeat_interval):
            async with asyncio.timeout(self.op_timeout):
                self._aibrix_keys = await self._scan_aibrix(client)
            self._last_scan = now
        models = self._models()
        aibrix_keys = self._aibrix_keys
        pipe = redis_connect.pipeline(client)
        writes, scripts = self._queue_writes(pipe, batch, now + self._offset, models)
        if self.target.cluster:  # a cluster pipeline refuses TIME: the clock of the heartbeat set's shard
            pipe.evalsha(redis_scripts.CLOCK_SHA, 1, GATEWAYS_KEY)
        else:
            pipe.time()
        pipe.zrange(GATEWAYS_KEY, 0, -1, withscores=True)
        inbox = self.core.inbox
        if inbox is not None:
            pipe.lpop(FORWARD_PREFIX + inbox, MAX_RECEIVE)
        slot_maps = self._slot_maps
        for model in models:
            slot_map = slot_maps[model]
            pipe.evalsha(redis_scripts.READ_SHA, 2, packed_key(model), names_key(model), slot_map.epoch,
                         slot_map.known())
            if batch.read_tokens:  # with the members: once a heartbeat, and after a failure
                pipe.hgetall(tokens_key(model))
                pipe.smembers(members_key(model))
        if batch.read_speed:  # binary: taken as sent (a text decode and re-encode cost 10 ms at 5,000 pods)
            for model in models:
                pipe.execute_command("HGETALL", speed_key(model), **{NEVER_DECODE: True})
        for key in aibrix_keys:
            pipe.hgetall(key)
        sent = self.clock()
        started = time.perf_counter()
        async with asyncio.timeout(self.op_timeout):
            replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, NoScriptError):
                self._scripts_loaded = False  # flushed: loaded again with the next turn
            if isinstance(reply, Exception):
                raise reply
        done = self.clock()
        self._last_turn.set(time.perf_counter() - started)
        self.core.confirm(batch, now)
        if any(replies[i] == 1 for i in scripts):
            self.core.lost_ledger(batch)
        reads = iter(replies[writes:])
        seconds, micros = map(int, next(reads))
        self._offset = seconds + micros / 1e6 - (sent + done) / 2
        snap = SharedSnapshot(server_now=seconds + micros / 1e6, gateways=dict(next(reads)), running={},
                              tokens={} if batch.read_tokens else None,
                              members={} if batch.read_tokens else None, packed={})
        if inbox is not None:
            self.core.receive(next(reads) or ())
        for model, pods in models.items():
            packed, start, names = next(reads)
            slot_map = slot_maps[model]
            slot_map.extend(start, names)
            if packed is not None:
                aligned = slot_map.aligned(as_bytes(packed))
                if aligned is None:
                    slot_map.reset()  # not of the names' epoch (never from one script): afresh next turn
                else:
                    snap.packed[model] = aligned
            if snap.tokens is not None and snap.members is not None:
                _add_totals(snap.tokens, pods, next(reads))
                snap.members[model] = next(reads)
        if batch.read_speed:
            snap.speed = {}
            for pods in models.values():
                sums = next(reads)
                names = [pid.decode("utf-8", "surrogateescape") for pid in sums]
                snap.speed.update(zip(map(pods.get, names), sums.values()))
            snap.speed.pop(None, None)  # type: ignore[call-overload]  (pods not tracked here)
        for fields in reads:
            if fields and EXTPROC_MARK not in fields:
                n = parse_int(fields.get("requests_running"))
                if n and n > 0:
                    pid = f"{fields.get('namespace', '')}/{fields.get('pod_name', '')}"
                    snap.aibrix[pid] = snap.aibrix.get(pid, 0) + n
        self.core.apply(snap)
        self._on_success()

    def _models(self) -> dict[str, dict[str, PodKey]]:
        """Per tracked model: "ns/pod" -> key of its tracked pods, as its totals name them (rebuilt
        only when the pods change)."""
        if self._layout != self.counts.layout:
            models: dict[str, dict[str, PodKey]] = {}
            for key, pod in self.counts.pods.items():
                models.setdefault(pod.model, {})[pod_id(pod)] = key
            self._model_pods, self._layout = models, self.counts.layout
            self._where = {key: (model, pid.encode("utf-8", "surrogateescape"))
                           for model, pods in models.items() for pid, key in pods.items()}
            maps = {model: self._slot_maps.get(model) or SlotMap() for model in models}
            for model, slot_map in maps.items():
                slot_map.track(models[model])
            self._slot_maps = maps
        return self._model_pods

    def _queue_writes(self, pipe: Any, batch: WriteBatch, server_now: float,
                      models: dict[str, dict[str, PodKey]]) -> tuple[int, list[int]]:
        """Queue the batch; returns how many replies it adds and which of them are write scripts."""
        queued = 0
        scripts: list[int] = []
        core = self.core
        if batch.heartbeat:
            pipe.zadd(GATEWAYS_KEY, {self.field: server_now})
            pipe.zremrangebyscore(GATEWAYS_KEY, "-inf", server_now - GATEWAY_RETENTION_SECONDS)
            queued += 2
        changed: dict[str, tuple[list[bytes], list[bytes]]] = {}
        where = self._where
        for table, side in ((batch.running, 0), (batch.tokens, 1)):
            for key, n in table.items():
                at = where.get(key)
                if at is None:  # forgotten, its last zero still to write
                    pod = core.pod(key)
                    at = (pod.model, pod_id(pod).encode("utf-8", "surrogateescape"))
                model, pid = at
                # bytes as sent: the client's encoder passes them through (a str costs it an encode)
                changed.setdefault(model, ([], []))[side].extend((pid, b"%d" % n))
        if batch.heartbeat:  # every tracked model's ledger: its expiry refreshed, its loss noticed
            for model in models:
                changed.setdefault(model, ([], []))
        for model, (running, tokens) in changed.items():
            pipe.evalsha(redis_scripts.WRITE_SHA, 8, *write_keys(model, self.field),
                         KEY_TTL_SECONDS, self.field, len(running) // 2, *running, *tokens)
            scripts.append(queued)
            queued += 1
        for model, gateway in batch.reap:
            pipe.evalsha(redis_scripts.REAP_SHA, 7, *reap_keys(model, gateway), gateway)
            queued += 1
        speed: dict[str, dict[bytes, bytes]] = {}
        for key, raw in batch.speed.items():
            at = where.get(key)
            if at is None:
                pod = core.pod(key)
                at = (pod.model, pod_id(pod).encode("utf-8", "surrogateescape"))
            speed.setdefault(at[0], {})[at[1]] = raw
        for model, vectors in speed.items():  # after the model's WRITE, which makes the ledger
            pipe.evalsha(redis_scripts.SPEED_SHA, 2, speed_key(model), ledger_key(model, self.field),
                         KEY_TTL_SECONDS, *(x for pair in vectors.items() for x in pair))
            queued += 1
        for key, n in batch.aibrix.items():
            pod = core.pod(key)
            name = aibrix_pod_key(self.field, pod)
            if n > 0:
                pipe.hset(name, mapping=self._aibrix_row(pod, n))
                pipe.pexpire(name, AIBRIX_SNAPSHOT_TTL_MS)
                queued += 2
            else:
                pipe.delete(name)
                queued += 1
        for owner, entries in batch.forwards.items():
            name = FORWARD_PREFIX + owner
            pipe.rpush(name, *entries)
            pipe.expire(name, FORWARD_TTL_SECONDS)
            queued += 2
        return queued, scripts

    def _aibrix_row(self, pod: Pod, running: int) -> dict[str, str]:
        """The fields AIBrix's appendGatewayPodSnapshotToPipeline writes, plus our marker."""
        return {
            "gateway_instance_id": self.field,
            "pod_uid": "",
            "pod_name": pod.name,
            "namespace": pod.namespace,
            "node_name": "",
            "requests_running": str(running),
            "seq": str(self.counts.completed.get(pod.key, 0)),
            "update_time": datetime.now().strftime("%H:%M:%S.%f")[:-3],  # Go's "15:04:05.000"
            EXTPROC_MARK: self.field,
        }

    async def _scan_aibrix(self, client: aioredis.Redis) -> list[str]:
        """AIBrix gateways' rows; rows our own gateways wrote (their name is in our heartbeat set)
        are never read: the totals already hold them."""
        ours = set(await client.zrange(GATEWAYS_KEY, 0, -1))
        keys: list[str] = []
        async for key in client.scan_iter(match=AIBRIX_POD_PATTERN, count=SCAN_COUNT):
            writer = ":".join(key[len(AIBRIX_POD_PREFIX):].split(":", 2)[:2])  # ours: "<instance>:<ns>"
            if writer not in ours:
                keys.append(key)
        return keys

    def _connect(self) -> aioredis.Redis:
        if self._client is None:
            # No client-side retries: the loop's own backoff decides when to try again.
            # surrogateescape: the speed sums are binary (sharing/speed_sums.py), every other reply text.
            self._client = redis_connect.open_async(
                self.target, timeout=self.op_timeout, decode_responses=True,
                encoding_errors="surrogateescape", retry=Retry(NoBackoff(), 0), health_check_interval=0)
        return self._client

    def _on_success(self) -> None:
        if self._reported_down or not self._ever_up:
            log.info("Redis at %s reachable: in-flight counts and tokens shared across gateways",
                     self.target.describe())
        self._failures = 0
        self._reported_down = False
        self._ever_up = True
        self._gauge.set(1)

    def _on_failure(self, exc: BaseException) -> None:
        self.core.failed()
        for slot_map in self._slot_maps.values():  # Redis may come back from an older snapshot
            slot_map.reset()
        self._gauge.set(0)
        self._failures += 1
        self._scripts_loaded = False
        timeout = isinstance(exc, TimeoutError)
        self._failed_turns.labels("timeout" if timeout else "error").inc()
        if not self._reported_down:  # once per outage, not once per tick
            self._reported_down = True
            if timeout:
                log.warning("Redis at %s did not answer a sync turn within %gs (redis.timeout_seconds); "
                            "routing on this gateway's own counts until a turn succeeds",
                            self.target.describe(), self.op_timeout)
            else:
                log.warning("Redis at %s unreachable (%s); routing on this gateway's own counts until "
                            "it returns", self.target.describe(), self._scrub(exc))
        # A cancelled or broken connection may be mid-reply: start the next attempt afresh.
        client, self._client = self._client, None
        if client is not None:
            task = asyncio.get_running_loop().create_task(_close_quietly(client, self.op_timeout))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _scrub(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raw = urlsplit(self.url).password
        for secret in {raw, unquote(raw)} if raw else ():
            text = text.replace(secret, "***")
        return text

    async def close(self) -> None:
        """Leave the fleet: publish the last tokens, take our in-flight share out of the totals and
        our heartbeat out of the set, so others stop counting us at once rather than after the 3 s
        liveness window."""
        async with self._lock:
            self._closed = True
            client, self._client = self._client, None
            if client is None:
                return
            try:
                pipe = redis_connect.pipeline(client)
                for model, pods in self._models().items():
                    tokens = [x for pid, key in pods.items() if (t := self.counts.tokens.get(key, 0)) > 0
                              for x in (pid, str(t))]
                    pipe.eval(redis_scripts.WRITE, 8, *write_keys(model, self.field), KEY_TTL_SECONDS,
                              self.field, 0, *tokens)
                    pipe.eval(redis_scripts.REAP, 7, *reap_keys(model, self.field), self.field)
                pods = self.counts.pods
                for key in self.core.written_aibrix():
                    if key in pods:
                        pipe.delete(aibrix_pod_key(self.field, pods[key]))
                pipe.zrem(GATEWAYS_KEY, self.field)
                async with asyncio.timeout(self.op_timeout):
                    await pipe.execute()
            except Exception as exc:
                log.warning("could not withdraw from Redis at %s (%s); others drop us after %gs",
                            self.target.describe(), self._scrub(exc), self.core.gateway_ttl)
            finally:
                self.core.failed()
                self._gauge.set(0)
                await _close_quietly(client, self.op_timeout)


def retry_pause(failures: int, sync_interval: float, jitter: float) -> float:
    """Seconds before the next attempt while Redis does not answer: doubling from the sync interval
    up to MAX_BACKOFF_SECONDS, times a jitter near 1 (gateways restarting together do not stampede)."""
    return min(MAX_BACKOFF_SECONDS, sync_interval * 2 ** min(failures, 5)) * jitter


def write_keys(model: str, gateway: str) -> tuple[str, ...]:
    """KEYS of the WRITE script (sharing/redis_scripts.py), in its order."""
    return (running_key(model), tokens_key(model), ledger_key(model, gateway), members_key(model),
            speed_key(model), packed_key(model), slots_key(model), names_key(model))


def reap_keys(model: str, gateway: str) -> tuple[str, ...]:
    """KEYS of the REAP script, in its order."""
    return (running_key(model), ledger_key(model, gateway), members_key(model), speed_key(model),
            packed_key(model), slots_key(model), names_key(model))


def _add_totals(into: dict[PodKey, int], pods: dict[str, PodKey], fields: dict[str, str]) -> None:
    """A model's totals hash, for the pods this gateway tracks (a pod absent from it is at 0)."""
    try:  # in C: 5,000 fields one by one in Python were a sixth of a heartbeat turn
        values = list(map(int, fields.values()))
    except ValueError:
        values = None
    if values is not None:
        into.update(zip(map(pods.get, fields), values))
        into.pop(None, None)  # type: ignore[call-overload]  (fields of pods not tracked here)
        return
    for pid, value in fields.items():
        key = pods.get(pid)
        if key is not None:
            try:
                into[key] = int(value)
            except ValueError:
                pass


async def _close_quietly(client: aioredis.Redis, timeout: float) -> None:
    try:
        async with asyncio.timeout(timeout):
            await client.aclose()
    except Exception:
        pass


__all__ = ["RedisState", "default_instance", "pod_id"]
