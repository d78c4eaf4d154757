"""State that gateway replicas share: in-flight counts and completed output tokens per pod.

Routing reads this on every request, so every read and write here is synchronous, O(1) and
in-memory. `LocalState` is the embedded default (one gateway, nothing leaves the process);
`RedisState` (in `redis_sync`) keeps the same counts and shares them through Redis from a
background loop, in AIBrix's key layout so mixed fleets agree. The fleet simulation implements the
same protocol in virtual time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from extproc.pool.pod import Pod, PodKey


class SharedState(Protocol):
    def add_running(self, pod: Pod, delta: int) -> None:
        """A request started (+1) or ended (-1) on `pod`. Never touches the network."""

    def add_tokens(self, pod: Pod, tokens: int) -> None:
        """Completed output tokens credited to `pod`. Never touches the network."""

    def running(self, key: PodKey) -> int:
        """In flight on the pod across every live gateway; this gateway's own share always current."""

    def routing_running(self, key: PodKey) -> int:
        """What routing counts in flight: `running`, plus, between syncs, this gateway's own recent
        starts echoed once per live peer (SyncCore.routing_running); `running` where counts are exact."""

    @property
    def peers(self) -> int:
        """Other live gateways whose choices `routing_running` echoes; 0 where none are heard."""

    def local_running(self, key: PodKey) -> int:
        """In flight on the pod through this gateway only."""

    def peer_changes(self) -> list[tuple[PodKey, int]]:
        """Other processes' in-flight changes since the last call, when they are known one by one
        (the workers of one `serve --workers N`); empty where counts arrive only as sums."""

    def take_token_deltas(self) -> dict[PodKey, int]:
        """Completed tokens per pod since the previous call; each token counted once."""

    def share_speed(self, key: PodKey, evidence: list[float]) -> None:
        """This gateway's own speed evidence on the pod (SpeedEstimator.export), for the others.
        Never touches the network: sent by the background sync."""

    def peer_speed(self) -> dict[PodKey, list[list[float]]]:
        """The other live gateways' speed evidence per pod, as last read; empty when not shared."""

    def track(self, pods: Iterable[Pod]) -> None:
        """The pool's pods: their shared counts are read even if this gateway never routes to them."""

    def forget(self, live: Iterable[PodKey]) -> None:
        """Drop pods no longer in the pool, except those with requests still in flight here."""

    def listen(self, origin: str) -> None:
        """Receive the access-log records other gateway processes got for requests `<origin>.…`."""

    def forward(self, owner: str, key: str, status: int) -> bool:
        """Pass a record of a request `owner` routed on to it; False when there is no way to."""

    def take_forwarded(self) -> list[tuple[str, int]]:
        """(request key, status) of this process's requests whose record another one received."""

    @property
    def up(self) -> bool:
        """True while counts are shared with other gateways."""

    async def run(self) -> None:
        """The background sync, for the server's lifetime (a task of its own); returns at once where
        nothing is synced from outside the process."""

    async def close(self) -> None:
        """At shutdown: leave the shared counts (others stop counting this gateway at once)."""


