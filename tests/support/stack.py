"""Test upstreams beside the local stack."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import yaml

from extproc.envoy_bootstrap import BootstrapOptions, bootstrap
from extproc.localstack import LocalStack as Stack
from extproc.localstack import Proc, free_port, http_get, port_open, start_envoy

__all__ = ["Stack", "envoy_in_front_of", "running_stack", "running_stacks", "running_upstreams",
           "start_envoy_at", "start_upstream", "upstream_stats"]


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
def running_stacks(log_dir: Path, config: dict[str, Any], env: dict[str, str],
                   names: tuple[str, ...] = ("a", "b")) -> Iterator[list[Stack]]:
    """Gateway replicas on one `config`, each with its own Envoy in `log_dir/<name>`, sharing `env` (one
    Redis, say), named gw-<name> (POD_NAME), all stopped on exit, also when one fails to start."""
    with ExitStack() as stacks:
        out = []
        for name in names:
            d = log_dir / name
            d.mkdir()
            out.append(stacks.enter_context(running_stack(d, config, {**env, "POD_NAME": f"gw-{name}"})))
        yield out


@contextmanager
def running_upstreams(log_dir: Path, names: tuple[str, ...] = ("a", "b")) -> Iterator[dict[str, int]]:
    """Test upstreams by name -> port (by convention `a` is a pod, `b` a port no route should reach)."""
    procs = {name: start_upstream(name, log_dir) for name in names}
    try:
        yield {name: port for name, (_, port) in procs.items()}
    finally:
        for proc, _ in procs.values():
            proc.stop()



def envoy_in_front_of(gateways: list[Stack]) -> tuple[str, int]:
    """The bootstrap of one Envoy in front of several gateway processes (its ext_proc cluster with
    one endpoint per gateway; its access-log stream goes to one of them) and its listener's port:
    start it, and again after a kill, with `start_envoy_at`."""
    listen = free_port()
    config = bootstrap(BootstrapOptions(listen_port=listen, extproc_port=gateways[0].extproc_port,
                                        admin_port=free_port()))
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "extproc"]
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    for g in gateways[1:]:
        endpoints.append({"endpoint": {"address": {"socket_address": {
            "address": "127.0.0.1", "port_value": g.extproc_port}}}})
    return yaml.safe_dump(config), listen


def start_envoy_at(bootstrap: str, listen: int, log_dir: Path) -> Proc:
    envoy = start_envoy("envoy", bootstrap, log_dir)
    envoy.wait_ready(lambda: port_open(listen))
    return envoy
