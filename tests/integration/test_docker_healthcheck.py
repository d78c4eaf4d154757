"""The Dockerfile's HEALTHCHECK command, run against a real `extproc serve` (its port swapped for a
free one): healthy while the server serves, unhealthy once it has stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from extproc.localstack import Proc, free_port, port_open
from tests.unit.test_dockerfile import healthcheck_code


def run_check(code: str, port: int) -> int:
    assert "127.0.0.1:50052" in code
    code = code.replace("127.0.0.1:50052", f"127.0.0.1:{port}")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode


def test_healthcheck_follows_the_grpc_health_service(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("models:\n  m:\n    pods:\n      - {name: p, address: 127.0.0.1:9}\n")
    port, admin = free_port(), free_port()
    code = healthcheck_code()
    assert run_check(code, port) != 0  # nothing listening yet
    proc = Proc("gateway", [sys.executable, "-m", "extproc", "serve", "--config", str(config),
                            "--port", str(port), "--admin-port", str(admin)], tmp_path)
    try:
        proc.wait_ready(lambda: port_open(port))
        assert run_check(code, port) == 0, proc.log()
    finally:
        proc.stop()
    assert run_check(code, port) != 0
