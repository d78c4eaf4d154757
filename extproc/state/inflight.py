"""Requests routed and not yet finished, keyed by the gateway's own request key.

The response side reaches the gateway once per request (Envoy's access log), after the routing
stream has closed; this registry joins the two. `close` hands a request out exactly once, so the
in-flight count it carries is released exactly once whichever path ends it (access log, routing
stream cancelled before Envoy used the decision, expiry when a record never comes).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from extproc.openai import Request
from extproc.pool.pod import Pod


@dataclass(slots=True)
class OpenRequest:
    request: Request
    pod: Pod
    strategy: str
    request_id: str   # the client-visible id (x-request-id), for logs and headers
    started: float    # monotonic time of the routing decision


class OpenRequests:
    def __init__(self) -> None:
        self._open: dict[str, OpenRequest] = {}  # insertion order == start order: expiry pops the front

    def open(self, key: str, request: OpenRequest) -> None:
        self._open[key] = request

    def close(self, key: str) -> OpenRequest | None:
        return self._open.pop(key, None)

    def expired(self, deadline: float) -> Iterator[tuple[str, OpenRequest]]:
        """Close and yield the requests started before `deadline`."""
        while self._open:
            key, request = next(iter(self._open.items()))
            if request.started >= deadline:
                return
            del self._open[key]
            yield key, request

    def started_before(self, cutoffs: dict[object, float]) -> dict[object, list[str]]:
        """Keys of the requests on each pod of `cutoffs` started before that pod's cutoff, oldest
        first: one pass over the open requests whatever the number of pods."""
        out: dict[object, list[str]] = {k: [] for k in cutoffs}
        latest = max(cutoffs.values(), default=0.0)
        for key, request in self._open.items():
            if request.started >= latest:
                break  # start order: nothing later can be before any cutoff
            pod = request.pod.key
            if pod in cutoffs and request.started < cutoffs[pod]:
                out[pod].append(key)
        return out

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[OpenRequest]:
        return iter(list(self._open.values()))