class LocalCounts:
    """This gateway's own counts: what `LocalState` is and what `RedisState` overlays."""

    __slots__ = ("pods", "running", "tokens", "completed", "_taken", "changed", "layout")

    def __init__(self) -> None:
        self.pods: dict[PodKey, Pod] = {}
        self.running: dict[PodKey, int] = {}
        self.tokens: dict[PodKey, int] = {}      # cumulative since start: idempotent to publish
        self.completed: dict[PodKey, int] = {}   # requests ended (AIBrix publishes it as "seq")
        self._taken: dict[PodKey, int] = {}      # tokens already handed out by take_local_deltas
        # Pods whose counts moved since the Redis sync last took them (a sync then looks at these
        # only, not at every pod), and a number that moves whenever the set of pods does.
        self.changed: set[PodKey] = set()
        self.layout = 0

    def _add(self, key: PodKey, pod: Pod) -> None:
        if key not in self.pods:
            self.pods[key] = pod
            self.layout += 1

    def take_changed(self) -> set[PodKey]:
        out, self.changed = self.changed, set()
        return out

    def add_running(self, pod: Pod, delta: int) -> None:
        key = pod.key
        self._add(key, pod)
        self.changed.add(key)
        # Clamped at 0, as AIBrix clamps: a stray decrement (a request routed by a previous
        # process) must not hide a real one started later.
        self.running[key] = max(0, self.running.get(key, 0) + delta)
        if delta < 0:
            self.completed[key] = self.completed.get(key, 0) - delta

    def add_tokens(self, pod: Pod, tokens: int) -> None:
        if tokens <= 0:
            return
        key = pod.key
        self._add(key, pod)
        self.changed.add(key)
        self.tokens[key] = self.tokens.get(key, 0) + tokens

    def track(self, pods: Iterable[Pod]) -> None:
        for pod in pods:
            if self.pods.get(pod.key) is not pod:
                self.pods[pod.key] = pod
                self.layout += 1

    def take_local_deltas(self) -> dict[PodKey, int]:
        out = {}
        for key, total in self.tokens.items():
            delta = total - self._taken.get(key, 0)
            if delta > 0:
                out[key] = delta
                self._taken[key] = total
        return out

    def mark_taken(self, key: PodKey, total: int) -> None:
        """Own tokens up to `total` were handed out by another path (the shared counter)."""
        if total > self._taken.get(key, 0):
            self._taken[key] = total

    def taken(self, key: PodKey) -> int:
        return self._taken.get(key, 0)

    def forget(self, live: Iterable[PodKey]) -> list[PodKey]:
        """Drop pods gone from the pool whose requests have all ended; returns the dropped keys."""
        live = set(live)
        gone = [k for k in self.pods if k not in live and self.running.get(k, 0) <= 0]
        for key in gone:
            for table in (self.pods, self.running, self.tokens, self.completed, self._taken):
                table.pop(key, None)
            self.changed.discard(key)
        self.layout += bool(gone)
        return gone


class LocalState:
    """Everything in-process: the single-gateway default."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts = LocalCounts()

    def add_running(self, pod: Pod, delta: int) -> None:
        self.counts.add_running(pod, delta)

    def add_tokens(self, pod: Pod, tokens: int) -> None:
        self.counts.add_tokens(pod, tokens)

    def running(self, key: PodKey) -> int:
        return self.counts.running.get(key, 0)

    def routing_running(self, key: PodKey) -> int:
        return self.counts.running.get(key, 0)

    peers = 0  # no one else routes

    def local_running(self, key: PodKey) -> int:
        return self.counts.running.get(key, 0)

    def peer_changes(self) -> list[tuple[PodKey, int]]:
        return []

    def take_token_deltas(self) -> dict[PodKey, int]:
        return self.counts.take_local_deltas()

    def share_speed(self, key: PodKey, evidence: list[float]) -> None:
        pass  # no one to share with

    def peer_speed(self) -> dict[PodKey, list[list[float]]]:
        return {}

    def track(self, pods: Iterable[Pod]) -> None:
        pass  # nothing to read from elsewhere

    def forget(self, live: Iterable[PodKey]) -> None:
        self.counts.forget(live)

    # Records of other gateway processes' requests: with no Redis there is no one to pass them to
    # (reconciliation against the engines' counts releases those requests).
    def listen(self, origin: str) -> None:
        pass

    def forward(self, owner: str, key: str, status: int) -> bool:
        return False

    def take_forwarded(self) -> list[tuple[str, int]]:
        return []

    @property
    def up(self) -> bool:
        return False  # never sharing

    async def run(self) -> None:
        pass  # nothing to sync

    async def close(self) -> None:
        pass


__all__ = ["LocalCounts", "LocalState", "SharedState"]
