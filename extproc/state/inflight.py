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
    # When it ended, as far as the gateway knows (set when closed): the routing decision plus
    # Envoy's duration from its record, else the time it was released. Reconciliation asks
    # whether a request closed since a scrape was still in the engine when it was read.
    ended: float | None = None


class OpenRequests:
    def __init__(self) -> None:
        self._open: dict[str, OpenRequest] = {}  # insertion order == start order: expiry pops the front

    def open(self, key: str, request: OpenRequest) -> None:
        self._open[key] = request

    def get(self, key: str) -> OpenRequest | None:
        return self._open.get(key)

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

    def on_pod(self, pod: object, before: float) -> list[tuple[str, OpenRequest]]:
        """The requests on one pod started before `before`, with their keys, oldest first."""
        out = []
        for key, request in self._open.items():
            if request.started >= before:
                break  # start order
            if request.pod.key == pod:
                out.append((key, request))
        return out

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[OpenRequest]:
        return iter(list(self._open.values()))
