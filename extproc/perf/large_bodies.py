"""`extproc bench memory --large-bodies`: the live gateway's RSS after large request bodies.

The real processes, as an operator runs them: the gateway (`extproc serve`), Envoy in front of it and
a fast local upstream. Bodies of `size` bytes (a chat request with one long message) are posted
through Envoy one after another, then `concurrent` at once; the gateway process's RSS (and its body
parser process's) is read when idle before, after each phase once it is idle again, and at its peak
(sampled every 50 ms). A body this large is parsed in the parser process (over 256 KiB), its usage
rewrite spliced and sent back to Envoy in the gateway: the copies live there.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from extproc.localstack import LocalStack, Proc, free_port, port_open, wait_until

MODEL = "bench"
MIB = 1024 * 1024


@dataclass(slots=True)
class Phase:
    name: str
    requests: int
    statuses: dict[int, int] = field(default_factory=dict)
    peak_mib: float = 0.0
    after_mib: float = 0.0   # gateway RSS once idle again
    parser_mib: float = 0.0  # the body parser process's RSS then
    seconds: float = 0.0


@dataclass(slots=True)
class Report:
    size: int
    idle_mib: float
    parser_idle_mib: float
    phases: list[Phase]

    def lines(self) -> list[str]:
        out = [f"bodies of {self.size / MIB:.1f} MiB; gateway RSS idle {self.idle_mib:.0f} MiB "
               f"(its body parser process {self.parser_idle_mib:.0f} MiB)"]
        for p in self.phases:
            out.append(f"  {p.name:<14} {p.requests:>3} requests in {p.seconds:5.1f} s, "
                       f"statuses {p.statuses}: peak {p.peak_mib:.0f} MiB, idle after {p.after_mib:.0f} MiB "
                       f"(+{p.after_mib - self.idle_mib:.0f}); parser {p.parser_mib:.0f} MiB")
        return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def body(size: int) -> bytes:
    head = json.dumps({"model": MODEL, "max_tokens": 4, "stream": False,
                       "messages": [{"role": "user", "content": ""}]}).encode()
    cut = head.index(b'""') + 1
    return head[:cut] + b"x" * (size - len(head)) + head[cut:]


def post(port: int, payload: bytes) -> int:
    """One HTTP/1.1 POST on its own connection; the status."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                     % len(payload) + payload)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0


def _phase(name: str, n: int, parallel: int, send: Callable[[], int], pid: int) -> Phase:
    phase = Phase(name, n)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            phase.peak_mib = max(phase.peak_mib, rss_mib(pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        for status in pool.map(lambda _: send(), range(n)):
            phase.statuses[status] = phase.statuses.get(status, 0) + 1
    phase.seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    return phase


def _settled(pid: int) -> float:
    """RSS once it stops moving (the loop's last frees, the gateway's once-a-second heap trim): three
    reads a second apart within 1 MiB."""
    reads = [rss_mib(pid)]

    def still() -> bool:
        time.sleep(1.0)
        reads.append(rss_mib(pid))
        return len(reads) >= 3 and max(reads[-3:]) - min(reads[-3:]) < 1

    wait_until(still, 30, "gateway RSS settled")
    return reads[-1]


def run(size: int = 7 * MIB, sequential: int = 80, concurrent: int = 8, rounds: int = 3,
        progress: Callable[[str], None] = print, env: dict[str, str] | None = None) -> Report:
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        log_dir = Path(tmp)
        port = free_port()
        upstream = Proc("upstream", [sys.executable, "-m", "extproc.perf.upstream", "--port", str(port)],
                        log_dir)
        stack = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir, env=env or {})
        try:
            upstream.wait_ready(lambda: port_open(port))
            stack.write_config({"models": {MODEL: {"pods": [
                {"name": "up-0", "address": f"127.0.0.1:{port}"}]}}})
            stack.start_gateway()
            stack.start_envoy()
            assert stack.gateway is not None
            pid = stack.gateway.popen.pid
            payload = body(size)
            send = lambda: post(stack.envoy_port, payload)  # noqa: E731
            assert send() == 200  # warm: the parser process started, first allocations made
            wait_until(lambda: bool(children(pid)), 10, "the body parser process")
            parser = children(pid)[0]
            idle = _settled(pid)
            report = Report(size, idle, rss_mib(parser), [])
            phases = [("sequential", sequential, 1),
                      *((f"concurrent #{r + 1}", concurrent, concurrent) for r in range(rounds))]
            for name, n, parallel in phases:
                phase = _phase(name, n, parallel, send, pid)
                phase.after_mib, phase.parser_mib = _settled(pid), rss_mib(parser)
                report.phases.append(phase)
                progress(report.lines()[-1])
            return report
        finally:
            stack.stop()
            upstream.stop()
