"""Shared state between simulated gateway replicas, with the Redis sync's delay.

Each simulated gateway runs the live backend's pure half, `extproc.state.sync_core.SyncCore`, over its
own `LocalCounts`, exactly as `RedisState` does; only Redis itself is replaced, by `SyncHub` (the
hashes `aibrix:rrq:<pod>`, `extproc:tokens:<pod>` and `extproc:speed:<pod>`, one field per gateway,
plus the heartbeats).
A gateway's own counts are exact; the others' are as of its last sync tick (~100 ms, phases spread),
so a remote change is seen 0-2 ticks late, as through Redis.

`share_tokens=False` reproduces the spec's known limitation ("Multiple gateway replicas"): a gateway
reads back only its own token field, so it learns a replica's capacity from the ~1/N of the output it
routed itself, while running counts stay cross-gateway.
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.pool.pod import PodKey
from extproc.state.shared import LocalCounts
from extproc.state.sync_core import Snapshot, SyncCore, SyncedState, WriteBatch


class SyncHub:
    """What Redis holds, in memory: per pod, each gateway's field in the running and token hashes."""

    __slots__ = ("share_tokens", "running", "tokens", "speed", "heartbeats")

    def __init__(self, share_tokens: bool = True) -> None:
        self.share_tokens = share_tokens
        self.running: dict[PodKey, dict[str, int]] = {}
        self.tokens: dict[PodKey, dict[str, int]] = {}
        self.speed: dict[PodKey, dict[str, str]] = {}  # extproc:speed:<pod>: each gateway's evidence
        self.heartbeats: dict[str, float] = {}

    def write(self, field: str, batch: WriteBatch, now: float) -> None:
        if batch.heartbeat:
            self.heartbeats[field] = now
        for key, n in batch.running.items():
            self.running.setdefault(key, {})[field] = n
        for key, t in batch.tokens.items():
            self.tokens.setdefault(key, {})[field] = t
        for key, evidence in batch.speed.items():
            self.speed.setdefault(key, {})[field] = evidence

    def read(self, field: str, keys: Iterable[PodKey], now: float, speed: bool = False) -> Snapshot:
        snap = Snapshot(server_now=now, gateways=dict(self.heartbeats), running={}, tokens={},
                        speed={} if speed else None)
        for key in keys:
            if snap.speed is not None:
                snap.speed[key] = dict(self.speed.get(key, {}))
            snap.running[key] = dict(self.running.get(key, {}))
            tokens = self.tokens.get(key, {})
            if self.share_tokens:
                snap.tokens[key] = dict(tokens)
            else:
                snap.tokens[key] = {field: tokens[field]} if field in tokens else {}
        return snap


class SimSharedState(SyncedState):
    """One gateway's shared state (the `SharedState` protocol), as `RedisState` with the hub for Redis."""

    __slots__ = ("hub", "field", "counts", "core")

    def __init__(self, hub: SyncHub, field: str) -> None:
        self.hub = hub
        self.field = field
        self.counts = LocalCounts()
        self.core = SyncCore(field, self.counts, aibrix_snapshots=False)


    def sync(self, now: float) -> None:
        """One tick of RedisState.sync_once: push changed values, then read every tracked pod."""
        batch = self.core.plan(now)
        self.hub.write(self.field, batch, now)
        self.core.confirm(batch, now)
        self.core.apply(self.hub.read(self.field, list(self.counts.pods), now, batch.read_speed))
