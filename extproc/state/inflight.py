"""In-flight request counts per pod.

Every routing decision takes a Ticket; the ticket's release is idempotent, so whichever path ends the
request (end of stream, client abort, upstream reset, immediate error, shutdown) decrements exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Gauge

from extproc.pool.pod import Pod

Key = tuple[str, str]  # (model, pod name)


class Ticket:
    __slots__ = ("_owner", "key", "_open")

    def __init__(self, owner: InFlight, key: Key) -> None:
        self._owner = owner
        self.key = key
        self._open = True

    def release(self) -> bool:
        """Decrement once; later calls do nothing. Returns whether this call decremented."""
        if not self._open:
            return False
        self._open = False
        self._owner._release(self.key)
        return True


class InFlight:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._counts: dict[Key, int] = {}
        self._retired: set[Key] = set()  # pods gone from the pool, forgotten once their count is 0
        self._gauge = Gauge("extproc_pod_running_requests",
                            "Requests in flight per pod, counted by this gateway",
                            ["model", "pod"], registry=registry)

    def acquire(self, pod: Pod) -> Ticket:
        key = pod.key
        self._counts[key] = self._counts.get(key, 0) + 1
        self._gauge.labels(*key).inc()
        return Ticket(self, key)

    def _release(self, key: Key) -> None:
        left = self._counts[key] = self._counts[key] - 1
        self._gauge.labels(*key).dec()
        if left == 0 and key in self._retired:
            self._forget(key)

    def retain(self, live: Iterable[Key]) -> None:
        """After a pool change: drop the series of pods that are gone (at once if idle, else when idle),
        so pod churn does not grow the metrics or this map without bound."""
        live = set(live)
        self._retired = {k for k in self._counts if k not in live}
        for key in [k for k in self._retired if self._counts[k] == 0]:
            self._forget(key)

    def _forget(self, key: Key) -> None:
        del self._counts[key]
        self._retired.discard(key)
        self._gauge.remove(*key)

    def running(self, pod: Pod) -> int:
        return self._counts.get(pod.key, 0)

    def total(self) -> int:
        return sum(self._counts.values())
