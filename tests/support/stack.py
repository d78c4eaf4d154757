"""Test upstreams beside the local stack."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from extproc.localstack import LocalStack as Stack
from extproc.localstack import Proc, free_port, http_get, port_open

__all__ = ["Stack", "running_stack", "running_upstreams", "start_upstream", "upstream_stats"]


def start_upstream(name: str, log_dir: Path) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc(f"upstream-{name}", [sys.executable, "-m", "tests.support.upstream", "--port", str(port),
                                     "--name", name], log_dir)
    proc.wait_ready(lambda: port_open(port))
    return proc, port


def upstream_stats(port: int) -> dict[str, Any]:
    return json.loads(http_get(f"http://127.0.0.1:{port}/stats")[1])


@contextmanager
def running_stack(log_dir: Path, config: dict[str, Any], env: dict[str, str] | None = None,
                  **envoy_options: Any) -> Iterator[Stack]:
    """The gateway (on `config`) and Envoy in front of it, stopped on exit."""
    stack = Stack(config_path=log_dir / "gateway.yaml", log_dir=log_dir, env=env or {})
    stack.write_config(config)
    try:
        stack.start_gateway()
        stack.start_envoy(**envoy_options)
        yield stack
    finally:
        stack.stop()


@contextmanager
def running_upstreams(log_dir: Path, names: tuple[str, ...] = ("a", "b")) -> Iterator[dict[str, int]]:
    """Test upstreams by name -> port (by convention `a` is a pod, `b` a port no route should reach)."""
    procs = {name: start_upstream(name, log_dir) for name in names}
    try:
        yield {name: port for name, (_, port) in procs.items()}
    finally:
        for proc, _ in procs.values():
            proc.stop()
