"""What the gateway learns from one finished request: the post-response hooks' input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from extproc.pool.pod import Pod

if TYPE_CHECKING:
    from extproc.openai import Request

# How output_tokens was obtained: the engine's own usage report, counted content-bearing stream
# events (no usage in the response), or not at all (compressed or unparsable body, cut before usage).
TOKENS_FROM_USAGE = "usage"
TOKENS_COUNTED = "counted"
TOKENS_UNKNOWN = "unknown"


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
    ttfb_s: float | None         # routing decision to the first response byte from the pod
    e2e_s: float                 # routing decision to the last byte sent to the client
    connect_failure: bool = False  # the pod refused or reset the connection before answering
    aborted: bool = False          # the client went away, or the stream was reset mid-body
    stream: bool = False
    request: Request | None = None  # the routed request itself (None: not routed by this gateway)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 400 and not self.aborted
