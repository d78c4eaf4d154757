"""The pure half of Redis sharing: which writes a sync tick sends, and what a snapshot read means.

No I/O and no clock of its own, so unit tests drive it in fake time and the fleet simulation could
drive it in virtual time. `redis_sync.RedisState` does the network part.

Redis layout (the issue's; see KEYS below for how it relates to what AIBrix itself writes):

  aibrix:rrq:<namespace>/<pod>     hash, field "<instance>:<start ns>" per gateway, value the
                                   gateway's in-flight count on that pod as a decimal integer (≥ 0);
                                   expires 10 minutes after the last write
  aibrix:rrq:gateways              sorted set, member = that same field, score = last heartbeat
                                   (Unix seconds on the Redis server's clock); a field whose gateway
                                   has not beaten for > 3 s is left out of the sum
  extproc:tokens:<namespace>/<pod> ours: hash, the same per-gateway field, value = that gateway's
                                   cumulative completed output tokens on the pod since it started
  aibrix:pod:<gateway>:<ns>:<pod>  what AIBrix's gateway really writes and reads (see below)
  extproc:speed:<namespace>/<pod>  ours: hash, the same per-gateway field, value = a JSON array: the
                                   sums that gateway fits the pod's speed from (state/speed.py
                                   `export`), written and read once a heartbeat
  extproc:done:<origin>            ours: list of "<request key> <status>", requests a gateway process
                                   routed whose access-log record reached another (one Envoy's log
                                   stream goes to one replica); the router pops it and releases them
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from extproc.pool.pod import Pod, PodKey
from extproc.state.shared import LocalCounts

# Keys. AIBrix's gateway (vllm-project/aibrix, pkg/cache/cache_gateway_snapshot.go, #2159) does not
# use the aibrix:rrq layout the issue describes: every 100 ms each AIBrix gateway HSETs a hash
# aibrix:pod:<POD_NAME>:<namespace>:<pod> (fields gateway_instance_id, pod_uid, pod_name, namespace,
# node_name, requests_running, seq, update_time) with a 500 ms PEXPIRE, and sums requests_running of
# the other gateways' hashes (SCAN aibrix:pod:*). We follow the issue's layout for our own gateways,
# and additionally write and read AIBrix's snapshots so a fleet mixing both counts each other.
RUNNING_PREFIX = "aibrix:rrq:"
GATEWAYS_KEY = "aibrix:rrq:gateways"
TOKENS_PREFIX = "extproc:tokens:"
SPEED_PREFIX = "extproc:speed:"
AIBRIX_POD_PREFIX = "aibrix:pod:"
AIBRIX_POD_PATTERN = "aibrix:pod:*"
KEY_TTL_SECONDS = 600            # the 10-minute expiry of the per-pod hashes
AIBRIX_SNAPSHOT_TTL_MS = 500     # AIBrix's gatewayPodSnapshotTTL
EXTPROC_MARK = "extproc_field"   # extra field in our aibrix:pod rows: AIBrix ignores it, we skip
                                 # those rows because the aibrix:rrq hash already counts them
GATEWAY_RETENTION_SECONDS = 600  # heartbeat members this stale are removed and their fields deleted
FORWARD_PREFIX = "extproc:done:"
FORWARD_TTL_SECONDS = 60         # an inbox nobody pops (its gateway died) goes away
MAX_FORWARDS = 10_000            # unsent while Redis is down: past this, reconciliation releases them
MAX_RECEIVE = 2_000              # popped per tick


def pod_id(pod: Pod) -> str:
    return f"{pod.namespace}/{pod.name}"  # AIBrix's utils.GeneratePodKey


def running_key(pod: Pod) -> str:
    return RUNNING_PREFIX + pod_id(pod)


def tokens_key(pod: Pod) -> str:
    return TOKENS_PREFIX + pod_id(pod)


def speed_key(pod: Pod) -> str:
    return SPEED_PREFIX + pod_id(pod)


def aibrix_pod_key(gateway: str, pod: Pod) -> str:
    return f"{AIBRIX_POD_PREFIX}{gateway}:{pod.namespace}:{pod.name}"


def parse_int(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


@dataclass(slots=True)
class WriteBatch:
    """One tick's writes. Every value is absolute (HSET), so resending a batch whose reply was lost
    (a timeout after Redis applied it) changes nothing: no HINCRBY whose fate is unknown."""
    heartbeat: bool
    running: dict[PodKey, int] = field(default_factory=dict)   # own in-flight count
    tokens: dict[PodKey, int] = field(default_factory=dict)    # own cumulative tokens
    aibrix: dict[PodKey, int] = field(default_factory=dict)    # AIBrix rows: > 0 set, 0 delete
    prune: list[tuple[str, str]] = field(default_factory=list)  # (key, field) of long-dead gateways
    forwards: dict[str, list[str]] = field(default_factory=dict)  # owner -> "<key> <status>" entries
    speed: dict[PodKey, str] = field(default_factory=dict)     # own speed evidence (JSON), per heartbeat
    read_speed: bool = False                                   # read the others' with this tick
    # Every own field ever written, zeros included: Redis came back from an older snapshot (RDB), and a
    # count that went to 0 since would otherwise stay there at its old value.
    reassert: bool = False

    def __bool__(self) -> bool:
        return bool(self.heartbeat or self.running or self.tokens or self.aibrix or self.prune
                    or self.forwards or self.speed)


@dataclass(slots=True)
class Snapshot:
    server_now: float                                  # Redis's clock, Unix seconds
    gateways: dict[str, float]                         # heartbeat member -> score
    running: dict[PodKey, dict[str, int]]              # per pod: gateway field -> in-flight
    tokens: dict[PodKey, dict[str, int]]               # per pod: gateway field -> cumulative tokens
    aibrix: dict[str, int] = field(default_factory=dict)  # "ns/pod" -> AIBrix gateways' in-flight
    speed: dict[PodKey, dict[str, str]] | None = None  # per pod: gateway field -> its evidence; None: not read


class SyncCore:
    def __init__(self, me: str, counts: LocalCounts, *, gateway_ttl: float = 3.0,
                 heartbeat_interval: float = 1.0, aibrix_snapshots: bool = True) -> None:
        self.me = me
        self.counts = counts
        self.gateway_ttl = gateway_ttl
        self.heartbeat_interval = heartbeat_interval
        self.aibrix_snapshots = aibrix_snapshots
        self.up = False
        self.others: dict[PodKey, int] = {}             # live other gateways' in-flight, last snapshot
        self._written_running: dict[PodKey, int] = {}
        self._written_tokens: dict[PodKey, int] = {}
        self._written_aibrix: dict[PodKey, int] = {}
        self._seen: dict[PodKey, dict[str, int]] = {}   # other gateways' token values already counted
        self._pending: dict[PodKey, int] = {}           # shared token deltas not yet taken
        self._last_heartbeat: float | None = None
        self._full = True                               # next batch re-asserts every own value
        self._prune: list[tuple[str, str]] = []
        # Routing's echo of the other gateways between snapshots (routing_running): how many live peers
        # the last snapshot showed, and the requests this gateway started since then, per pod.
        self.peers = 0
        self._started: dict[PodKey, int] = {}
        # Access-log records of other gateways' requests, on their way to them; and ours from them.
        self.inbox: str | None = None                   # this gateway process's origin (see Gateway)
        # Speed evidence: this gateway's own to publish, and the other live gateways' as last read.
        self.speed_out: dict[PodKey, list[float]] = {}
        self.peer_speed: dict[PodKey, list[list[float]]] = {}
        self._outbox: dict[str, list[str]] = {}
        self._outbox_size = 0
        self._received: list[tuple[str, int]] = []

    # -- reads (the request path) ------------------------------------------------------------------

    def running(self, key: PodKey) -> int:
        own = self.counts.running.get(key, 0)
        return own + self.others.get(key, 0) if self.up else own

    def started(self, key: PodKey) -> None:
        if self.peers:
            self._started[key] = self._started.get(key, 0) + 1

    def routing_running(self, key: PodKey) -> int:
        """`running`, plus for every request this gateway started on the pod since the last snapshot
        one more per live peer: gateways that see the same counts make the same choices, so between
        syncs each decision here stands for one at every peer. Without it a burst herds: N gateways
        each place their next requests on the pods that looked least loaded at the last sync."""
        n = self.running(key)
        return n + self.peers * self._started.get(key, 0) if self.up and self.peers else n

    def take_token_deltas(self) -> dict[PodKey, int]:
        """Shared deltas while up. While down, also this gateway's own tokens not yet seen in a
        snapshot; those are marked taken, so the shared counter does not count them again later."""
        out, self._pending = self._pending, {}
        if not self.up:
            for key, delta in self.counts.take_local_deltas().items():
                out[key] = out.get(key, 0) + delta
        return out

    # -- the sync tick -----------------------------------------------------------------------------

    def plan(self, now: float) -> WriteBatch:
        """What to send now: changed values every tick, every value again each heartbeat (Redis may
        have restarted empty, and it refreshes the 10-minute expiry)."""
        due = self._last_heartbeat is None or now - self._last_heartbeat >= self.heartbeat_interval
        full = self._full or due
        batch = WriteBatch(heartbeat=due, reassert=self._full)
        counts = self.counts
        for key in counts.pods:
            n = counts.running.get(key, 0)
            if (n != self._written_running.get(key, 0) or (full and n > 0)
                    or (batch.reassert and key in self._written_running)):
                batch.running[key] = n
            t = counts.tokens.get(key, 0)
            if t != self._written_tokens.get(key, 0) or (full and t > 0):
                batch.tokens[key] = t
            # AIBrix rows expire in 500 ms: rewritten every tick while busy, deleted once idle.
            if self.aibrix_snapshots and (n > 0 or self._written_aibrix.get(key, 0) > 0):
                batch.aibrix[key] = n
        batch.prune = self._prune
        batch.forwards, self._outbox, self._outbox_size = self._outbox, {}, 0
        if due:  # the fit moves slowly: once a heartbeat is enough, and keeps each tick small
            batch.read_speed = True
            batch.speed = {key: json.dumps(v) for key, v in self.speed_out.items() if key in counts.pods}
        # The heartbeat goes first in any batch that writes fields, so a reader that sees our
        # field also sees us alive and never prunes it.
        batch.heartbeat = due or bool(batch.running or batch.tokens)
        return batch

    def confirm(self, batch: WriteBatch, now: float) -> None:
        self._written_running.update(batch.running)
        self._written_tokens.update(batch.tokens)
        for key, n in batch.aibrix.items():
            if n > 0:
                self._written_aibrix[key] = n
            else:
                self._written_aibrix.pop(key, None)
        if batch.heartbeat:
            self._last_heartbeat = now
        self._full = False
        if batch.prune is self._prune:
            self._prune = []

    def unsent(self, batch: WriteBatch) -> None:
        """The batch may not have reached Redis: its forwards go out again with the next one (a
        duplicate is harmless: a request is released once)."""
        for owner, entries in batch.forwards.items():
            for entry in entries:
                self._queue(owner, entry)

    # -- records forwarded between gateways ----------------------------------------------------------

    def forward(self, owner: str, key: str, status: int) -> None:
        """An access-log record of a request `owner` routed reached this gateway."""
        self._queue(owner, f"{key} {status}")

    def _queue(self, owner: str, entry: str) -> None:
        if self._outbox_size < MAX_FORWARDS:
            self._outbox.setdefault(owner, []).append(entry)
            self._outbox_size += 1

    def receive(self, entries: Iterable[str]) -> None:
        for entry in entries:
            key, _, status = entry.partition(" ")
            self._received.append((key, parse_int(status) or 0))

    def take_forwarded(self) -> list[tuple[str, int]]:
        """(request key, status) of own requests whose record another gateway received."""
        out, self._received = self._received, []
        return out

    def failed(self) -> None:
        """A tick failed: fall back to local counts until a snapshot arrives again."""
        self.up = False
        self._full = True  # Redis may come back empty (restarted): re-assert everything
        self.peer_speed = {}  # each gateway fits on its own records until Redis is back

    def apply(self, snap: Snapshot) -> None:
        """A snapshot read: other live gateways' counts, and token deltas since the last one."""
        me = self.me
        live = {g for g, beat in snap.gateways.items() if beat >= snap.server_now - self.gateway_ttl}
        known = snap.gateways.keys()
        prune: list[tuple[str, str]] = []
        others: dict[PodKey, int] = {}
        pods = self.counts.pods
        for key, fields in snap.running.items():
            total = sum(max(0, n) for g, n in fields.items() if g != me and g in live)
            pod = pods.get(key)
            if pod is not None:
                total += snap.aibrix.get(pod_id(pod), 0)
                prune.extend((running_key(pod), g) for g in fields if g != me and g not in known)
            others[key] = total
        for key, fields in snap.tokens.items():
            pod = pods.get(key)
            if pod is not None:
                prune.extend((tokens_key(pod), g) for g in fields if g != me and g not in known)
            self._count_tokens(key, fields)
        self.others = others
        if snap.speed is not None:
            self.peer_speed = {key: [v for g, raw in fields.items() if g != me and g in live
                                     if (v := _vector(raw)) is not None]
                               for key, fields in snap.speed.items()}
            for key, fields in snap.speed.items():
                pod = pods.get(key)
                if pod is not None:
                    prune.extend((speed_key(pod), g) for g in fields if g != me and g not in known)
        self._prune = prune
        self.up = True
        self.peers = len(live - {me})
        self._started = {}

    def _count_tokens(self, key: PodKey, fields: dict[str, int]) -> None:
        delta = 0
        own = fields.get(self.me)
        if own is not None:
            taken = self.counts.taken(key)
            if own > taken:  # own tokens published, not yet handed out locally
                delta += own - taken
                self.counts.mark_taken(key, own)
        seen = self._seen.get(key)
        if seen is None:
            # First read of this pod: a baseline, or we would count its whole history at once.
            self._seen[key] = {g: n for g, n in fields.items() if g != self.me}
        else:
            for g, n in fields.items():
                if g == self.me:
                    continue
                before = seen.get(g)
                if before is None:
                    delta += n  # a gateway new to this pod: all it has is new
                elif n > before:
                    delta += n - before
                # A field that vanished (Redis restarted, pruned) keeps its remembered value,
                # so its return with the same cumulative total counts nothing twice.
                seen[g] = max(n, before or 0)
        if delta:
            self._pending[key] = self._pending.get(key, 0) + delta

    def forget(self, live: list[PodKey] | set[PodKey]) -> None:
        for key in self.counts.forget(live):
            for table in (self.others, self._written_running, self._written_tokens, self._seen,
                          self._pending, self.speed_out, self.peer_speed):
                table.pop(key, None)
            # Its AIBrix row (if any) is left to its 500 ms expiry.
            self._written_aibrix.pop(key, None)

    def written_running(self) -> list[PodKey]:
        return list(self._written_running)

    def written_aibrix(self) -> list[PodKey]:
        return list(self._written_aibrix)


