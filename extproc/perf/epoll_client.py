"""A closed-loop HTTP/1.1 load client on raw epoll: C keep-alive connections for a fixed duration.

Why not asyncio or aiohttp: their tens of microseconds per read would be charged to the path under
test (and the client shares two cores with it). Here each ready socket costs one `recv`, all data of
one wake-up gets that wake-up's timestamp, and responses are parsed just enough to know where they
end (Content-Length or chunked) and when each streamed token arrived.
"""

from __future__ import annotations

import errno
import json
import random
import select
import socket
import time
from dataclasses import dataclass, field

TOKEN_MARKER = b'"content":"'  # one per streamed chat chunk carrying text
USAGE_MARKER = b'"usage"'
_CARRY = max(len(TOKEN_MARKER), len(USAGE_MARKER)) - 1
CHAT_PATH = "/v1/chat/completions"


@dataclass(slots=True, frozen=True)
class Target:
    """Where to send, and any extra headers (the destination header when Envoy routes alone)."""

    port: int
    headers: tuple[tuple[str, str], ...] = ()
    host: str = "127.0.0.1"
    include_usage: bool = False  # streaming bodies ask for usage themselves (what the gateway would add)


def request_bytes(target: Target, model: str, stream: bool, max_tokens: int) -> bytes:
    fields: dict[str, object] = {"model": model, "stream": stream, "max_tokens": max_tokens}
    if stream and target.include_usage:
        fields["stream_options"] = {"include_usage": True}
    fields["messages"] = [{"role": "user", "content": "Say this is a test!"}]
    body = json.dumps(fields, separators=(",", ":")).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in target.headers)
    head = (f"POST {CHAT_PATH} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n")
    return head.encode() + body


@dataclass(slots=True)
class LoadResult:
    concurrency: int
    window_s: float                                       # the measured window (after warm-up)
    latencies: list[float] = field(default_factory=list)  # s, requests completed in the window
    ttft: list[float] = field(default_factory=list)       # s, first token of streams started in the window
    gaps: list[float] = field(default_factory=list)       # s, inter-token gaps of tokens in the window
    tokens_window: int = 0                                # tokens that arrived in the window
    tokens: int = 0                                       # all tokens received, warm-up and drain included
    completed: int = 0                                    # all complete 200 responses
    errors: dict[str, int] = field(default_factory=dict)  # status or exception -> count
    usage_leaked: int = 0                                 # usage chunks the client never asked for
    client_cpu_s: float = 0.0

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.window_s if self.window_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_window / self.window_s if self.window_s > 0 else 0.0


class _Conn:
    """One keep-alive connection and the response being read on it."""

    __slots__ = ("sock", "fd", "sent_at", "buf", "status", "chunked", "need", "in_body", "first",
                 "last", "carry", "n_tokens", "start_at", "expect")

    def __init__(self, start_at: float) -> None:
        self.sock: socket.socket | None = None
        self.fd = -1
        self.start_at = start_at  # when this connection sends its first request
        self.reset(0.0, 0)

    def reset(self, now: float, expect: int) -> None:
        self.expect = expect  # output tokens asked for
        self.sent_at = now
        self.buf = b""
        self.status = 0
        self.chunked = False
        self.need = -1        # body bytes still expected (Content-Length) or -1: read the next chunk size
        self.in_body = False
        self.first = 0.0      # first token's arrival
        self.last = 0.0       # previous token's arrival
        self.carry = b""      # the decoded body's tail: a marker may straddle two reads
        self.n_tokens = 0


