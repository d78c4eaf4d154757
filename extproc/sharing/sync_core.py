"""The pure half of Redis sharing: which writes a sync tick sends, and what a snapshot read means.

No I/O and no clock of its own, so unit tests drive it in fake time and the fleet simulation could
drive it in virtual time. `redis_sync.RedisState` does the network part.

Redis layout. Cost follows what changed, not gateways x pods: Redis keeps each pod's fleet-wide totals,
so a read returns one number per busy pod whatever the number of gateways, and a gateway writes only
the pods whose own count changed. Keys of one model share a hash tag, `{<model>}`, so on a Redis
Cluster a model's keys live on one shard and each model's writes are one atomic script there.

  extproc:running:{<model>}           hash, field "<namespace>/<pod>", the in-flight total of every
                                      live gateway (a pod at 0 has no field)
  extproc:packed:{<model>}            the same totals packed for reading (sharing/packed_totals.py):
  extproc:slots:{<model>}             a string of int32 per slot, the hash pod -> slot and the list
  extproc:slotnames:{<model>}         of each slot's pod; kept by the same scripts as the hash
  extproc:tokens:{<model>}            hash, same fields, the completed output tokens of every gateway
                                      ever (cumulative: a gateway's share stays when it goes)
  extproc:ledger:{<model>}:<gateway>  hash, this gateway's own share: "r:<ns>/<pod>" in flight,
                                      "t:<ns>/<pod>" cumulative tokens, "~" present while counted.
                                      The write script takes absolute values and moves the totals by
                                      the difference to the ledger, atomically: resending a batch
                                      whose reply was lost changes nothing
  extproc:members:{<model>}           set of the gateways with a ledger on the model
  extproc:gateways                    sorted set, member "<instance>:<start ns>", score = last heartbeat
                                      (Redis's clock, Unix seconds). A member of a model silent for
                                      > 3 s (or gone from this set) is reaped: its running share
                                      leaves the totals, once, by any gateway that sees it (it writes
                                      everything again if it returns)
  extproc:speedsum:{<model>}          ours: hash, field "<ns>/<pod>", the speed evidence of every
                                      gateway summed, as little-endian doubles
                                      (sharing/speed_sums.py: each group of sums decayed
                                      to its latest time), moved by the SPEED script by the difference
                                      to the gateway's share in its ledger ("s:<ns>/<pod>"), so a
                                      reaped gateway's share leaves it. A gateway writes a pod's
                                      share when a record arrived, at most once every 5 heartbeats
                                      (pods spread over them); it reads the model's sums every
                                      other heartbeat, one vector per pod whatever the number of
                                      gateways
  extproc:done:<origin>               ours: list of "<request key> <status>", requests a gateway process
                                      routed whose access-log record reached another (one Envoy's log
                                      stream goes to one replica); the router pops it and releases them
  aibrix:pod:<gateway>:<ns>:<pod>     AIBrix's own rows, only with `redis.aibrix_rows: true` (below)

Every key but the heartbeat set and the AIBrix rows expires 10 minutes after its last write or
heartbeat refresh.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import compress, count

import numpy as np

from extproc.pool.pod import Pod, PodKey
from extproc.sharing import speed_sums
from extproc.sharing.shared import LocalCounts
from extproc.sharing.speed_sums import PeerSums

# AIBrix's gateway (vllm-project/aibrix, pkg/cache/cache_gateway_snapshot.go, #2159): every 100 ms each
# AIBrix gateway HSETs a hash aibrix:pod:<POD_NAME>:<namespace>:<pod> (fields gateway_instance_id,
# pod_uid, pod_name, namespace, node_name, requests_running, seq, update_time) with a 500 ms PEXPIRE,
# and sums requests_running of the other gateways' hashes (SCAN aibrix:pod:*). With `aibrix_rows` on,
# our gateways write the same rows (so AIBrix gateways count ours) and read AIBrix's; rows our own
# gateways wrote are never read back (the totals already hold them).
RUNNING_PREFIX = "extproc:running:"
TOKENS_PREFIX = "extproc:tokens:"
LEDGER_PREFIX = "extproc:ledger:"
MEMBERS_PREFIX = "extproc:members:"
GATEWAYS_KEY = "extproc:gateways"
SPEED_PREFIX = "extproc:speedsum:"
PACKED_PREFIX = "extproc:packed:"
SLOTS_PREFIX = "extproc:slots:"
NAMES_PREFIX = "extproc:slotnames:"
AIBRIX_POD_PREFIX = "aibrix:pod:"
AIBRIX_POD_PATTERN = "aibrix:pod:*"
KEY_TTL_SECONDS = 600            # totals and ledgers expire this long after their last write
AIBRIX_SNAPSHOT_TTL_MS = 500     # AIBrix's gatewayPodSnapshotTTL
AIBRIX_REFRESH_SECONDS = 0.3     # an unchanged AIBrix row is rewritten this often, before it expires
EXTPROC_MARK = "extproc_field"   # extra field in our aibrix:pod rows: AIBrix ignores it
GATEWAY_RETENTION_SECONDS = 600  # heartbeat members this stale leave the set (reaped long before)
FORWARD_PREFIX = "extproc:done:"
FORWARD_TTL_SECONDS = 60         # an inbox nobody pops (its gateway died) goes away
MAX_FORWARDS = 10_000            # unsent while Redis is down: past this, reconciliation releases them
MAX_RECEIVE = 2_000              # popped per tick
# A pod's speed share is written at most once every this many heartbeats (`extproc bench sync`, 16
# gateways x 1,000 pods: Redis 0.46 of a core writing at every heartbeat, 0.34 every 5; every 10 saved
# nothing measurable). The sums forget over 5 s (base) and 120 s (slope): a share up to 5 s late lacks
# a few records.
SPEED_WRITE_HEARTBEATS = 5
# The others' sums are read every this many heartbeats (and after an outage): each gateway writes a
# pod's share at most every 5, and the read of every pod's sums is most of a heartbeat's work at 5,000
# pods (`extproc bench sync --sizes 50x5000`: 0.138 of a core per gateway reading every heartbeat).
SPEED_READ_HEARTBEATS = 2


def pod_id(pod: Pod) -> str:
    return f"{pod.namespace}/{pod.name}"  # AIBrix's utils.GeneratePodKey


def model_tag(model: str) -> str:
    """The `{...}` hash tag of a model's keys (Redis Cluster hashes only what is inside the braces)."""
    return "{" + model.replace("{", "(").replace("}", ")") + "}"


