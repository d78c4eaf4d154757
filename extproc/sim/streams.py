"""Token delivery inside the simulator: where the engine loop leaves each responder's tokens, the direct
socket sink that writes them as HTTP chunks from the loop, why a stream ended early, and how late
deliveries were. The server (server.py) drives these; they know nothing of the engine."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aiohttp import web

from extproc.sim.protocol import DONE, ChunkFormatter, error_body, error_event, http_chunk
from extproc.sim.sequences import SeqState

MAX_UNREAD_BYTES = 4 * 1024 * 1024  # a client this far behind stopped reading: its connection is dropped


def json_error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: Any = None,
) -> web.Response:
    return web.json_response(error_body(message, type_, param, code), status=status)


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """Why a stream ended without finishing: an OpenAI error (JSON body, or an SSE event once streaming)."""

    status: int
    type_: str
    message: str

    def response(self) -> web.Response:
        return json_error(self.status, self.message, self.type_, None, self.status)

    def event(self) -> bytes:
        return error_event(self.message, self.type_, self.status)


KV_DROPPED = Failure(
    503, "ServiceUnavailableError", "request dropped: it no longer fits in the KV cache (kv_pressure fault)"
)
SHUTTING_DOWN = Failure(503, "ServiceUnavailableError", "the engine is shutting down")
CONNECTION_BROKEN = Failure(500, "InternalServerError", "the simulator could not write to this connection")
ENGINE_DIED = Failure(500, "InternalServerError", "the engine loop died; see the simulator's log")


class Lateness:
    """Histogram of delivery lateness in 0.1 ms buckets (the server's own share of token timing error)."""

    __slots__ = ("counts",)
    BUCKET_S = 0.0001

    def __init__(self) -> None:
        self.counts = [0] * 1001  # last bucket: >= 100 ms

    def add(self, seconds: float) -> None:
        self.counts[min(1000, max(0, int(seconds / self.BUCKET_S)))] += 1

    def summary(self) -> dict[str, float]:
        total = sum(self.counts)
        out: dict[str, float] = {"n": total}
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            seen, target = 0, q * total
            for i, c in enumerate(self.counts):
                seen += c
                if total and seen >= target:
                    out[name] = round(i * self.BUCKET_S * 1e3, 1)
                    break
        return out


class DirectSink:
    """Fast path: the engine loop writes a stream's events straight to its socket as HTTP chunks.

    Why: waking one handler task per token per stream costs tens of microseconds; at 500 streams that is a
    ~20 ms burst per step whose order shifts from step to step, i.e. per-token jitter. Writing from the
    engine loop keeps every token within a few ms of its step's end, in the same order every step.
    aiohttp has sent the headers with chunked encoding on, and writes the last chunk at write_eof().
    """

    __slots__ = ("transport", "fmt", "written", "last", "finish_reason", "include_usage", "prompt_tokens")

    def __init__(
        self,
        transport: asyncio.BaseTransport,
        fmt: ChunkFormatter,
        last: int,
        finish_reason: str,
        include_usage: bool,
        prompt_tokens: int,
    ) -> None:
        self.transport: Any = transport
        self.fmt, self.last, self.finish_reason = fmt, last, finish_reason
        self.include_usage, self.prompt_tokens = include_usage, prompt_tokens
        self.written = 0

    def _write(self, data: bytes) -> None:
        t = self.transport
        if t.is_closing():
            return
        if t.get_write_buffer_size() > MAX_UNREAD_BYTES:
            t.abort()  # the client stopped reading; don't buffer without bound
            return
        t.write(http_chunk(data))

    def emit(self, tokens: int) -> None:
        if tokens > self.written:
            data = self.fmt.tokens(self.written, tokens, self.last, self.finish_reason)
            self.written = tokens
            self._write(data)

    def finish(self, failure: Failure | None = None) -> None:
        if failure is not None:
            tail = failure.event()
        else:
            tail = self.fmt.usage(self.prompt_tokens, self.written) if self.include_usage else b""
        self._write(tail + DONE)


class TokenStream:
    """Where the engine loop leaves tokens for one responder."""

    __slots__ = ("tokens", "done", "failure", "seq", "waiter", "stamps", "sink", "transport")

    def __init__(self, record: bool, transport: asyncio.BaseTransport | None) -> None:
        self.sink: DirectSink | None = None
        self.transport = transport  # to drop the connection on shutdown
        self.tokens = 0
        self.done = False
        self.failure: Failure | None = None  # set with done when the request ended without finishing
        self.seq: SeqState | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.stamps: list[float] | None = [] if record else None

    def fail(self, failure: Failure) -> None:
        """End the stream with an error: the sink writes it now, a handler when it wakes."""
        if self.done:
            return
        self.done, self.failure = True, failure
        if self.sink is not None:
            self.sink.finish(failure)
        self.notify()

    def notify(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
