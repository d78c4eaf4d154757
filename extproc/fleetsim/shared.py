"""Shared state between simulated gateway replicas, with the Redis sync's delay.

Each simulated gateway runs the live backend's pure half, `extproc.sharing.sync_core.SyncCore`, over its
own `LocalCounts`, exactly as `RedisState` does; only Redis itself is replaced, by `SyncHub`: each
gateway's ledger (its own in-flight and cumulative tokens per pod), the per-pod totals a read returns
(the in-flight of the gateways heard within the liveness window, as reaping leaves them; every
gateway's tokens), each gateway's speed evidence and the heartbeats.
A gateway's own counts are exact; the others' are as of its last sync tick (~100 ms, phases spread),
so a remote change is seen 0-2 ticks late, as through Redis.

`share_tokens=False` reproduces the spec's known limitation ("Multiple gateway replicas"): a gateway
reads back only its own token field, so it learns a replica's capacity from the ~1/N of the output it
routed itself, while running counts stay cross-gateway.
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.pool.pod import PodKey
from extproc.sharing import speed_sums
from extproc.sharing.shared import LocalCounts
from extproc.sharing.sync_core import SharedSnapshot, SyncCore, SyncedState, WriteBatch

GATEWAY_TTL = 3.0  # SyncCore's default liveness window


class SyncHub:
    """What Redis holds, in memory: per pod, each gateway's ledger value; totals are summed at a read."""

    __slots__ = ("share_tokens", "running", "tokens", "speed", "speed_sums", "heartbeats")

    def __init__(self, share_tokens: bool = True) -> None:
        self.share_tokens = share_tokens
        self.running: dict[PodKey, dict[str, int]] = {}
        self.tokens: dict[PodKey, dict[str, int]] = {}
        self.speed: dict[PodKey, dict[str, list[float]]] = {}  # each gateway's speed share per pod
        self.speed_sums: dict[PodKey, bytes] = {}              # ... summed, as Redis keeps them
        self.heartbeats: dict[str, float] = {}

    def write(self, field: str, batch: WriteBatch, now: float) -> None:
        if batch.heartbeat:
            self.heartbeats[field] = now
        for key, n in batch.running.items():
            self.running.setdefault(key, {})[field] = n
        for key, t in batch.tokens.items():
            self.tokens.setdefault(key, {})[field] = t
        for key, raw in batch.speed.items():
            shares = self.speed.setdefault(key, {})
            new = speed_sums.decode(raw)
            total = speed_sums.move(speed_sums.decode(self.speed_sums.get(key)), shares.pop(field, None), new)
            if new is not None:
                shares[field] = new
            if total is None:
                self.speed_sums.pop(key, None)
            else:
                self.speed_sums[key] = speed_sums.encode(total)

    def read(self, field: str, keys: Iterable[PodKey], now: float, speed: bool = False,
             tokens: bool = True) -> SharedSnapshot:
        live = {g for g, beat in self.heartbeats.items() if beat >= now - GATEWAY_TTL}
        snap = SharedSnapshot(server_now=now, gateways=dict(self.heartbeats), running={},
                              tokens={} if tokens else None, speed={} if speed else None)
        for key in keys:
            if snap.speed is not None and (raw := self.speed_sums.get(key)) is not None:
                snap.speed[key] = raw
            snap.running[key] = sum(n for g, n in self.running.get(key, {}).items() if g in live)
            if snap.tokens is not None:
                fields = self.tokens.get(key, {})
                snap.tokens[key] = sum(fields.values()) if self.share_tokens else fields.get(field, 0)
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
        self.core.apply(self.hub.read(self.field, list(self.counts.pods), now, batch.read_speed,
                                      batch.read_tokens))
