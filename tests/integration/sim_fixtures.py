"""Start `extproc engine-sim` as a real subprocess on a free port and wait for it with a deadline."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from extproc.localstack import Proc, free_port, port_open

__all__ = ["SimProcess", "free_port", "http_status", "running_sims", "start_sim"]

STARTUP_DEADLINE_S = 20.0


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET, or None when nothing answered (refused, reset, timeout)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError):
        return None


@dataclass
class SimProcess:
    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_until(self, predicate: Callable[[], bool], what: str,
                   deadline_s: float = STARTUP_DEADLINE_S) -> None:
        try:
            self.proc.wait_ready(predicate, deadline_s)
        except TimeoutError as exc:
            raise TimeoutError(f"engine-sim: {what}: {exc}") from None

    def log_text(self) -> str:
        return self.proc.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.stop()


def start_sim(args: list[str], log_dir: Path, port: int | None = None, wait: str = "health") -> SimProcess:
    """wait: "health" (GET /health == 200), "listening" (TCP connect), or "log" (startup line logged)."""
    port = port or free_port()
    command = [sys.executable, "-m", "extproc", "engine-sim", "--port", str(port), *args]
    proc = Proc(f"engine-sim-{port}", command, log_dir, env={"PYTHONUNBUFFERED": "1"})
    sim = SimProcess(proc, port)
    try:
        if wait == "health":
            sim.wait_until(lambda: http_status(sim.url + "/health", 0.5) == 200, "/health 200")
        elif wait == "listening":
            sim.wait_until(lambda: port_open(port), "listening")
        elif wait == "log":
            sim.wait_until(lambda: "engine-sim " in sim.log_text(), "startup log line")
    except BaseException:
        sim.stop()
        raise
    return sim


@contextmanager
def running_sims(args: list[str], log_dir: Path, n: int) -> Iterator[list[SimProcess]]:
    """`n` engine simulators with the same flags, stopped on exit (a list: tests may replace one)."""
    sims: list[SimProcess] = []
    try:
        for _ in range(n):
            sims.append(start_sim(args, log_dir))
        yield sims
    finally:
        for sim in sims:
            sim.stop()