def _vector(raw: str) -> list[float] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, list) or not all(isinstance(x, (int, float)) for x in value):
        return None
    return [float(x) for x in value]


class SyncedState:
    """The `SharedState` face of a SyncCore over this gateway's LocalCounts: every read and write in
    memory. `RedisState` syncs it through Redis, the fleet simulation through an in-memory hub."""

    counts: LocalCounts
    core: SyncCore

    def add_running(self, pod: Pod, delta: int) -> None:
        self.counts.add_running(pod, delta)
        if delta > 0:
            self.core.started(pod.key)

    def routing_running(self, key: PodKey) -> int:
        return self.core.routing_running(key)

    @property
    def peers(self) -> int:
        return self.core.peers if self.core.up else 0

    def add_tokens(self, pod: Pod, tokens: int) -> None:
        self.counts.add_tokens(pod, tokens)

    def running(self, key: PodKey) -> int:
        return self.core.running(key)

    def local_running(self, key: PodKey) -> int:
        return self.counts.running.get(key, 0)

    def peer_changes(self) -> list[tuple[PodKey, int]]:
        return []  # other gateways' counts arrive as sums; routing_running echoes them meanwhile

    def take_token_deltas(self) -> dict[PodKey, int]:
        return self.core.take_token_deltas()

    def share_speed(self, key: PodKey, evidence: list[float]) -> None:
        self.core.speed_out[key] = evidence

    def peer_speed(self) -> dict[PodKey, list[list[float]]]:
        return self.core.peer_speed if self.core.up else {}

    def track(self, pods: Iterable[Pod]) -> None:
        self.counts.track(pods)

    def forget(self, live: Iterable[PodKey]) -> None:
        self.core.forget(set(live))

    def listen(self, origin: str) -> None:
        """Receive the records other gateways got for requests keyed `<origin>.…`."""
        self.core.inbox = origin

    def forward(self, owner: str, key: str, status: int) -> bool:
        self.core.forward(owner, key, status)
        return True

    def take_forwarded(self) -> list[tuple[str, int]]:
        return self.core.take_forwarded()

    @property
    def up(self) -> bool:
        return self.core.up
