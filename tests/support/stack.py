"""Envoy + the gateway (+ upstreams) as real processes on free ports."""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.envoy_bootstrap import BootstrapOptions, render
from tests.support.procs import VENV_BIN, Proc, free_port, port_open


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def start_upstream(name: str, log_dir: Path) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc(f"upstream-{name}", [sys.executable, "-m", "tests.support.upstream", "--port", str(port),
                                     "--name", name], log_dir)
    proc.wait_ready(lambda: port_open(port))
    return proc, port


@dataclass
class Stack:
    config_path: Path
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    extproc_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    envoy_port: int = field(default_factory=free_port)
    envoy_admin_port: int = field(default_factory=free_port)
    gateway: Proc | None = None
    envoy: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def write_config(self, config: dict[str, Any]) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config))
        tmp.replace(self.config_path)  # atomic, like a ConfigMap update

    def start_gateway(self) -> None:
        self.gateway = Proc("gateway", [str(VENV_BIN / "extproc"), "serve", "--config", str(self.config_path),
                                        "--port", str(self.extproc_port),
                                        "--admin-port", str(self.admin_port)], self.log_dir, self.env)
        self.gateway.wait_ready(lambda: http_get(self.admin_url + "/healthz")[0] == 200
                                and port_open(self.extproc_port))

    def start_envoy(self, **options: Any) -> None:
        bootstrap = self.log_dir / "envoy.yaml"
        bootstrap.write_text(render(BootstrapOptions(
            listen_port=self.envoy_port, listen_address="127.0.0.1", extproc_port=self.extproc_port,
            admin_port=self.envoy_admin_port, **options)))
        self.envoy = Proc("envoy", [str(VENV_BIN / "envoy"), "-c", str(bootstrap), "--concurrency", "1",
                                    "--disable-hot-restart", "-l", "warning"], self.log_dir)
        self.envoy.wait_ready(lambda: http_get(
            f"http://127.0.0.1:{self.envoy_admin_port}/ready")[0] == 200 and port_open(self.envoy_port))

    def metrics(self) -> str:
        return http_get(self.admin_url + "/metrics")[1].decode()

    def running(self, model: str, pod: str) -> float:
        """extproc_pod_running_requests for one pod, parsed from /metrics."""
        from prometheus_client.parser import text_string_to_metric_families
        for family in text_string_to_metric_families(self.metrics()):
            if family.name == "extproc_pod_running_requests":
                for s in family.samples:
                    if s.labels == {"model": model, "pod": pod}:
                        return s.value
        return 0.0

    def stop(self) -> None:
        for proc in (self.envoy, self.gateway):
            if proc is not None:
                proc.stop()


def upstream_stats(port: int) -> dict[str, Any]:
    return json.loads(http_get(f"http://127.0.0.1:{port}/stats")[1])
