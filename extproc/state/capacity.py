"""Each replica's serving capacity, learned from the output tokens the gateway counts (the spec's
"How Capacity Is Learned"). Pure and clock-injected: the live gateway and the fleet simulation run it.

Completed tokens are credited as they are counted; every refresh closes a bucket. The rate is the
tokens of the buckets in the last `window` seconds divided by the time in those buckets during which
the pod was busy, smoothed by an EWMA with time constant `tau`. Busy time comes from a `BusyClock`
sampled more finely than the refresh: measured per refresh bucket, a burst of a few seconds gains up
to a whole bucket of busy time, and a gateway that sees the pod's running count through Redis one
sync later would add a different bucket than the gateway that routed, so the two would disagree.
Idle time is left out of the divisor and a window with no tokens keeps the previous estimate:
idle is not slow, so a pod is neither starved after a quiet spell nor under-rated while one drains
out of the window. A pod with no estimate yet is given the mean of those that have one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from extproc.pool.pod import PodKey


@dataclass(slots=True)
class _Series:
    last_refresh: float
    pending: float = 0.0
    buckets: deque[tuple[float, float, float]] = field(default_factory=deque)  # (end, tokens, busy s)
    tokens: float = 0.0  # sums over the buckets in the window
    busy: float = 0.0
    estimate: float | None = None
    updated: float | None = None


class CapacityEstimator:
    def __init__(self, window: float = 60.0, tau: float = 10.0) -> None:
        if window <= 0 or tau <= 0:
            raise ValueError("window and tau must be positive")
        self.window = window
        self.tau = tau
        self._series: dict[PodKey, _Series] = {}

    def track(self, key: PodKey, now: float) -> None:
        """Start measuring a pod (idempotent)."""
        if key not in self._series:
            self._series[key] = _Series(last_refresh=now)

    def observe(self, key: PodKey, tokens: float, now: float) -> None:
        """Completed output tokens credited to a pod (one request's, or a batch from other gateways)."""
        self.track(key, now)
        if tokens > 0:
            self._series[key].pending += tokens

    def observe_many(self, deltas: Mapping[PodKey, float], now: float) -> None:
        for key, tokens in deltas.items():
            self.observe(key, tokens, now)

    def refresh(self, now: float, busy: Mapping[PodKey, float] | None = None) -> None:
        """Close the current bucket of every pod. `busy`: seconds each pod had requests in flight since
        the last refresh (a `BusyClock`); without it a bucket is busy when tokens completed in it."""
        horizon = now - self.window
        for key, s in self._series.items():
            span = now - s.last_refresh
            s.last_refresh = now
            tokens, s.pending = s.pending, 0.0
            if span > 0:
                if busy is None:
                    busy_span = span if tokens > 0 else 0.0
                else:  # tokens arriving after the pod went idle: another gateway's, one sync late
                    busy_span = min(span, busy.get(key, 0.0))
                s.buckets.append((now, tokens, busy_span))
                s.tokens += tokens
                s.busy += busy_span
            while s.buckets and s.buckets[0][0] <= horizon:
                _, old_tokens, old_busy = s.buckets.popleft()
                s.tokens -= old_tokens
                s.busy -= old_busy
            if not s.buckets:
                s.tokens = s.busy = 0.0  # no float residue in an empty window
            if s.tokens <= 1e-9 or s.busy <= 1e-9:
                continue  # nothing completed in the window: keep the previous estimate
            rate = s.tokens / s.busy
            if s.estimate is None or s.updated is None:
                s.estimate = rate
            else:
                s.estimate += (1.0 - math.exp(-(now - s.updated) / self.tau)) * (rate - s.estimate)
            s.updated = now

    def estimate(self, key: PodKey) -> float | None:
        s = self._series.get(key)
        return s.estimate if s is not None else None

    def capacities(self, keys: Iterable[PodKey]) -> dict[PodKey, float | None]:
        """Per pod: its estimate, else the mean of those that have one; all None when none has."""
        keys = list(keys)
        known = {k: e for k in keys if (e := self.estimate(k)) is not None}
        mean = sum(known.values()) / len(known) if known else None
        return {k: known.get(k, mean) for k in keys}

    def forget(self, live: Iterable[PodKey]) -> None:
        live = set(live)
        for key in [k for k in self._series if k not in live]:
            del self._series[key]


class BusyClock:
    """Seconds each pod spent with requests in flight, from samples of its (cross-gateway) running
    count. An interval between two samples is busy when the pod had requests in flight at either end
    or completed one of this gateway's in it, so a request shorter than the interval still counts."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._busy: set[PodKey] = set()  # busy at the last sample, or completed a request since
        self._seconds: dict[PodKey, float] = {}

    def completed(self, key: PodKey) -> None:
        self._busy.add(key)

    def sample(self, now: float, busy: set[PodKey]) -> None:
        if self._last is not None and now > self._last:
            dt = now - self._last
            for key in busy | self._busy:
                self._seconds[key] = self._seconds.get(key, 0.0) + dt
        if self._last is None or now >= self._last:
            self._last = now
        self._busy = set(busy)

    def take(self) -> dict[PodKey, float]:
        """Busy seconds per pod since the last take."""
        seconds, self._seconds = self._seconds, {}
        return seconds
