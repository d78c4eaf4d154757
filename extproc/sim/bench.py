"""`python -m extproc.sim.bench`: can one engine-sim process keep per-token timing under load?

Starts `extproc engine-sim` as a subprocess (with --record-timeline), fires N concurrent streaming
completions with aiohttp, timestamps every token chunk on arrival, then compares each inter-token gap
with the gap the engine model says it should be (the sum of the step durations in between, divided by
the time scale). Prints the median / p90 / p99 relative error and what limits it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from extproc.die_with_parent import popen
from extproc.localstack import free_port

DEADLINE_S = 30.0


MARKER = b"data: {"
DONE_MARKER = b"data: [DONE]"
_ID = re.compile(rb'"id": "([^"]*)",')
_MAX_HEAD = 64 * 1024  # the id is in the first event; stop collecting for it after this much


@dataclass(slots=True)
class Trace:
    request_id: str = ""
    times: list[float] = field(default_factory=list)
    error: str | None = None
    done: bool = False  # saw data: [DONE]
    _carry: bytes = b""  # the previous read's tail: a marker may straddle two reads
    _head: bytes = b""  # what arrived before the id was complete

    def feed(self, data: bytes, now: float) -> None:
        """Timestamp every SSE event in this read (made at `now`)."""
        seen = self._carry + data
        n = seen.count(MARKER) - self._carry.count(MARKER)  # markers wholly in the carry were counted
        if n:
            self.times.extend([now] * n)
        if not self.request_id and len(self._head) < _MAX_HEAD:
            # Only a complete `"id": "...",` counts: a read may end inside the id.
            self._head += data
            m = _ID.search(self._head)
            if m:
                self.request_id, self._head = m.group(1).decode(), b""
        if DONE_MARKER in seen:
            self.done = True
        self._carry = seen[-(len(DONE_MARKER) - 1) :]  # the longer marker: neither is missed or counted twice


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine-sim exited with {proc.returncode}")
            try:
                async with http.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)  # poll interval; readiness is decided by /health
    raise TimeoutError("engine-sim did not become healthy")


async def _one(http: aiohttp.ClientSession, url: str, body: bytes, trace: Trace) -> None:
    try:
        async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                trace.error = f"HTTP {resp.status}"
                return
            # Whole reads, not lines: one timestamp per read keeps the client's own cost per event low.
            async for data in resp.content.iter_any():
                trace.feed(data, time.monotonic())
    except aiohttp.ClientError as e:
        trace.error = repr(e)


def _run_epoll_client(port: int, bodies: list[bytes], traces: list[Trace], deadline_s: float = 600.0) -> None:
    """A minimal blocking HTTP/1.1 client on epoll: one timestamp per poll wake-up, SSE events counted.

    Why not asyncio or aiohttp for the measurement: their per-read cost (tens of microseconds) makes a
    500-socket burst take ~15 ms to drain, and that spread would be charged to the simulator. Here each
    ready socket costs one recv, and all data in one wake-up gets the wake-up's time (when it had arrived).
    `--client aiohttp` measures through aiohttp instead.
    """
    import select
    import socket

    def request(body: bytes) -> bytes:
        return (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body

    ep = select.epoll()
    conns: dict[int, list] = {}  # fd -> [socket, trace, request bytes (sent: b"")]
    for trace, body in zip(traces, bodies):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        ep.register(sock.fileno(), select.EPOLLOUT)
        conns[sock.fileno()] = [sock, trace, request(body)]
    end = time.monotonic() + deadline_s
    try:
        while conns and time.monotonic() < end:
            events = ep.poll(1.0)
            now = time.monotonic()
            for fd, ev in events:
                conn = conns[fd]
                sock, trace = conn[0], conn[1]
                if conn[2]:
                    data, conn[2] = conn[2], b""
                    try:
                        sock.sendall(data)
                    except OSError as e:
                        trace.error = repr(e)
                        _close(ep, conns, fd)
                        continue
                    ep.modify(fd, select.EPOLLIN)
                    continue
                try:
                    data = sock.recv(1 << 16)
                except OSError as e:
                    trace.error = repr(e)
                    data = b""
                if not data:
                    _close(ep, conns, fd)
                    continue
                trace.feed(data, now)
                if trace.done:
                    _close(ep, conns, fd)
    finally:
        for fd in list(conns):
            conns[fd][1].error = conns[fd][1].error or "deadline"
            _close(ep, conns, fd)
        ep.close()


def _close(ep: Any, conns: dict[int, list], fd: int) -> None:
    sock = conns.pop(fd)[0]
    ep.unregister(fd)
    sock.close()


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process from /proc (Linux); 0 where unavailable."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace) -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="engine-sim-bench-", suffix=".log", delete=False)
    cmd = [
        sys.executable,
        "-m",
        "extproc",
        "--log-level",
        "WARNING",
        "engine-sim",
        "--gpu",
        args.gpu,
        "--model",
        args.model,
        "--port",
        str(port),
        "--time-scale",
        str(args.time_scale),
        "--record-timeline",
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    proc = popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        await _wait_healthy(url, proc)
        # Distinct prompts (the index leads), so the prefix cache does not turn prefill into a no-op.
        bodies = [
            json.dumps(
                {
                    "model": args.model,
                    "prompt": f"{i:08d} " + "x" * (4 * args.prompt_tokens - 9),
                    "max_tokens": args.max_tokens,
                    "stream": True,
                }
            ).encode()
            for i in range(args.concurrency)
        ]
        traces = [Trace() for _ in range(args.concurrency)]
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
        started = time.monotonic()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            if args.client == "raw":
                _run_epoll_client(port, bodies, traces)
            else:
                await asyncio.gather(
                    *(_one(http, url + "/v1/completions", b, t) for b, t in zip(bodies, traces))
                )
            wall = time.monotonic() - started
            async with http.get(url + "/sim/timeline") as resp:
                timeline = await resp.json()
            async with http.get(url + "/sim/info") as resp:
                info = await resp.json()
        info["server_cpu_s"] = _cpu_seconds(proc.pid)
        info["client_cpu_s"] = time.process_time()
    finally:
        proc.terminate()
        proc.wait(10)
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump({"traces": [[t.request_id, t.times] for t in traces], "timeline": timeline}, f)
    return report(args, traces, timeline, info, wall)


def report(args: argparse.Namespace, traces: list[Trace], timeline: dict, info: dict, wall: float) -> int:
    scale = timeline["time_scale"]
    errors, expected_all, measured_all = [], [], []
    failed = [t for t in traces if t.error or len(t.times) != args.max_tokens]
    for t in traces:
        stamps = timeline["timelines"].get(t.request_id)
        if t.error or not stamps or len(stamps) != len(t.times):
            continue
        for i in range(1, len(stamps)):
            expected = (stamps[i] - stamps[i - 1]) / scale
            measured = t.times[i] - t.times[i - 1]
            if expected <= 0:
                continue
            errors.append(abs(measured - expected) / expected)
            expected_all.append(expected)
            measured_all.append(measured)
    tokens = sum(len(t.times) for t in traces)
    print(
        f"engine-sim bench: {args.gpu} {args.model}, {args.concurrency} concurrent streams, "
        f"{args.prompt_tokens} in / {args.max_tokens} out, time scale {args.time_scale:g}, "
        f"max_num_seqs {args.max_num_seqs}, {args.client} client"
    )
    print(
        f"  wall {wall:.1f} s, {tokens} tokens streamed ({tokens / wall:.0f} chunks/s), "
        f"failed requests {len(failed)}, server lag {info['lag_seconds']:.3f} s"
    )
    print(f"  server delivery lateness (ms after the step's planned end): {info['delivery_lateness_ms']}")
    print(
        f"  CPU: server {info['server_cpu_s'] / wall * 100:.0f} % of a core, "
        f"client {info['client_cpu_s'] / wall * 100:.0f} %"
    )
    if not errors:
        print("  no gaps measured")
        return 1
    print(
        f"  inter-token gaps: {len(errors)}; expected mean {statistics.fmean(expected_all) * 1e3:.1f} ms, "
        f"measured mean {statistics.fmean(measured_all) * 1e3:.1f} ms"
    )
    med, p90, p99 = (_pct(errors, q) for q in (0.5, 0.9, 0.99))
    print(f"  per-token timing error: median {med * 100:.1f} %, p90 {p90 * 100:.1f} %, p99 {p99 * 100:.1f} %")
    ok = p90 <= args.target and not failed
    print(f"  target p90 <= {args.target * 100:.0f} %: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=500)
    parser.add_argument("--gpu", default="A100-80GB")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument(
        "--max-num-seqs", type=int, default=512, help="512: every stream decodes in each step"
    )
    parser.add_argument(
        "--client",
        choices=("raw", "aiohttp"),
        default="raw",
        help="raw: a minimal blocking HTTP/1.1 client on epoll (least client jitter); aiohttp: its client",
    )
    parser.add_argument("--dump", help="write client and server timings to this JSON file")
    parser.add_argument("--target", type=float, default=0.10, help="p90 relative error to pass")
    args = parser.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
