"""The in-flight consumption ledger: per pod, the SLO load model's consumption of each request routed
there, so a pod's utilization is the sum over what it runs. Keyed by the Request object (alive in the
gateway's open-request table until its record), so the request that finishes takes its own consumption
away: shapes finish out of order."""

from __future__ import annotations

from itertools import islice

from extproc.pool.pod import Pod
from extproc.vocabulary import RequestRecord

LEDGER_LIMIT = 4096  # consumptions remembered per pod (the newest `running` of them are counted)

Entries = dict[int, "float | None"]  # id(routed Request) -> its consumption, oldest first

_MISSING = object()


class Ledger:
    __slots__ = ("pods",)

    def __init__(self) -> None:
        self.pods: dict[tuple, Entries] = {}  # pod key -> its entries

    def routed(self, pod: Pod, request: object, consumption: float | None) -> None:
        entries = self.pods.setdefault(pod.key, {})
        if len(entries) >= LEDGER_LIMIT:
            del entries[next(iter(entries))]
        entries[id(request)] = consumption

    def ended(self, record: RequestRecord) -> None:
        entries = self.pods.get(record.pod.key)
        if entries:
            if record.request is None or entries.pop(id(record.request), _MISSING) is _MISSING:
                del entries[next(iter(entries))]  # not routed here: the oldest goes

    def moved(self, request: object, chosen: Pod, served: Pod) -> None:
        """The request was served by another pod than chosen: its consumption goes with it."""
        entries = self.pods.get(chosen.key)
        if entries and (consumption := entries.pop(id(request), _MISSING)) is not _MISSING:
            self.routed(served, request, consumption)  # type: ignore[arg-type]

    def utilization(self, pod: Pod, running: int, fill: float) -> float:
        """Sum of the pod's in-flight consumptions. `running` (exact, across gateways) says how many;
        the newest that many recorded here are summed, requests this gateway did not see (another
        replica's) count as the mean of the known ones, else as `fill`."""
        if running <= 0:
            return 0.0
        entries = self.pods.get(pod.key)
        known = [c for c in islice(reversed(entries.values()), running) if c is not None] if entries else []
        mean = sum(known) / len(known) if known else fill
        return sum(known) + (running - len(known)) * mean