def running_key(model: str) -> str:
    return RUNNING_PREFIX + model_tag(model)


def tokens_key(model: str) -> str:
    return TOKENS_PREFIX + model_tag(model)


def ledger_key(model: str, gateway: str) -> str:
    return f"{LEDGER_PREFIX}{model_tag(model)}:{gateway}"


def members_key(model: str) -> str:
    return MEMBERS_PREFIX + model_tag(model)


def speed_key(model: str) -> str:
    return SPEED_PREFIX + model_tag(model)


def packed_key(model: str) -> str:
    return PACKED_PREFIX + model_tag(model)


def slots_key(model: str) -> str:
    return SLOTS_PREFIX + model_tag(model)


def names_key(model: str) -> str:
    return NAMES_PREFIX + model_tag(model)


def aibrix_pod_key(gateway: str, pod: Pod) -> str:
    return f"{AIBRIX_POD_PREFIX}{gateway}:{pod.namespace}:{pod.name}"


def parse_int(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


@dataclass(slots=True)
class WriteBatch:
    """One tick's writes. Every running and token value is absolute (the script moves the totals by
    the difference to the ledger), so resending a batch whose reply was lost changes nothing."""
    heartbeat: bool                                            # refresh our heartbeat with this tick
    due: bool = False                                          # the once-a-heartbeat work is in it
    running: dict[PodKey, int] = field(default_factory=dict)   # own in-flight count
    tokens: dict[PodKey, int] = field(default_factory=dict)    # own cumulative tokens
    aibrix: dict[PodKey, int] = field(default_factory=dict)    # AIBrix rows: > 0 set, 0 delete
    reap: list[tuple[str, str]] = field(default_factory=list)  # (model, silent gateway) to take out
    forwards: dict[str, list[str]] = field(default_factory=dict)  # owner -> "<key> <status>" entries
    speed: dict[PodKey, bytes] = field(default_factory=dict)   # own speed share to write; b"": withdraw
    speed_sent: dict[PodKey, list[float] | None] = field(default_factory=dict)  # ... as planned
    read_speed: bool = False                                   # read the others' with this tick
    read_tokens: bool = False                                  # read the token totals with this tick
    # Every own value ever written, zeros included: Redis came back from an older snapshot (RDB), or
    # lost our ledger, and a count that went to 0 since would otherwise stay at its old value.
    reassert: bool = False

    def __bool__(self) -> bool:
        return bool(self.heartbeat or self.running or self.tokens or self.aibrix or self.reap
                    or self.forwards or self.speed)


@dataclass(slots=True)
class SharedSnapshot:
    """One read of the shared store (Redis, or the fleet simulation's stand-in): what `apply` folds in."""

    server_now: float                                  # Redis's clock, Unix seconds
    gateways: dict[str, float]                         # heartbeat member -> score
    running: dict[PodKey, int]                         # per tracked pod: fleet total (absent: 0)
    tokens: dict[PodKey, int] | None = None            # per pod: fleet cumulative tokens; None: not read
    aibrix: dict[str, int] = field(default_factory=dict)  # "ns/pod" -> AIBrix gateways' in-flight
    members: dict[str, set[str]] | None = None         # per model: gateways with a ledger; None: not read
    speed: dict[PodKey, str | bytes] | None = None     # per pod: the fleet's speed sums; None: not read
    # RedisState's read, instead of `running`: per model, its tracked pods that have a slot and their
    # totals, aligned (sharing/packed_totals.py); a model not in it reads 0 throughout
    packed: dict[str, tuple[list[PodKey], np.ndarray]] | None = None


@dataclass(slots=True)
class _Column:
    """One model's pods as the packed totals list them, with what this gateway last wrote on each:
    a read works the others' counts out on arrays (at 5,000 pods, a dict built pod by pod in Python
    was a third of a turn)."""

    keys: list[PodKey]
    at: dict[PodKey, int]    # key -> index
    written: np.ndarray      # own in-flight count as the ledger holds it

    def clear(self, others: dict[PodKey, int]) -> None:
        for key in self.keys:
            others.pop(key, None)


@dataclass(slots=True)
class _TokenColumn:
    """The tracked pods (as of `layout`) with their own token total as written and the others' total
    already counted (-1: not read yet), mirroring `_written_tokens` and `_seen`."""

    layout: int
    keys: list[PodKey]
    at: dict[PodKey, int]
    own: np.ndarray
    seen: np.ndarray


class SyncCore:
    def __init__(self, me: str, counts: LocalCounts, *, gateway_ttl: float = 3.0,
                 heartbeat_interval: float = 1.0, aibrix_snapshots: bool = False) -> None:
        self.me = me
        self.counts = counts
        self.gateway_ttl = gateway_ttl
        self.heartbeat_interval = heartbeat_interval
        self.aibrix_snapshots = aibrix_snapshots
        self.up = False
        self.others: dict[PodKey, int] = {}             # live other gateways' in-flight, last snapshot
        self._written_running: dict[PodKey, int] = {}   # what our ledger holds
        self._written_tokens: dict[PodKey, int] = {}
        self._written_aibrix: dict[PodKey, tuple[int, float]] = {}  # AIBrix row: (count, when written)
        self._retiring: dict[PodKey, Pod] = {}          # forgotten pods whose ledger value is not 0 yet
        self._seen: dict[PodKey, int] = {}              # the others' token total already counted
        self._pending: dict[PodKey, int] = {}           # shared token deltas not yet taken
        self._last_heartbeat: float | None = None
        self._full = True                               # next batch re-asserts every own value
        self._written_speed: dict[PodKey, list[float]] = {}  # own speed share as the ledger holds it
        self._retiring_speed: dict[PodKey, Pod] = {}    # forgotten pods whose share is still written
        self._speed_slot: dict[PodKey, int] = {}        # the heartbeats (mod N) a pod's share may go
        self._slot_keys: list[list[PodKey]] = [[] for _ in range(SPEED_WRITE_HEARTBEATS)]  # ... inverted
        self._beats = 0                                 # heartbeats planned
        self._members: dict[str, set[str]] = {}         # per model: gateways with a ledger, last read
        self._silent: set[tuple[str, str]] = set()      # (model, gateway) silent at the last snapshot
        self._reaped: set[tuple[str, str]] = set()      # ... already taken out of the totals
        # Routing's echo of the other gateways between snapshots (routing_running): how many live peers
        # the last snapshot showed, and the requests this gateway started since then, per pod.
        self.peers = 0
        self._started: dict[PodKey, int] = {}
        # Access-log records of other gateways' requests, on their way to them; and ours from them.
        self.inbox: str | None = None                   # this gateway process's origin (see Gateway)
        # Speed evidence: this gateway's own to publish, and the other gateways' (the fleet's sums
        # less our share), as last read; per pod the read it came from, so unchanged ones are reused.
        self.speed_out: dict[PodKey, list[float]] = {}
        self.peer_speed: PeerSums | dict[PodKey, list[list[float]]] = {}
        self._columns: dict[str, _Column] = {}           # per model, with a packed read (`_apply_packed`)
        # own counts and token totals written since the last read; dicts, not sets: handed on in the
        # order written, so a run does not depend on the string hash's seed (the fleet simulation's seeds)
        self._moved: dict[PodKey, None] = {}
        self._tokens_moved: dict[PodKey, None] = {}
        self._token_column: _TokenColumn | None = None   # the tracked pods' token figures as arrays
        self._written_raw: dict[PodKey, bytes] = {}     # ... as sent (the sums' reader subtracts it)
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

    def pod(self, key: PodKey) -> Pod:
        """A pod a batch names: tracked, or forgotten with its last zero still to write."""
        return self.counts.pods.get(key) or self._retiring.get(key) or self._retiring_speed[key]

    def plan(self, now: float) -> WriteBatch:
        """What to send now: the values that changed since they were written; after a failure (or
        when Redis lost our ledger) every value ever written, zeros included."""
        due = self._last_heartbeat is None or now - self._last_heartbeat >= self.heartbeat_interval
        full = self._full
        batch = WriteBatch(heartbeat=due, due=due, reassert=full, read_tokens=due or full)
        counts = self.counts
        written_running, written_tokens = self._written_running, self._written_tokens
        # Between failures only the pods whose counts moved (AIBrix rows: also those about to expire).
        keys = counts.pods.keys() if full else counts.take_changed() | self._written_aibrix.keys()
        if full:
            counts.take_changed()
        for key in keys:
            if key not in counts.pods:
                continue
            n = counts.running.get(key, 0)
            if n != written_running.get(key, 0) or (full and (n > 0 or key in written_running)):
                batch.running[key] = n
            if self.aibrix_snapshots:
                row = self._written_aibrix.get(key)
                # Rows expire in 500 ms: rewritten when changed or about to expire, deleted once idle.
                if (n > 0 and (row is None or row[0] != n or now - row[1] >= AIBRIX_REFRESH_SECONDS)
                        or n == 0 and row is not None):
                    batch.aibrix[key] = n
        for key in self._retiring:
            batch.running[key] = 0
        if due or full:  # token totals are read once a heartbeat: written as often, not every turn
            pods = counts.pods
            for key, t in counts.tokens.items():
                if key in pods and (t != written_tokens.get(key, 0) or (full and t > 0)):
                    batch.tokens[key] = t
        batch.reap = sorted(self._silent - self._reaped)
        batch.forwards, self._outbox, self._outbox_size = self._outbox, {}, 0
        if due:  # the fit moves slowly: a heartbeat's cadence is enough, and keeps each tick small
            batch.read_speed = full or self._beats % SPEED_READ_HEARTBEATS == 0
            self._plan_speed(batch)
        # The heartbeat goes first in any batch that writes counts, so a reader that sees our
        # counts also sees us alive and never reaps them.
        batch.heartbeat = due or bool(batch.running or batch.tokens)
        return batch

    def _plan_speed(self, batch: WriteBatch) -> None:
        """A pod's share goes when Redis lacks it, or when records arrived and its turn among the
        heartbeats came (pods spread evenly over them, so each heartbeat writes a 1/N of them)."""
        beat = self._beats % SPEED_WRITE_HEARTBEATS
        self._beats += 1
        written, slots, pods, out = self._written_speed, self._speed_slot, self.counts.pods, self.speed_out
        turn = self._slot_keys[beat]
        for key in [k for k in out if k not in written]:  # Redis lacks it: now, whatever its turn
            if key in pods:
                if key not in slots:
                    slot = slots[key] = len(slots) % SPEED_WRITE_HEARTBEATS
                    self._slot_keys[slot].append(key)
                batch.speed[key] = speed_sums.encode(out[key])
                batch.speed_sent[key] = out[key]
        for key in turn:  # this heartbeat's 1/N, where records arrived since it was written
            old = written.get(key)
            if old is not None and key in pods and slots.get(key) == beat and key not in batch.speed:
                vector = out.get(key)
                if vector is not None and speed_sums.new_records(vector, old):
                    batch.speed[key] = speed_sums.encode(vector)
                    batch.speed_sent[key] = vector
        for key in list(self._retiring_speed):
            if key in pods:  # tracked again before its share was withdrawn: it stays
                del self._retiring_speed[key]
            else:
                batch.speed[key] = b""
                batch.speed_sent[key] = None

    def confirm(self, batch: WriteBatch, now: float) -> None:
        self._written_running.update(batch.running)
        self._moved.update(dict.fromkeys(batch.running))
        self._written_tokens.update(batch.tokens)
        self._tokens_moved.update(dict.fromkeys(batch.tokens))
        for key in list(self._retiring):
            if batch.running.get(key) == 0:
                del self._retiring[key]
                self._written_running.pop(key, None)
        for key, n in batch.aibrix.items():
            if n > 0:
                self._written_aibrix[key] = (n, now)
            else:
                self._written_aibrix.pop(key, None)
        if batch.due:  # a busy gateway beats every tick; the periodic reads still come once a heartbeat
            self._last_heartbeat = now
        if batch.reassert:
            self._full = False
        self._reaped.update(batch.reap)
        for key, vector in batch.speed_sent.items():  # not speed_out: it may have moved since the plan
            if vector is None:
                self._written_speed.pop(key, None)
                self._written_raw.pop(key, None)
                self._retiring_speed.pop(key, None)
            else:
                self._written_speed[key] = vector
                self._written_raw[key] = batch.speed[key]

    def lost_ledger(self, batch: WriteBatch | None = None) -> None:
        """Redis answered that our ledger was gone (taken for dead, or Redis lost it): the totals miss
        our unchanged values, so the next batch writes every value again. The speed shares this batch
        wrote (after the ledger was made afresh) are in the sums."""
        self._full = True
        sent = batch.speed_sent if batch is not None else {}
        self._written_speed = {key: v for key, v in sent.items() if v is not None}
        self._written_raw = {key: batch.speed[key] for key in self._written_speed} if batch else {}

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
        self._full = True  # Redis may come back empty or from an old snapshot: re-assert everything
        self._reaped = set()  # ... with silent gateways back in its totals
        self._written_speed = {}  # ... and without our speed evidence
        self._written_raw = {}
        self.peer_speed = {}  # each gateway fits on its own records until Redis is back

    def apply(self, snap: SharedSnapshot) -> None:
        """A snapshot read: other live gateways' counts, and token deltas since the last one. Our own
        share in a total is what we wrote (confirmed before the read, in the same pipeline)."""
        me = self.me
        live = {g for g, beat in snap.gateways.items() if beat >= snap.server_now - self.gateway_ttl}
        if snap.members is not None:
            self._members = snap.members
        self._silent = {(model, g) for model, members in self._members.items() for g in members
                        if g not in live and g != me}
        self._reaped &= self._silent  # a gateway heard again is reaped afresh when it next goes silent
        if snap.packed is not None and not snap.aibrix:
            self._apply_packed(snap.packed)
        else:
            running = snap.running
            if snap.packed is not None:  # AIBrix's rows add to the totals: the whole dict afresh
                running = {k: n for keys, values in snap.packed.values()
                           for k, n in zip(keys, values.tolist())}
            written = self._written_running
            # A pod missing from the totals is at 0: only the busy ones are looked at.
            others = {key: n for key, total in running.items() if (n := total - written.get(key, 0)) > 0}
            if snap.aibrix:
                for key, pod in self.counts.pods.items():
                    if n := snap.aibrix.get(pod_id(pod), 0):
                        others[key] = others.get(key, 0) + n
            self.others = others
            self._columns = {}
        if snap.tokens is not None:
            self._count_tokens(snap.tokens)
        if snap.speed is not None:
            self._apply_speed(snap.speed)
        self.up = True
        self.peers = len(live - {me})
        self._started = {}

    def _apply_packed(self, packed: dict[str, tuple[list[PodKey], np.ndarray]]) -> None:
        """`others` from the packed totals: per model, the others' count is the total less what we
        wrote, worked out on an array of what we wrote kept aligned with the read, and handed to the
        dict routing reads in one C-level update (a pod at 0 keeps its entry, at 0)."""
        if not self._columns:  # first read, or the last went through the dict: afresh
            self.others = {}
        others, written = self.others, self._written_running
        moved, self._moved = self._moved, {}
        old, columns = self._columns, {}
        for model, (keys, _) in packed.items():
            column = old.pop(model, None)
            if column is not None and column.keys is not keys:  # the map was bound anew
                column.clear(others)
                column = None
            if column is None:
                column = _Column(keys, {key: i for i, key in enumerate(keys)},
                                 np.fromiter((written.get(key, 0) for key in keys), np.int64, len(keys)))
            columns[model] = column
        for column in old.values():  # a model not read this turn: its pods at 0
            column.clear(others)
        for key in moved:  # a key's model is its first part
            column = columns.get(key[0])
            if column is not None and (i := column.at.get(key)) is not None:
                column.written[i] = written.get(key, 0)
        for model, (keys, totals) in packed.items():
            others.update(zip(keys, np.maximum(totals - columns[model].written, 0).tolist()))
        self._columns = columns

    def _apply_speed(self, sums: dict[PodKey, str | bytes]) -> None:
        """The others' evidence per pod: the fleet's sums less our share as written (a silent
        gateway's share stays until it is reaped, decaying meanwhile), worked out together as the
        rows of one array."""
        written = self._written_raw
        keys = list(sums)
        matrix, keep = speed_sums.others_matrix(list(sums.values()), [written.get(key) for key in keys])
        rows = dict(zip(compress(keys, keep.tolist()), count()))  # row i: the i-th kept
        self.peer_speed = PeerSums(rows, matrix[keep])

    def _count_tokens(self, totals: dict[PodKey, int]) -> None:
        """Token deltas from a read of the fleet's totals: own tokens published and not yet handed
        out locally, and the others' growth past what was already counted (a pod's first read sets
        its baseline, or its whole history would count at once). Worked out on arrays over the
        tracked pods; only pods with something new touch a dict."""
        counts, written, pending = self.counts, self._written_tokens, self._pending
        column = self._token_column
        if column is None or column.layout != counts.layout:
            keys = list(counts.pods)
            seen = self._seen
            column = self._token_column = _TokenColumn(
                counts.layout, keys, {key: i for i, key in enumerate(keys)},
                np.fromiter((written.get(key, 0) for key in keys), np.int64, len(keys)),
                np.fromiter((seen.get(key, -1) for key in keys), np.int64, len(keys)))
        else:
            for key in self._tokens_moved:
                if (i := column.at.get(key)) is not None:
                    column.own[i] = written.get(key, 0)
        moved, self._tokens_moved = self._tokens_moved, {}
        for key in moved:  # own tokens published, not yet handed out locally (the rest were)
            own = written.get(key, 0)
            taken = counts.taken(key)
            if key in counts.pods and own > taken:
                pending[key] = pending.get(key, 0) + own - taken
                counts.mark_taken(key, own)
        keys = column.keys
        others = np.maximum(np.fromiter((totals.get(key, 0) for key in keys), np.int64, len(keys))
                            - column.own, 0)
        # A total that fell (Redis restarted) keeps the remembered one: as the gateways write their
        # cumulative values again it climbs back, and only what goes beyond is new.
        changed = np.flatnonzero(others > column.seen)
        if not len(changed):
            return
        counted, now = column.seen[changed], others[changed]
        column.seen[changed] = now
        seen = self._seen
        for i, before, after in zip(changed.tolist(), counted.tolist(), now.tolist()):
            key = keys[i]
            seen[key] = after
            if before >= 0:  # else the pod's first read: a baseline
                pending[key] = pending.get(key, 0) + after - before

    def forget(self, live: list[PodKey] | set[PodKey]) -> None:
        pods = dict(self.counts.pods)
        for key in self.counts.forget(live):
            if self._written_running.get(key, 0) > 0:
                self._retiring[key] = pods[key]  # its last zero goes out with the next batch
            else:
                self._written_running.pop(key, None)
            if key in self._written_speed:  # its share leaves the sums with the next heartbeat
                self._retiring_speed[key] = pods[key]
            for table in (self.others, self._written_tokens, self._seen, self._pending, self.speed_out,
                          self.peer_speed, self._speed_slot):
                table.pop(key, None)
            # Its AIBrix row (if any) is left to its 500 ms expiry.
            self._written_aibrix.pop(key, None)
        self._slot_keys = [[] for _ in range(SPEED_WRITE_HEARTBEATS)]
        for key, slot in self._speed_slot.items():
            self._slot_keys[slot].append(key)

    def written_running(self) -> list[PodKey]:
        return list(self._written_running)

    def written_aibrix(self) -> list[PodKey]:
        return list(self._written_aibrix)


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

    def peer_speed(self) -> PeerSums | dict[PodKey, list[list[float]]]:
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

    async def run(self) -> None:
        pass  # synced from outside (the fleet simulation's hub); RedisState runs its own loop

    async def close(self) -> None:
        pass
