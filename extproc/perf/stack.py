"""The processes of the overhead benchmark: one upstream and the paths to it, side by side.

    direct  client -> upstream
    envoy   (a) client -> Envoy -> upstream; the client sets the destination header itself
    routed  (b) client -> Envoy + gateway routing (ext_proc, request side) -> upstream
    full    (c) the product: routing + Lua tally + gRPC access log back to the gateway
    tally   diagnostic: (a) + the Lua tally, no gateway (a stub Lua filter marks each request as
            routed, with usage to strip, as the gateway would): Envoy's share of (c)'s cost
    workers (c) with `serve --workers N` (`--workers`): N gateway processes behind one Envoy
    before  (c) as an earlier version builds it (`--baseline DIR`: its gateway code and its Envoy
            bootstrap), beside the others: before and after measured in one run

Every Envoy runs the same bootstrap generator with filters removed, so the differences between
paths are the gateway's parts and nothing else. (b) and (c) have a gateway process each, so the
CPU of each is its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import yaml

from extproc.envoy_bootstrap import BootstrapOptions, bootstrap
from extproc.envoy_contract import (
    DEFAULT_DESTINATION_HEADER,
    GATEWAY_METADATA_NAMESPACE,
    MODEL_CLUSTER,
    POD,
    STRIP_USAGE,
)
from extproc.envoy_pool import PoolOptions, render_pool
from extproc.localstack import VENV_BIN, Proc, free_port, free_ports, http_get, port_open, start_envoy
from extproc.perf.epoll_client import Target

MODEL = "bench"
PATHS = ("direct", "envoy", "routed", "full", "workers", "tally", "before", "limited", "duplex", "pool",
         "pool-buffered", "pool-before", "pool-floor")
# The "limited" path's limits: high enough that every request is admitted, so it times the check alone.
BENCH_RATE_LIMITS = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12}
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
BUFFER_FILTER = "envoy.filters.http.buffer"  # holds headers for ext_proc's one message: not without it
LUA_FILTER = "envoy.filters.http.lua"
GRPC_ACCESS_LOG = "envoy.access_loggers.http_grpc"
# What the gateway's routing reply leaves in metadata for tally.lua (server/responses.py).
_MARK_ROUTED = ('function envoy_on_request(h) local m = h:streamInfo():dynamicMetadata() '
                f'm:set("{GATEWAY_METADATA_NAMESPACE}", "{POD}", "upstream-0") '
                f'm:set("{GATEWAY_METADATA_NAMESPACE}", "{STRIP_USAGE}", true) end')


def envoy_variant(options: BootstrapOptions, *, ext_proc: bool, tally: bool, mark: bool = False) -> str:
    """The product bootstrap minus the gateway's parts: ext_proc, and/or the Lua tally + access log.

    `mark`: a stub Lua filter stands in for the gateway's routing metadata, so the tally runs
    without a gateway (the access log, which has no one to go to, is removed too).
    """
    config = bootstrap(options)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    drop = set() if ext_proc else {EXT_PROC_FILTER, BUFFER_FILTER}
    if not ext_proc:
        route_by_header(config, options.destination_header)
    if not tally:
        drop.add(LUA_FILTER)
    if not tally or mark:
        hcm["access_log"] = [a for a in hcm["access_log"] if a["name"] != GRPC_ACCESS_LOG]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in drop]
    if mark:
        hcm["http_filters"].insert(0, {"name": "mark_routed", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": _MARK_ROUTED}}})
    return yaml.safe_dump(config, sort_keys=False)


def route_by_header(config: dict, destination_header: str) -> None:
    """Without a gateway (Envoy alone): ORIGINAL_DST follows the destination header the client sets,
    and the route to the pods requires that header (where the product requires the gateway's metadata)."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    to_pods = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    to_pods["match"] = {"prefix": "/", "headers": [{"name": destination_header, "present_match": True}]}
    del to_pods["request_headers_to_add"]
    pods = next(c for c in config["static_resources"]["clusters"] if c["name"] == MODEL_CLUSTER)
    pods["original_dst_lb_config"] = {"use_http_header": True, "http_header_name": destination_header}


def strategy_for_bench() -> str:
    """load-balance when registered (the default the product aims at), else least-request."""
    from extproc.routing import strategy_names

    return "load-balance" if "load-balance" in strategy_names() else "least-request"


@dataclass
class Gateway:
    proc: Proc
    admin_port: int

    @property
    def pid(self) -> int:
        return self.proc.popen.pid

    def metrics(self) -> str:
        return http_get(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=5)[1].decode()


@dataclass
class BenchPath:
    name: str
    target: Target
    envoy: Proc | None = None
    gateway: Gateway | None = None


class Stack:
    """Starts everything on 127.0.0.1 free ports; `close` (or the with-block) stops it all."""

    def __init__(self, log_dir: Path, itl_ms: float, strategy: str, paths: tuple[str, ...] = PATHS,
                 baseline: Path | None = None, workers: int = 2, limits_redis_url: str | None = None) -> None:
        self.log_dir = log_dir
        self.limits_redis_url = limits_redis_url  # the "limited" path's budgets: in Redis, else in process
        self.strategy = strategy
        self.baseline = baseline  # a checkout of an earlier version: the "before" path runs its code
        self.workers = workers    # of the "workers" path
        self._exit = ExitStack()
        self.paths: dict[str, BenchPath] = {}
        try:
            self._start(itl_ms, paths)
        except BaseException:
            self._exit.close()
            raise

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._exit.close()

    def _proc(self, proc: Proc) -> Proc:
        self._exit.callback(proc.stop)
        return proc

    def _start(self, itl_ms: float, paths: tuple[str, ...]) -> None:
        port = free_port()
        self.upstream = self._proc(Proc("upstream", [sys.executable, "-m", "extproc.perf.upstream",
                                                     "--port", str(port), "--itl-ms", str(itl_ms)],
                                        self.log_dir))
        self.upstream.wait_ready(lambda: port_open(port))
        self.upstream_port = port
        address = f"127.0.0.1:{port}"
        self.paths["direct"] = BenchPath("direct", Target(port))
        if "envoy" in paths:
            envoy_port = free_port()
            envoy = self._envoy("envoy", envoy_port, gateway_port=free_port(), ext_proc=False, tally=False)
            self.paths["envoy"] = BenchPath(
                "envoy", Target(envoy_port, ((DEFAULT_DESTINATION_HEADER, address),)), envoy)
        if "tally" in paths:
            envoy_port = free_port()
            envoy = self._envoy("tally", envoy_port, gateway_port=free_port(), ext_proc=False, tally=True,
                                mark=True)
            self.paths["tally"] = BenchPath("tally", Target(
                envoy_port, ((DEFAULT_DESTINATION_HEADER, address),), include_usage=True), envoy)
        for name, tally in (("routed", False), ("full", True)):
            if name not in paths:
                continue
            gateway, grpc_port = self._gateway(name, address)
            envoy_port = free_port()
            envoy = self._envoy(name, envoy_port, gateway_port=grpc_port, ext_proc=True, tally=tally)
            self.paths[name] = BenchPath(name, Target(envoy_port), envoy, gateway)
        if "workers" in paths:
            gateway, grpc_port = self._gateway("workers", address, workers=self.workers)
            envoy_port = free_port()
            envoy = self._envoy("workers", envoy_port, gateway_port=grpc_port, ext_proc=True, tally=True,
                                workers=self.workers)
            self.paths["workers"] = BenchPath("workers", Target(envoy_port), envoy, gateway)
        if "limited" in paths:
            env = {"EXTPROC_REDIS_URL": self.limits_redis_url} if self.limits_redis_url else None
            gateway, grpc_port = self._gateway("limited", address, env, rate_limits=BENCH_RATE_LIMITS)
            envoy_port = free_port()
            envoy = self._envoy("limited", envoy_port, gateway_port=grpc_port, ext_proc=True, tally=True)
            self.paths["limited"] = BenchPath("limited", Target(envoy_port), envoy, gateway)
        if "duplex" in paths:  # path (c) with the request body in full-duplex pieces: a pool's mode
            gateway, grpc_port = self._gateway("duplex", address)
            envoy_port = free_port()
            envoy = self._envoy("duplex", envoy_port, gateway_port=grpc_port, ext_proc=True, tally=True,
                                body_mode="FULL_DUPLEX_STREAMED")
            self.paths["duplex"] = BenchPath("duplex", Target(envoy_port), envoy, gateway)
        if "pool" in paths:  # Envoy as a gateway configures an InferencePool (`envoy-config --pool`)
            gateway, grpc_port = self._gateway("pool", address)
            self.paths["pool"] = self._pool_path("pool", address, grpc_port, gateway)
        if "pool-buffered" in paths:  # the same pool with a buffered body (a pool's buffered annotation)
            gateway, grpc_port = self._gateway("pool-buffered", address)
            self.paths["pool-buffered"] = self._pool_path("pool-buffered", address, grpc_port, gateway,
                                                          body_mode="BUFFERED")
        if "pool-before" in paths and self.baseline is not None:  # the same, the baseline's picker
            gateway, grpc_port = self._gateway("pool-before", address, {"PYTHONPATH": str(self.baseline)})
            self.paths["pool-before"] = self._pool_path("pool-before", address, grpc_port, gateway)
        if "pool-floor" in paths:  # the same Envoy, a picker with fixed answers (extproc/perf/pool_floor.py)
            grpc_port = free_port()
            floor = self._proc(Proc("pool-floor", [sys.executable, "-m", "extproc.perf.pool_floor",
                                                   "--port", str(grpc_port), "--endpoint", address],
                                    self.log_dir))
            floor.wait_ready(lambda: port_open(grpc_port))
            self.paths["pool-floor"] = self._pool_path("pool-floor", address, grpc_port,
                                                       Gateway(floor, admin_port=0))
        if "before" in paths and self.baseline is not None:
            env = {"PYTHONPATH": str(self.baseline)}  # its code first: the gateway and the generator
            gateway, grpc_port = self._gateway("before", address, env)
            envoy_port = free_port()
            options = (f"BootstrapOptions(listen_port={envoy_port}, listen_address='127.0.0.1', "
                       f"admin_port={free_port()}, extproc_port={grpc_port})")
            text = subprocess.run(
                [sys.executable, "-c", "from extproc.envoy_bootstrap import BootstrapOptions; "
                 f"from extproc.perf.stack import envoy_variant; print(envoy_variant({options}, "
                 "ext_proc=True, tally=True))"], env={**os.environ, **env}, cwd=self.baseline,
                capture_output=True, text=True, check=True).stdout
            envoy = self._proc(start_envoy("envoy-before", text, self.log_dir))
            envoy.wait_ready(lambda: port_open(envoy_port))
            self.paths["before"] = BenchPath("before", Target(envoy_port), envoy, gateway)

    def _pool_path(self, name: str, address: str, grpc_port: int, gateway: Gateway,
                   body_mode: str = "FULL_DUPLEX_STREAMED") -> BenchPath:
        """Envoy as `extproc envoy-config --pool [--body-mode ...]` writes it, in front of this picker."""
        envoy_port = free_port()
        options = BootstrapOptions(listen_port=envoy_port, listen_address="127.0.0.1",
                                   admin_port=free_port(), extproc_port=grpc_port)
        text = render_pool(options, PoolOptions(pods=(address,), body_mode=body_mode))
        envoy = self._proc(start_envoy(f"envoy-{name}", text, self.log_dir))
        envoy.wait_ready(lambda: port_open(envoy_port))
        return BenchPath(name, Target(envoy_port), envoy, gateway)

    def _gateway(self, name: str, address: str, env: dict[str, str] | None = None,
                 workers: int = 1, rate_limits: dict | None = None) -> tuple[Gateway, int]:
        config = self.log_dir / f"gateway-{name}.yaml"
        # Without the access log (path b) records never come: keep the default request timeout so no
        # expiry (and its per-request warning) runs during the benchmark.
        config.write_text(yaml.safe_dump({
            "models": {MODEL: {"pods": [{"name": "upstream-0", "address": address}]}},
            "routing": {"default_strategy": self.strategy},
            **({"rate_limits": rate_limits} if rate_limits else {})}))
        grpc_port, admin_port = free_ports(workers), free_port()
        workers_args = ["--workers", str(workers)] if workers > 1 else []  # a baseline may not know it
        proc = self._proc(Proc(f"gateway-{name}", [
            str(VENV_BIN / "extproc"), "--log-level", "WARNING", "serve", "--config", str(config),
            "--port", str(grpc_port), "--host", "127.0.0.1", "--admin-port", str(admin_port), *workers_args],
            self.log_dir, env))
        proc.wait_ready(lambda: http_get(f"http://127.0.0.1:{admin_port}/healthz")[0] == 200
                        and all(port_open(grpc_port + i) for i in range(workers)))
        return Gateway(proc, admin_port), grpc_port

    def _envoy(self, name: str, port: int, gateway_port: int, *, ext_proc: bool, tally: bool,
               mark: bool = False, workers: int = 1, body_mode: str = "BUFFERED") -> Proc:
        options = BootstrapOptions(listen_port=port, listen_address="127.0.0.1", admin_port=free_port(),
                                   extproc_port=gateway_port, extproc_workers=workers,
                                   request_body_mode=body_mode)
        proc = self._proc(start_envoy(f"envoy-{name}", envoy_variant(
            options, ext_proc=ext_proc, tally=tally, mark=mark), self.log_dir))
        proc.wait_ready(lambda: port_open(port))
        return proc

    def upstream_stats(self) -> dict[str, float]:
        return json.loads(http_get(f"http://127.0.0.1:{self.upstream_port}/stats")[1])
