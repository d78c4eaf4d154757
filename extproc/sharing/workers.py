"""Counts shared by the worker processes of one `extproc serve --workers N`, without a server.

A segment of shared memory (a memfd the supervisor creates and every worker inherits) holds, per pod
slot, each worker's own in-flight count and cumulative output tokens, one row per worker. A worker
writes only its own row, so no write needs a lock and a reader sums the rows: the same per-gateway
field layout as the Redis hashes (sharing/sync_core.py), read with no delay. Each worker also appends
every change of its in-flight counts to its own ring; the others drain it before each routing decision
(`peer_changes`), so a burst split over the workers is routed as one process would route it, not onto
counts up to a view resync old.

Records of another worker's requests (Envoy's access-log stream reaches one worker) are passed to their
owner through a ring per (sender, owner) pair in the same segment: single writer, single reader, no lock.

Layout (int64 unless said):
  header   MAGIC, workers, slots, ring entries, slots in use, inbox entries
  origins  workers x ORIGIN_BYTES: each worker's origin (the prefix of its request keys)
  keys     slots x KEY_BYTES: a length byte pair + "model\\x1fname\\x1faddress" (length 0: free)
  tracked  workers x slots bytes: 1 while that worker knows the pod (a slot is reused only when no one does)
  running  workers x slots: the worker's in-flight count on the pod
  tokens   workers x slots: the worker's completed output tokens on the pod since it started
  rings    workers x (1 + ring entries): the write count, then slot * 2**11 + delta + 2**10 per change
  inboxes  workers x workers x (2 + inbox entries): written, read, then request number * 2**10 + status
  speed    workers x slots x (1 + SPEED_VALUES) float64: a sequence number (odd while the worker writes),
           then the worker's speed evidence on the pod (state/speed.py `export`); a reader that sees
           the number change under it skips that cell until the next refresh
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import struct
from array import array
from collections.abc import Iterable

from extproc.pool.pod import Pod, PodKey
from extproc.sharing.shared import LocalCounts
from extproc.sharing.speed_sums import SPEED_VALUES

log = logging.getLogger(__name__)

MAGIC = 0x65787470726F6331  # "extproc1"
HEADER_WORDS = 8
KEY_BYTES = 256
ORIGIN_BYTES = 64
DEFAULT_SLOTS = 4096   # pods known at once across the workers (a slot is reused once no worker knows it)
DEFAULT_RING = 1 << 16  # changes a worker may fall behind by before it resyncs from the sums instead
_DELTA_BIAS = 1 << 10
_SLOT_SHIFT = 1 << 11
DEFAULT_INBOX = 1 << 13  # records one worker may pass another between two release passes (0.1 s)
_STATUS_SHIFT = 1 << 10
_WORD = 8
_SPEED_CELL = 1 + SPEED_VALUES


class SegmentFull(RuntimeError):
    """Every slot holds a pod some worker still knows."""


def segment_size(workers: int, slots: int = DEFAULT_SLOTS, ring: int = DEFAULT_RING,
                 inbox: int = DEFAULT_INBOX) -> int:
    words = (2 * workers * slots + workers * (1 + ring) + workers * workers * (2 + inbox)
             + workers * slots * _SPEED_CELL)
    return (HEADER_WORDS + words) * _WORD + workers * ORIGIN_BYTES + slots * KEY_BYTES + workers * slots


def create_segment(workers: int, slots: int = DEFAULT_SLOTS, ring: int = DEFAULT_RING,
                   inbox: int = DEFAULT_INBOX) -> int:
    """A zeroed segment for `workers` processes; returns its file descriptor (inheritable)."""
    fd = os.memfd_create("extproc-workers", 0)  # not MFD_CLOEXEC: the workers inherit it
    os.ftruncate(fd, segment_size(workers, slots, ring, inbox))
    with mmap.mmap(fd, HEADER_WORDS * _WORD) as head:
        struct.pack_into("<6q", head, 0, MAGIC, workers, slots, ring, 0, inbox)
    return fd


def _encode(key: PodKey) -> bytes:
    raw = "\x1f".join(key).encode()
    if len(raw) > KEY_BYTES - 2:  # a very long model name: its digest names it as uniquely
        raw = b"#" + hashlib.sha256(raw).hexdigest().encode()
    return len(raw).to_bytes(2, "little") + raw


class WorkerState:
    """`SharedState` for worker `index` of a supervisor's segment `fd` (see the module docstring)."""

    def __init__(self, fd: int, index: int) -> None:
        self._fd = fd
        self._mm = mmap.mmap(fd, 0)
        magic, workers, slots, ring, _, inbox = struct.unpack_from("<6q", self._mm, 0)
        if magic != MAGIC or not 0 <= index < workers:
            raise ValueError(f"not a worker segment for worker {index} (magic {magic:#x}, {workers} workers)")
        self.index, self.workers, self.slots, self.ring, self.inbox = index, workers, slots, ring, inbox
        self._origins_at = HEADER_WORDS * _WORD
        self._keys_at = self._origins_at + workers * ORIGIN_BYTES
        tracked_at = self._keys_at + slots * KEY_BYTES
        words_at = tracked_at + workers * slots
        self._tracked = memoryview(self._mm)[tracked_at:words_at]
        words = memoryview(self._mm)[words_at:].cast("q")
        cells = workers * slots
        self._running = words[:cells]
        self._tokens = words[cells:2 * cells]
        self._rings = words[2 * cells:2 * cells + workers * (1 + ring)]
        inboxes_at = 2 * cells + workers * (1 + ring)
        speed_at = inboxes_at + workers * workers * (2 + inbox)
        self._inboxes = words[inboxes_at:speed_at]
        self._speed = words[speed_at:].cast("B").cast("d")
        self._own = index * slots               # this worker's row offset
        self._ring_at = index * (1 + ring)
        self.counts = LocalCounts()
        self._slot: dict[PodKey, int] = {}
        self._key_at: dict[int, PodKey] = {}
        self._unslotted: set[PodKey] = set()  # no slot was free: retried at the next `track`
        self._taken: dict[tuple[int, int], int] = {}  # (worker, slot) -> its tokens already handed out
        self._read = [self._rings[w * (1 + ring)] for w in range(workers)]  # ring positions read
        self.origin = ""
        # A restarted worker starts from nothing: its predecessor's requests are released by
        # reconciliation against the engines' counts, as after a gateway restart.
        for slot in range(slots):
            self._running[self._own + slot] = 0
            self._tokens[self._own + slot] = 0
            self._tracked[self._own + slot] = 0
            self._speed[(self._own + slot) * _SPEED_CELL] = 0.0

    # -- slots ----------------------------------------------------------------------------------

    def _slot_of(self, pod: Pod) -> int | None:
        """The pod's slot; None when the segment is full (the pod is then counted by this worker
        alone until a later `track` finds it a slot: routing goes on, less exactly)."""
        slot = self._slot.get(pod.key)
        if slot is None:
            if pod.key in self._unslotted:
                return None
            try:
                slot = self._claim(pod.key)
            except SegmentFull as exc:
                self._unslotted.add(pod.key)
                log.error("pod %s/%s counted by this worker only: %s", pod.model, pod.name, exc)
                return None
            self._slot[pod.key] = slot
            self._key_at[slot] = pod.key
            # Tokens counted before this worker knew the pod are not news to learn from (a pod
            # forgotten and seen again would count them twice). Changes already in the rings are in
            # the sums routing reads next.
            for w in range(self.workers):
                if w != self.index:
                    self._taken[(w, slot)] = self._tokens[w * self.slots + slot]
        return slot

    def _claim(self, key: PodKey) -> int:
        """The pod's slot: the one another worker gave it, else a free one. Marked as known by this
        worker before the segment lock is let go, so no other worker can reclaim it meanwhile."""
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            slot = self._find_or_take(_encode(key))
            self._tracked[self._own + slot] = 1
            return slot
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def _find_or_take(self, want: bytes) -> int:
        """(Under the lock.) The slot holding `want`, else the first free one, else a reclaimed one."""
        used = struct.unpack_from("<q", self._mm, 4 * _WORD)[0]
        free = None
        for slot in range(used):
            at = self._keys_at + slot * KEY_BYTES
            n = int.from_bytes(self._mm[at:at + 2], "little")
            if n == 0:
                free = slot if free is None else free
            elif self._mm[at:at + 2 + n] == want:
                return slot
        if free is None and used < self.slots:
            free = used
            struct.pack_into("<q", self._mm, 4 * _WORD, used + 1)
        if free is None:
            free = self._reclaim(used)
        at = self._keys_at + free * KEY_BYTES
        self._mm[at:at + len(want)] = want
        return free

    def _reclaim(self, used: int) -> int:
        """A slot no worker knows any more (caller holds the lock): its counters start from zero."""
        for slot in range(used):
            if not any(self._tracked[w * self.slots + slot] for w in range(self.workers)):
                for w in range(self.workers):
                    self._running[w * self.slots + slot] = 0
                    self._tokens[w * self.slots + slot] = 0
                return slot
        raise SegmentFull(f"all {self.slots} pod slots are in use")

    # -- SharedState ------------------------------------------------------------------------------

    def add_running(self, pod: Pod, delta: int) -> None:
        counts = self.counts
        before = counts.running.get(pod.key, 0)
        counts.add_running(pod, delta)
        after = counts.running[pod.key]
        slot = self._slot_of(pod)
        if slot is None:
            return
        self._running[self._own + slot] = after
        if after != before:
            ring, at = self.ring, self._ring_at
            n = self._rings[at]
            change = max(-_DELTA_BIAS + 1, min(_DELTA_BIAS - 1, after - before))
            self._rings[at + 1 + n % ring] = slot * _SLOT_SHIFT + change + _DELTA_BIAS
            self._rings[at] = n + 1  # published after the entry: a reader never sees a stale entry

    def add_tokens(self, pod: Pod, tokens: int) -> None:
        if tokens <= 0:
            return
        self.counts.add_tokens(pod, tokens)
        slot = self._slot_of(pod)
        if slot is not None:
            self._tokens[self._own + slot] = self.counts.tokens[pod.key]

    def running(self, key: PodKey) -> int:
        slot = self._slot.get(key)
        if slot is None:
            return self.counts.running.get(key, 0)
        return max(0, sum(self._running[slot::self.slots]))

    def routing_running(self, key: PodKey) -> int:
        return self.running(key)  # the other workers' changes arrive one by one (peer_changes)

    peers = 0  # the other workers' choices are counted as they happen, not echoed

    def local_running(self, key: PodKey) -> int:
        return self.counts.running.get(key, 0)

    def peer_changes(self) -> list[tuple[PodKey, int]]:
        """Changes of the other workers' in-flight counts since the last call, on pods this one
        knows. A ring that lapped this reader yields only its newest entries: the views it feeds are
        resynced from the sums within RUNNING_RESYNC_SECONDS anyway."""
        out: list[tuple[PodKey, int]] = []
        rings, ring, key_at = self._rings, self.ring, self._key_at
        for w in range(self.workers):
            if w == self.index:
                continue
            at = w * (1 + ring)
            head, seen = rings[at], self._read[w]
            if head == seen:
                continue
            if head < seen or head - seen > ring:  # restarted, or lapped us: skip to now
                seen = max(0, head - ring) if head >= seen else 0
            for n in range(seen, head):
                slot, change = divmod(rings[at + 1 + n % ring], _SLOT_SHIFT)
                key = key_at.get(slot)
                if key is not None:
                    out.append((key, change - _DELTA_BIAS))
            self._read[w] = head
        return out

    def take_token_deltas(self) -> dict[PodKey, int]:
        out = self.counts.take_local_deltas()  # own tokens, slotted or not
        tokens, taken = self._tokens, self._taken
        for key, slot in self._slot.items():
            for w in range(self.workers):
                if w == self.index:
                    continue
                total = tokens[w * self.slots + slot]
                before = taken.get((w, slot), 0)
                if total < before:  # that worker restarted: its count starts again from zero
                    before = 0
                if total > before:
                    out[key] = out.get(key, 0) + total - before
                taken[(w, slot)] = total
        return out

    def share_speed(self, key: PodKey, evidence: list[float]) -> None:
        slot = self._slot.get(key)
        if slot is None or len(evidence) != SPEED_VALUES:
            return
        at = (self._own + slot) * _SPEED_CELL
        speed = self._speed
        seq = speed[at]
        speed[at] = seq + 1.0  # odd: being written
        speed[at + 1:at + _SPEED_CELL] = memoryview(array("d", evidence))
        speed[at] = seq + 2.0

    def peer_speed(self) -> dict[PodKey, list[list[float]]]:
        out: dict[PodKey, list[list[float]]] = {}
        speed = self._speed
        for key, slot in self._slot.items():
            for w in range(self.workers):
                if w == self.index:
                    continue
                at = (w * self.slots + slot) * _SPEED_CELL
                seq = speed[at]
                if seq == 0.0 or seq % 2.0:
                    continue  # never written, or being written
                evidence = speed[at + 1:at + _SPEED_CELL].tolist()
                if speed[at] == seq:  # not rewritten while read
                    out.setdefault(key, []).append(evidence)
        return out

    def track(self, pods: Iterable[Pod]) -> None:
        self._unslotted.clear()
        for pod in pods:
            self.counts.pods.setdefault(pod.key, pod)
            self._slot_of(pod)

    def forget(self, live: Iterable[PodKey]) -> None:
        live = set(live)
        self.counts.forget(live)
        for key in [k for k in self._slot if k not in live and k not in self.counts.pods]:
            slot = self._slot.pop(key)
            del self._key_at[slot]
            self._running[self._own + slot] = 0
            self._tracked[self._own + slot] = 0
            self._speed[(self._own + slot) * _SPEED_CELL] = 0.0
            for w in range(self.workers):
                self._taken.pop((w, slot), None)

    # -- records of other workers' requests -------------------------------------------------------

    def _inbox_at(self, sender: int, owner: int) -> int:
        return (sender * self.workers + owner) * (2 + self.inbox)

    def listen(self, origin: str) -> None:
        """Publish this worker's origin; records for it already waiting belong to a predecessor."""
        self.origin = origin
        raw = origin.encode()[:ORIGIN_BYTES - 1]
        at = self._origins_at + self.index * ORIGIN_BYTES
        self._mm[at:at + ORIGIN_BYTES] = raw.ljust(ORIGIN_BYTES, b"\0")
        for sender in range(self.workers):
            at = self._inbox_at(sender, self.index)
            self._inboxes[at + 1] = self._inboxes[at]

    def _worker_of(self, origin: str) -> int | None:
        want = origin.encode()[:ORIGIN_BYTES - 1].ljust(ORIGIN_BYTES, b"\0")
        for w in range(self.workers):
            at = self._origins_at + w * ORIGIN_BYTES
            if self._mm[at:at + ORIGIN_BYTES] == want:
                return w
        return None

    def forward(self, owner: str, key: str, status: int) -> bool:
        w = self._worker_of(owner)
        number = key.rpartition(".")[2]
        if w is None or w == self.index or not 0 <= status < _STATUS_SHIFT:
            return False  # a worker since replaced: reconciliation releases its requests
        try:
            n = int(number, 16)
        except ValueError:
            return False
        at = self._inbox_at(self.index, w)
        written, read = self._inboxes[at], self._inboxes[at + 1]
        if written - read >= self.inbox:
            return False  # the owner is not keeping up: reconciliation releases these
        self._inboxes[at + 2 + written % self.inbox] = n * _STATUS_SHIFT + status
        self._inboxes[at] = written + 1
        return True

    def take_forwarded(self) -> list[tuple[str, int]]:
        out = []
        for sender in range(self.workers):
            at = self._inbox_at(sender, self.index)
            written, read = self._inboxes[at], self._inboxes[at + 1]
            for n in range(read, written):
                number, status = divmod(self._inboxes[at + 2 + n % self.inbox], _STATUS_SHIFT)
                out.append((f"{self.origin}.{number:x}", status))
            self._inboxes[at + 1] = written
        return out

    @property
    def up(self) -> bool:
        return True  # shared memory does not go down while the workers live

    async def run(self) -> None:
        pass  # the segment is shared memory: nothing to sync

    async def close(self) -> None:
        pass  # the supervisor owns the segment


__all__ = ["WorkerState", "create_segment", "segment_size"]
