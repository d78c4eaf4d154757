"""What routing a request comes to, as data: `Routed` (a pod, and the gateway's key for the request),
`Queued` (held back until a pod has room), `Rejected` (a 429 with Retry-After).

A strategy's pick returns a PodView, or `Queued` / `Rejected` when it holds the request back; the
gateway passes those on unchanged, and whoever owns the waiting (the live server's asyncio shell, the
fleet simulation's event loop) hands them to the same pure waiting room (extproc.slo.room).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.pool.pod import Pod


@dataclass(slots=True, frozen=True)
class Routed:
    pod: Pod
    key: str  # the gateway's own key for this request; the access log brings it back


@dataclass(slots=True, frozen=True)
class Queued:
    """The request waits for room. `entry` is the holding strategy's queue entry (extproc.slo.queue.Entry),
    opaque to routing."""

    entry: Any


@dataclass(slots=True, frozen=True)
class Rejected:
    """The request is refused with a 429: `reason` is the error code (slo_breached, queue_full)."""

    reason: str
    retry_after: float  # seconds suggested to the client (Retry-After)
    # the deployments that could have served it within its SLO: the GPU optimizer counts the refusal as
    # a miss of theirs (the plan left them short), through the gateway's post_reject hooks
    deployments: frozenset[str] = frozenset()


Outcome = Routed | Queued | Rejected | None  # None: no ready pod (a 503)