def run_load(target: Target, *, concurrency: int, duration: float, stream: bool,
             max_tokens: int | tuple[int, int], warmup: float = 0.0, stagger: float = 0.0,
             model: str = "bench", drain_timeout: float = 30.0, seed: int = 1) -> LoadResult:
    """Closed loop: each of `concurrency` connections sends its next request when the last ends.

    No new request starts after `warmup + duration`; those in flight are drained (their tokens count
    in `tokens`, for tally checks). Connection i starts at i * stagger / concurrency, so paced streams
    do not all tick in the same millisecond. `max_tokens` as (low, high) draws each request's length
    uniformly: equal lengths at a fixed pace keep streams in lock-step cohorts that all end, and all
    ask to be routed again, in the same few milliseconds.
    """
    low, high = (max_tokens, max_tokens) if isinstance(max_tokens, int) else max_tokens
    payloads = {t: request_bytes(target, model, stream, t) for t in range(low, high + 1)}
    rng = random.Random(seed)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    w0, deadline = t0 + warmup, t0 + warmup + duration
    result = LoadResult(concurrency=concurrency, window_s=duration)
    pending = [_Conn(t0 + i * stagger / concurrency) for i in range(concurrency)]
    pending.reverse()  # pop() from the end gives the earliest start
    conns: dict[int, _Conn] = {}
    ep = select.epoll()

    def error(kind: str) -> None:
        result.errors[kind] = result.errors.get(kind, 0) + 1

    def send(conn: _Conn, now: float) -> bool:
        if conn.sock is None:
            sock = socket.create_connection((target.host, target.port), timeout=5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            conn.sock, conn.fd = sock, sock.fileno()
            conns[conn.fd] = conn
            ep.register(conn.fd, select.EPOLLIN)
        tokens = rng.randint(low, high)
        payload = payloads[tokens]
        conn.reset(now, tokens)
        try:
            # A request is < 1 KB: it always fits the socket buffer of an idle keep-alive connection.
            if conn.sock.send(payload) != len(payload):
                raise OSError(errno.EAGAIN, "short send")
        except OSError as exc:
            error(type(exc).__name__)
            close(conn)
            return False
        return True

    def close(conn: _Conn) -> None:
        if conn.sock is not None:
            conns.pop(conn.fd, None)
            ep.unregister(conn.fd)
            conn.sock.close()
            conn.sock, conn.fd = None, -1

    def body(conn: _Conn, data: bytes, now: float) -> None:
        """Decoded body bytes arrived at `now`: count tokens and leaked usage chunks."""
        if not stream:
            return
        seen = conn.carry + data
        n = seen.count(TOKEN_MARKER) - conn.carry.count(TOKEN_MARKER)
        if USAGE_MARKER in seen and USAGE_MARKER not in conn.carry:
            result.usage_leaked += 1
        conn.carry = seen[-_CARRY:]
        if not n:
            return
        result.tokens += n
        conn.n_tokens += n
        in_window = w0 <= now <= deadline
        if in_window:
            result.tokens_window += n
        if conn.first == 0.0:  # the first token: time to first token, not a gap
            conn.first = now
            if conn.sent_at >= w0 and now <= deadline:
                result.ttft.append(now - conn.sent_at)
        elif in_window:
            result.gaps.append(now - conn.last)
        if in_window and n > 1:
            result.gaps.extend([0.0] * (n - 1))  # tokens coalesced into one read: a gap of zero each
        conn.last = now

    def feed(conn: _Conn, data: bytes, now: float) -> bool:
        """Parse what arrived; True when the response is complete."""
        conn.buf += data
        if not conn.in_body:
            end = conn.buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            head = conn.buf[:end].decode("latin-1").lower().split("\r\n")
            conn.buf = conn.buf[end + 4:]
            conn.status = int(head[0][9:12])
            conn.in_body = True
            conn.need = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name == "transfer-encoding" and "chunked" in value:
                    conn.chunked, conn.need = True, -1
                elif name == "content-length":
                    conn.need = int(value)
        if not conn.chunked:
            if len(conn.buf) < conn.need:
                return False
            body(conn, conn.buf[:conn.need], now)
            conn.buf = conn.buf[conn.need:]
            return True
        while True:
            if conn.need < 0:
                line_end = conn.buf.find(b"\r\n")
                if line_end < 0:
                    return False
                size = int(conn.buf[:line_end].split(b";", 1)[0], 16)
                if size == 0:  # last chunk; we never ask for trailers
                    if conn.buf.find(b"\r\n\r\n", line_end) < 0:
                        return False
                    conn.buf = b""
                    return True
                conn.buf = conn.buf[line_end + 2:]
                conn.need = size
            if len(conn.buf) < conn.need + 2:
                return False
            body(conn, conn.buf[:conn.need], now)
            conn.buf = conn.buf[conn.need + 2:]
            conn.need = -1

    def finish(conn: _Conn, now: float) -> None:
        if conn.status == 200 and stream and conn.n_tokens != conn.expect:
            error("short stream")
        elif conn.status == 200:
            result.completed += 1
            if w0 <= now <= deadline:
                result.latencies.append(now - conn.sent_at)
        else:
            error(str(conn.status))
        if now < deadline:
            send(conn, now)
        else:
            close(conn)

    drain_end = deadline + drain_timeout
    try:
        while True:
            now = time.perf_counter()
            while pending and pending[-1].start_at <= now and now < deadline:
                send(pending.pop(), now)
            if not conns and (not pending or now >= deadline):
                break
            if now > drain_end:
                error("drain timeout")
                break
            timeout = 0.2
            if pending and now < deadline:
                timeout = max(0.0, min(timeout, pending[-1].start_at - now))
            events = ep.poll(timeout)
            now = time.perf_counter()
            for fd, _ in events:
                conn = conns.get(fd)
                if conn is None or conn.sock is None:
                    continue
                try:
                    data = conn.sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    error(type(exc).__name__)
                    close(conn)
                    continue
                if not data:  # a request is always outstanding: the peer closed on it
                    error("closed")
                    close(conn)
                    if now < deadline:
                        send(conn, now)
                    continue
                try:
                    done = feed(conn, data, now)
                except ValueError:
                    error("bad response")
                    close(conn)
                    continue
                if done:
                    finish(conn, now)
    finally:
        for conn in list(conns.values()):
            close(conn)
        ep.close()
    result.client_cpu_s = time.process_time() - cpu0
    return result
