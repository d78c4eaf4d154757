"""Start `extproc engine-sim` as a real subprocess on a free port and wait for it with a deadline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STARTUP_DEADLINE_S = 20.0
POLL_INTERVAL_S = 0.02


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET, or None when nothing answered (refused, reset, timeout)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError):
        return None


def can_connect(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class SimProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_until(
        self, predicate: Callable[[], bool], what: str, deadline_s: float = STARTUP_DEADLINE_S
    ) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine-sim exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}"
                )
            if predicate():
                return
            time.sleep(POLL_INTERVAL_S)  # poll interval, not synchronisation: the predicate decides
        raise TimeoutError(f"engine-sim: {what} not reached in {deadline_s}s: {self.log.read_text()[-2000:]}")

    def log_text(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_sim(args: list[str], log_dir: Path, port: int | None = None, wait: str = "health") -> SimProcess:
    """wait: "health" (GET /health == 200), "listening" (TCP connect), or "log" (startup line logged)."""
    port = port or free_port()
    log = log_dir / f"engine-sim-{port}.log"
    cmd = [sys.executable, "-m", "extproc", "engine-sim", "--port", str(port), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    sim = SimProcess(proc, port, log)
    try:
        if wait == "health":
            sim.wait_until(lambda: http_status(sim.url + "/health", 0.5) == 200, "/health 200")
        elif wait == "listening":
            sim.wait_until(lambda: can_connect(port), "listening")
        elif wait == "log":
            sim.wait_until(lambda: "engine-sim " in log.read_text(), "startup log line")
    except BaseException:
        sim.stop()
        raise
    return sim
