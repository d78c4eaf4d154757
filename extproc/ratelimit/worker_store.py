"""Budgets shared by the worker processes of one `extproc serve --workers N` without Redis: the token
buckets of bucket.py in a segment of shared memory (a memfd the supervisor creates and every worker
inherits, as the in-flight counts' segment), so a subject's limit holds across the workers instead of
being N times over.

The segment is a set-associative table: a bucket's id hashes to one set of WAYS entries; a set is
locked (an fcntl record lock on its byte, two system calls) while one worker reads, judges and writes
an entry, so workers racing for one budget admit exactly what it holds. A set that is full drops an
entry idle for a full window (full again: nothing to remember) first, then the least recently used,
as the in-process store does. CLOCK_MONOTONIC is one clock for every process of the machine.

Layout: header MAGIC, sets, ways (int64); then sets x WAYS entries of ENTRY_WORDS 8-byte words:
key (two int64 of the id's BLAKE2b; 0, 0: free), then float64 requests, tokens, stamp, rpm, tpm held.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct

from extproc.ratelimit.bucket import WINDOW_S, Bucket, Verdict, charge, take
from extproc.ratelimit.settings import Limits

MAGIC = 0x6578747072626B31  # "extprbk1"
HEADER_WORDS = 4
WAYS = 8
DEFAULT_SETS = 8192  # 65,536 budgets, 3.7 MB (pages are touched only as budgets appear)
ENTRY_WORDS = 7
_WORD = 8
_KEY_HI, _KEY_LO, _REQUESTS, _TOKENS, _STAMP, _RPM, _TPM = range(ENTRY_WORDS)


def create_budgets(sets: int = DEFAULT_SETS) -> int:
    """A zeroed budget segment; returns its file descriptor (inheritable)."""
    fd = os.memfd_create("extproc-budgets", 0)  # not MFD_CLOEXEC: the workers inherit it
    os.ftruncate(fd, (HEADER_WORDS + sets * WAYS * ENTRY_WORDS) * _WORD)
    with mmap.mmap(fd, HEADER_WORDS * _WORD) as head:
        struct.pack_into("<3q", head, 0, MAGIC, sets, WAYS)
    return fd


class WorkerBudgets:
    """The in-process store's interface (take, charge) over the shared segment `fd`."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._mm = mmap.mmap(fd, 0)
        magic, sets, ways = struct.unpack_from("<3q", self._mm, 0)
        if magic != MAGIC or ways != WAYS:
            raise ValueError(f"not a budget segment (magic {magic:#x})")
        self._sets = sets
        body = memoryview(self._mm)[HEADER_WORDS * _WORD:]
        self._keys = body.cast("q")    # the same words, read as keys ...
        self._values = body.cast("d")  # ... and as the bucket's numbers

    def __len__(self) -> int:
        keys = self._keys
        return sum(1 for i in range(0, len(keys), ENTRY_WORDS) if keys[i] or keys[i + 1])

    def take(self, bucket_id: str, limits: Limits, cost: int, now: float) -> Verdict:
        with _Locked(self, bucket_id, now) as (at, held):
            bucket, verdict = take(held, limits, cost, now)
            self._write(at, bucket)
        return verdict

    def charge(self, bucket_id: str, tokens_limit: int, tokens: int, now: float) -> None:
        with _Locked(self, bucket_id, now) as (at, held):
            self._write(at, charge(held, tokens_limit, tokens, now))

    def _write(self, at: int, bucket: Bucket) -> None:
        v = self._values
        v[at + _REQUESTS], v[at + _TOKENS], v[at + _STAMP] = bucket.requests, bucket.tokens, bucket.stamp
        v[at + _RPM] = float(bucket.limits.requests or 0)
        v[at + _TPM] = float(bucket.limits.tokens or 0)

    def close(self) -> None:
        self._keys.release()
        self._values.release()
        self._mm.close()


class _Locked:
    """The entry for `bucket_id` under its set's lock: (word offset, its bucket or None when new)."""

    __slots__ = ("_fd", "_set", "_store", "_hi", "_lo", "_now")

    def __init__(self, store: WorkerBudgets, bucket_id: str, now: float) -> None:
        digest = hashlib.blake2b(bucket_id.encode(), digest_size=16).digest()
        self._hi, self._lo = struct.unpack("<qq", digest)
        if not (self._hi or self._lo):
            self._lo = 1  # (0, 0) marks a free entry
        self._store = store
        self._now = now
        self._fd = store._fd
        self._set = (self._lo & 0x7FFFFFFFFFFFFFFF) % store._sets

    def __enter__(self) -> tuple[int, Bucket | None]:
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, self._set)
        keys, values = self._store._keys, self._store._values
        first = self._set * WAYS * ENTRY_WORDS
        free = idle = oldest = -1
        oldest_stamp = float("inf")
        for at in range(first, first + WAYS * ENTRY_WORDS, ENTRY_WORDS):
            hi, lo = keys[at + _KEY_HI], keys[at + _KEY_LO]
            if hi == self._hi and lo == self._lo:
                rpm, tpm = values[at + _RPM], values[at + _TPM]
                return at, Bucket(values[at + _REQUESTS], values[at + _TOKENS], values[at + _STAMP],
                                  Limits(int(rpm) or None, int(tpm) or None))
            if not (hi or lo):
                if free < 0:
                    free = at
                continue
            stamp = values[at + _STAMP]
            if idle < 0 and values[at + _TOKENS] >= 0 and self._now - stamp >= WINDOW_S:
                idle = at
            if stamp < oldest_stamp:
                oldest, oldest_stamp = at, stamp
        at = free if free >= 0 else idle if idle >= 0 else oldest
        keys[at + _KEY_HI], keys[at + _KEY_LO] = self._hi, self._lo
        return at, None

    def __exit__(self, *exc: object) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, self._set)

