"""In-flight request counts per pod.

Every routing decision takes a Ticket; the ticket's release is idempotent, so whichever path ends the
request (end of stream, client abort, upstream reset, immediate error, shutdown) decrements exactly once.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from extproc.pool.pod import Pod


class Ticket:
    __slots__ = ("_counts", "key", "_gauge", "_open")

    def __init__(self, counts: dict[tuple[str, str], int], key: tuple[str, str], gauge: Gauge) -> None:
        self._counts = counts
        self.key = key
        self._gauge = gauge
        self._open = True

    def release(self) -> bool:
        """Decrement once; later calls do nothing. Returns whether this call decremented."""
        if not self._open:
            return False
        self._open = False
        self._counts[self.key] -= 1
        self._gauge.dec()
        return True


class InFlight:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._gauge = Gauge("extproc_pod_running_requests",
                            "Requests in flight per pod, counted by this gateway",
                            ["model", "pod"], registry=registry)

    def acquire(self, pod: Pod) -> Ticket:
        key = pod.key
        self._counts[key] = self._counts.get(key, 0) + 1
        gauge = self._gauge.labels(*key)
        gauge.inc()
        return Ticket(self._counts, key, gauge)

    def running(self, pod: Pod) -> int:
        return self._counts.get(pod.key, 0)

    def total(self) -> int:
        return sum(self._counts.values())
