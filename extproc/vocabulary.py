"""The values the routing core, the SLO router and the sharing layer exchange, at the bottom of the
house (they import only `pool` and, for types, `openai`): `PodView` (one pod as one decision sees it),
`Snapshot` (a model's views between rebuilds), `Speed` (one replica's fitted speed), `RequestEnd` (how
a request ended, as Envoy's access log reports it) and `RequestRecord` (one finished request, the
post-response hooks' input). Routing, the SLO router and `state/` import them; they import none of those."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from extproc.pool.pod import Pod

if TYPE_CHECKING:
    from extproc.openai import Request

# How output_tokens was obtained: the engine's own usage report, counted content-bearing stream
# events (no usage in the response), or not at all (compressed or unparsable body, cut before usage).
TOKENS_FROM_USAGE = "usage"
TOKENS_COUNTED = "counted"
TOKENS_UNKNOWN = "unknown"

UNKNOWN_SPREAD = 1.0  # a pod known only from nothing: every score within e^2 of the best ties


@dataclass(slots=True, frozen=True)
class Speed:
    """One replica's fitted speed. `saturated`: output tokens/s with `batch` requests in flight,
    the batch the replica saturates at (engine limit or KV cache), for dashboards and the gate.
    `spread`: the standard error of `base` on a log scale (0.05: ±5 %): scores closer than the
    estimates' spreads are ties (routing/load_balance.py)."""

    base: float           # seconds per output token with no other request in flight
    shape: float          # relative slowdown per request in flight
    saturated: float
    batch: float
    spread: float = 0.0

    def tpot(self, batch: float) -> float:
        return self.base * (1.0 + self.shape * batch)

    def rate(self, batch: float) -> float:
        """Output tokens/s draining `batch` requests: the capacity at that load."""
        return batch / self.tpot(batch) if batch > 0 else 0.0


@dataclass(slots=True)
class RequestEnd:
    """How a routed request ended, as Envoy's access-log record says (server/access_log.py; the fleet
    simulation's engine and a pool's response headers say the same): one value from the parser to
    `Gateway.complete`, which adds what it knows of the request and hands its hooks a RequestRecord.
    Made once per record and never changed; not frozen, because a frozen dataclass's __init__ cost
    ~0.8 µs more per record (docs/benchmarks.md, issue 42).
    """

    status: int                       # HTTP status sent to the client; 0 when none was (aborted early)
    prompt_tokens: int | None = None  # None: not reported (the request's own estimate stands)
    output_tokens: int | None = None  # None when unknown: adds nothing to capacity
    token_source: str = TOKENS_UNKNOWN
    # From the request's first byte at Envoy (the access log's intervals, so a wait in the SLO queue is
    # in both) to the first response byte from the pod, and to the last byte sent to the client.
    ttfb_s: float | None = None
    e2e_s: float | None = None        # None: the gateway's own clock, from the routing decision
    connect_failure: bool = False     # the pod refused or reset the connection before answering
    aborted: bool = False             # the client went away, or the stream was reset mid-body
    upstream: str = ""                # the pod as Envoy reached it ("host:port"): credits a peer's record

    @classmethod
    def released(cls) -> RequestEnd:
        """No record at all: the routing stream was cancelled before Envoy used the decision, or the
        record never came (the engine's count, or the timeout, said the request was gone)."""
        return cls(0, aborted=True)



@dataclass(slots=True, frozen=True)
class RequestRecord:
    request_id: str
    model: str
    pod: Pod
    strategy: str
    status: int                  # HTTP status sent to the client; 0 when none was (aborted early)
    prompt_tokens: int | None
    output_tokens: int | None    # None when unknown: adds nothing to capacity
    token_source: str
    ttfb_s: float | None         # the request's first byte at Envoy to the first response byte (RequestEnd)
    e2e_s: float                 # to the last byte sent to the client
    connect_failure: bool = False  # the pod refused or reset the connection before answering
    aborted: bool = False          # the client went away, or the stream was reset mid-body
    stream: bool = False
    request: Request | None = None  # the routed request itself (None: not routed by this gateway)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 400 and not self.aborted


@dataclass(slots=True)
class PodView:
    """A snapshot of one pod as routing sees it for one decision."""

    pod: Pod
    running: int = 0                    # in flight, counted across every gateway replica
    queued: float = 0.0                 # waiting inside the engine (engine metric)
    kv_free: float | None = None        # free fraction of the GPU KV cache; None: not reported
    cpu_kv_usage: float | None = None   # used fraction of the CPU (swap/offload) KV cache
    capacity: float | None = None       # learned output tokens/s (already mean-filled for new pods)
    healthy: bool = True
    speed: Speed | None = None          # time per token against load (capacity: speed); None: unknown

    @property
    def gpu(self) -> str:
        return self.pod.gpu

    @property
    def deployment(self) -> str:
        return self.pod.deployment


class Snapshot(list[PodView]):
    """PodViews whose fields other than `running` and `healthy` do not change while it lives."""

    __slots__ = ("memo",)

    def __init__(self, views: Iterable[PodView] = ()) -> None:
        super().__init__(views)
        self.memo: dict[Any, Any] = {}
