"""A fast, OpenAI-shaped local upstream for the overhead benchmark (run as its own process).

Raw asyncio Protocol over HTTP/1.1 keep-alive: no framework, so what Envoy and the gateway add is not
hidden behind the upstream's own cost. Non-streaming requests get a JSON completion with `usage` at
once; streaming ones get SSE chat chunks at a fixed live pace (one token every `--itl-ms` per stream,
as an engine's decode loop sends them), then a usage-only chunk when the body asked for
`"include_usage":true`, then `data: [DONE]`.

    python -m extproc.perf.upstream --port 8000 [--itl-ms 20]

`GET /stats` returns its own counters (tokens sent, pacing lateness) so the benchmark can check
tallies against what was really sent and show the upstream is never the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import time

DEFAULT_ITL_MS = 20.0
DEFAULT_MAX_TOKENS = 16
_MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')
_STREAM = re.compile(rb'"stream"\s*:\s*true')
_INCLUDE_USAGE = re.compile(rb'"include_usage"\s*:\s*true')
# Engine-style metrics so a gateway that scrapes its pods sees an idle, healthy one.
_METRICS = (b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
            b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
            b"# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0\n")
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
             b"transfer-encoding: chunked\r\n\r\n")
# One pre-framed HTTP chunk per token: the same bytes every time, so the pacing loop only writes.
_TOKEN_EVENT = (b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,'
                b'"model":"bench","choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n')
_TOKEN_CHUNK = b"%x\r\n%s\r\n" % (len(_TOKEN_EVENT), _TOKEN_EVENT)
_DONE_EVENT = b"data: [DONE]\n\n"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _usage(prompt: int, output: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


def completion_body(output_tokens: int, prompt_tokens: int) -> bytes:
    return json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
        "choices": [{"index": 0, "finish_reason": "length",
                     "message": {"role": "assistant", "content": " tok" * output_tokens}}],
        "usage": _usage(prompt_tokens, output_tokens)}, separators=(",", ":")).encode()


def stream_tail(output_tokens: int, prompt_tokens: int, include_usage: bool) -> bytes:
    """Everything after the last token: the usage-only chunk (if asked), [DONE], the end of the body."""
    tail = b""
    if include_usage:
        usage = json.dumps({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                            "model": "bench", "choices": [], "usage": _usage(prompt_tokens, output_tokens)},
                           separators=(",", ":")).encode()
        tail += _chunk(b"data: " + usage + b"\n\n")
    return tail + _chunk(_DONE_EVENT) + b"0\r\n\r\n"


def _dechunk(buf: bytes, start: int) -> tuple[bytes, int] | None:
    """A chunked body from `start`: (the body, where the next request begins), or None while incomplete."""
    parts, at = [], start
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size = int(buf[at:eol].split(b";", 1)[0], 16)
        if size == 0:  # the last chunk, then trailers (none, or header lines) and an empty line
            done = buf.find(b"\r\n\r\n", eol) if buf[eol + 2:eol + 4] != b"\r\n" else eol
            return None if done < 0 else (b"".join(parts), done + 4)
        if len(buf) < eol + 2 + size + 2:
            return None
        parts.append(buf[eol + 2:eol + 2 + size])
        at = eol + 2 + size + 2


class Stats:
    __slots__ = ("requests", "streams", "tokens", "late_sum", "late_max", "late_n")

    def __init__(self) -> None:
        self.requests = 0
        self.streams = 0
        self.tokens = 0        # output tokens sent (JSON and SSE)
        self.late_sum = 0.0    # how late token writes ran behind their schedule
        self.late_max = 0.0
        self.late_n = 0

    def read(self) -> dict[str, float]:
        """Counters so far; the pacing lateness covers the time since the previous read."""
        out = {"requests": self.requests, "streams": self.streams, "tokens": self.tokens,
               "late_mean_ms": self.late_sum / self.late_n * 1e3 if self.late_n else 0.0,
               "late_max_ms": self.late_max * 1e3, "cpu_s": time.process_time(), "pid": os.getpid()}
        self.late_sum, self.late_max, self.late_n = 0.0, 0.0, 0
        return out


class Upstream(asyncio.Protocol):
    """One keep-alive connection. Requests are answered in order; a streaming one holds the line."""

    def __init__(self, stats: Stats, itl: float, pacer: Pacer) -> None:
        self._stats = stats
        self._pacer = pacer
        self._itl = itl
        self._buf = b""
        self._transport: asyncio.Transport | None = None
        self._busy = False  # a stream is being paced on this connection
        self._tail = b""   # the bytes after the last token of the stream in progress
        self._left = 0     # tokens still to send
        self._next = 0.0   # loop time the next token is due

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None  # a pending tick finds no transport and drops the stream

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while not self._busy:
            if not self._one():
                return

    def _one(self) -> bool:
        """Answer one complete request from the buffer; False when more bytes are needed."""
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = self._buf[:end].decode("latin-1")
        length, chunked = 0, False
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value.lower()
        if chunked:  # Envoy forwards a full-duplex (ext_proc) body chunked: the client's length is gone
            read = _dechunk(self._buf, end + 4)
            if read is None:
                return False
            body, rest = read
            length = len(body)
        else:
            if len(self._buf) < end + 4 + length:
                return False
            body, rest = self._buf[end + 4:end + 4 + length], end + 4 + length
        self._buf = self._buf[rest:]
        method, path = head.split(" ", 2)[:2]
        assert self._transport is not None
        if method == "GET":
            status, payload, ctype = "200 OK", b"{}", b"application/json"
            if path == "/stats":
                payload = json.dumps(self._stats.read()).encode()
            elif path == "/metrics":
                payload, ctype = _METRICS, b"text/plain; version=0.0.4"
            elif path not in ("/health", "/"):
                status, payload = "404 Not Found", b"{}"
            self._transport.write(b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                                  % (status.encode(), ctype, len(payload), payload))
            return True
        self._stats.requests += 1
        found = _MAX_TOKENS.search(body)
        tokens = int(found.group(1)) if found else DEFAULT_MAX_TOKENS
        prompt = max(1, length // 4)
        if _STREAM.search(body):
            self._start_stream(tokens, prompt, bool(_INCLUDE_USAGE.search(body)))
            return True
        payload = completion_body(tokens, prompt)
        self._stats.tokens += tokens
        self._transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                              % (len(payload), payload))
        return True

    def _start_stream(self, tokens: int, prompt: int, include_usage: bool) -> None:
        # The first token goes out at once (no prefill modelled), then one every `itl`, on an absolute
        # schedule so a late write does not push every later token back.
        self._stats.streams += 1
        self._busy = True
        self._tail = stream_tail(tokens, prompt, include_usage)
        self._left = tokens
        self._next = self._pacer.loop.time()
        assert self._transport is not None
        self._transport.write(_SSE_HEAD)
        self.tick(self._next)

    def tick(self, now: float) -> None:
        """Write the next token (the pacer calls this when it is due)."""
        transport = self._transport
        if transport is None:
            return
        stats = self._stats
        late = now - self._next
        if late > 0:
            stats.late_sum += late
            stats.late_n += 1
            if late > stats.late_max:
                stats.late_max = late
        self._left -= 1
        stats.tokens += 1
        if self._left > 0:
            transport.write(_TOKEN_CHUNK)
            self._next += self._itl
            self._pacer.schedule(self, self._next)
            return
        transport.write(_TOKEN_CHUNK + self._tail)
        self._busy = False
        if self._buf:  # a pipelined request waited behind the stream
            self.data_received(b"")


class Pacer:
    """A timer wheel of 1 ms slots: one loop timer per slot, not one per token.

    asyncio's per-token call_at (heap push/pop, TimerHandle compare) cost a third of the upstream's
    CPU at 500 streams; due times are rounded up to the next millisecond instead.
    """

    RESOLUTION = 0.001

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._slots: dict[int, list[Upstream]] = {}
        self._armed: int | None = None  # the slot the loop timer is set for

    def schedule(self, conn: Upstream, due: float) -> None:
        slot = math.ceil(due / self.RESOLUTION)
        bucket = self._slots.get(slot)
        if bucket is None:
            self._slots[slot] = [conn]
            if self._armed is None or slot < self._armed:
                self._arm(slot)
        else:
            bucket.append(conn)

    def _arm(self, slot: int) -> None:
        self._armed = slot
        self.loop.call_at(slot * self.RESOLUTION, self._fire, slot)

    def _fire(self, slot: int) -> None:
        if slot != self._armed:
            return  # superseded by an earlier slot's timer
        self._armed = None
        now = self.loop.time()
        current = math.floor(now / self.RESOLUTION)
        for due in sorted(k for k in self._slots if k <= current):
            for conn in self._slots.pop(due):
                conn.tick(now)
        if self._slots:
            self._arm(min(self._slots))


async def _serve(host: str, port: int, itl: float) -> None:
    loop = asyncio.get_running_loop()
    stats, pacer = Stats(), Pacer(loop)
    server = await loop.create_server(lambda: Upstream(stats, itl, pacer), host, port, backlog=4096,
                                      reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--itl-ms", type=float, default=DEFAULT_ITL_MS, help="gap between streamed tokens")
    args = parser.parse_args(argv)
    try:
        import uvloop  # optional: a faster loop when installed
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(args.host, args.port, args.itl_ms / 1e3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
