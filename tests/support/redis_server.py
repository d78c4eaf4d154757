"""A real redis-server on a free loopback port, for tests."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from extproc.localstack import Proc, free_port, wait_until


def _pong(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


class RedisServer:
    def __init__(self, log_dir: Path, port: int | None = None, *extra: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make test installs it through apt)")
        self.port = port or free_port()
        self.extra = extra  # e.g. --dir and --dbfilename: restarted from a snapshot
        self.proc = Proc(f"redis-{self.port}", [binary, "--port", str(self.port), "--bind", "127.0.0.1",
                                                "--save", "", "--appendonly", "no", *extra], log_dir)
        self.proc.wait_ready(lambda: _pong(self.port), timeout=15)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.stop()

    def restart(self, log_dir: Path) -> RedisServer:
        self.stop()
        wait_until(lambda: not _alive(self.port), 5, "redis port free")
        return RedisServer(log_dir, self.port, *self.extra)


def _alive(port: int) -> bool:
    try:
        return _pong(port)
    except OSError:
        return False
