"""Budgets kept in this process (no Redis configured): the token buckets of bucket.py in a bounded map."""

from __future__ import annotations

from extproc.ratelimit.bucket import WINDOW_S, Bucket, Verdict, charge, take
from extproc.ratelimit.settings import Limits

# Subjects may be client-chosen (key_by: user): the map is bounded. Past this, budgets idle for a full
# window (full again, nothing to remember) are dropped, then the least recently used.
MAX_BUCKETS = 100_000


class LocalStore:
    def __init__(self, max_buckets: int = MAX_BUCKETS) -> None:
        self._buckets: dict[str, Bucket] = {}  # insertion order = least recently used first
        self._max = max_buckets

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, bucket_id: str, limits: Limits, cost: int, now: float) -> Verdict:
        bucket, verdict = take(self._pop(bucket_id), limits, cost, now)
        self._put(bucket_id, bucket, now)
        return verdict

    def charge(self, bucket_id: str, tokens_limit: int, tokens: int, now: float) -> None:
        self._put(bucket_id, charge(self._pop(bucket_id), tokens_limit, tokens, now), now)

    def _pop(self, bucket_id: str) -> Bucket | None:
        return self._buckets.pop(bucket_id, None)

    def _put(self, bucket_id: str, bucket: Bucket, now: float) -> None:
        self._buckets[bucket_id] = bucket
        if len(self._buckets) > self._max:
            idle = [k for k, b in self._buckets.items() if now - b.stamp >= WINDOW_S and b.tokens >= 0]
            for k in idle:
                del self._buckets[k]
            while len(self._buckets) > self._max:
                del self._buckets[next(iter(self._buckets))]
