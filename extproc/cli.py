"""`extproc <command>`: each command is a thin shell over a library call."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from extproc.extras import ToolsMissing


def _serve(args: argparse.Namespace) -> int:
    from extproc.server.app import serve
    from extproc.server.tls import TlsError, settings_from

    try:
        tls = settings_from(args.tls_cert, args.tls_key, args.tls_client_ca)
    except TlsError as exc:
        print(f"extproc serve: {exc}", file=sys.stderr)
        return 2
    if args.workers > 1:
        return _supervise(args)
    worker = None
    if args.worker:
        from extproc.server.supervisor import WorkerSpec

        worker = WorkerSpec.parse(args.worker)
    return serve(args.config, port=args.port, admin_port=args.admin_port,
                 host=args.host, admin_host=args.admin_host, tls=tls, worker=worker)


def _supervise(args: argparse.Namespace) -> int:
    import asyncio

    from extproc.config import ConfigError, load
    from extproc.server.supervisor import supervise

    try:
        config = load(args.config)  # refused here, before any worker starts
    except ConfigError as exc:
        print(f"extproc serve: {exc}", file=sys.stderr)
        return 2
    serve_args = ["--log-level", args.log_level, "serve", "--config", args.config, "--host", args.host]
    for flag, value in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                        ("--tls-client-ca", args.tls_client_ca)):
        if value:
            serve_args += [flag, value]
    try:
        return asyncio.run(supervise(args.workers, serve_args, port=args.port, admin_host=args.admin_host,
                                     admin_port=args.admin_port,
                                     drain_timeout_seconds=config.drain_timeout_seconds))
    except ValueError as exc:
        print(f"extproc serve: {exc}", file=sys.stderr)
        return 2


def _envoy_config(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from extproc.config import ConfigError, load
    from extproc.envoy_bootstrap import BootstrapOptions, fail_open_upstreams, render

    options = BootstrapOptions(
        listen_port=args.listen_port, listen_address=args.listen_address, extproc_port=args.extproc_port,
        extproc_workers=args.extproc_workers, admin_port=args.admin_port,
        idle_timeout_seconds=args.idle_timeout, destination_header=args.destination_header)
    config = None
    if args.gateway_config:  # gateway.fail_open and the model paths come from the gateway's own file
        try:
            config = load(args.gateway_config)
        except ConfigError as exc:
            print(f"{args.gateway_config}: {exc}", file=sys.stderr)
            return 1
        options = replace(options, fail_open=fail_open_upstreams(config),
                          model_paths=tuple(sorted(config.model_paths)))
    if args.pool:
        from extproc.envoy_pool import PoolOptions, render_pool

        pods = tuple(args.pool_endpoint or (p.address for p in (config.pods if config else ())))
        if not pods:
            print("--pool needs the pool's endpoints: --pool-endpoint ip:port (repeated) or "
                  "--gateway-config", file=sys.stderr)
            return 1
        fail_open = bool(config and config.fail_open)
        # Envoy fails open only before a full-duplex body has started: failing open, the body is buffered
        default_mode = "BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED"
        pool = PoolOptions(pods=pods, body_mode=args.body_mode or default_mode,
                           fallback_endpoints=config.fallback_endpoints if config else 3,
                           fail_open=fail_open,
                           subset_from_header=args.subset_from_header)
        sys.stdout.write(render_pool(replace(options, fail_open=()), pool))
        return 0
    if args.body_mode:
        options = replace(options, request_body_mode=args.body_mode)
    sys.stdout.write(render(options))
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from extproc.config import ConfigError, load
    from extproc.config.describe import describe

    try:
        config = load(args.file)  # the same load `serve` does: file + environment
    except ConfigError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    print(f"{args.file}: valid (environment overrides applied)")
    for line in describe(config):
        print(line)
    return 0


# The tools' packages: the gateway and optimizer image leaves them out (.dockerignore); the repository's
# install (`make setup`, `pip install '.[tools]'`) has them.
TOOL_PACKAGES = ("extproc.sim", "extproc.profiling", "extproc.fleetsim", "extproc.perf", "extproc.demo")


def _subcommand_modules() -> tuple[ModuleType, ...]:
    """Every subcommand beyond the gateway's own, in `extproc --help`'s order: each module adds its
    commands with `add_commands(sub)`. Imported here, not at the top, so `import extproc.cli` stays
    light; `extproc <any command>` builds the whole parser and imports them all. Without the tools'
    packages (the image) only the product's commands are offered."""
    from extproc import score_cli
    from extproc.optimizer import cli as optimizer

    try:
        from extproc.demo import cli as demo
        from extproc.fleetsim import cli as fleetsim
        from extproc.perf import cli as perf
        from extproc.profiling import cli as profiling
        from extproc.sim import cli as sim
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith(TOOL_PACKAGES):
            raise  # a dependency missing from a tool that is there: its own error
        return score_cli, optimizer
    return (
        sim,  # engine-sim (and engine-sim calibrate)
        profiling,  # benchmark, gen-profile
        fleetsim,  # fleet-sim
        perf,  # bench overhead|memory|limits|sync|floor
        score_cli,  # score
        demo,  # demo
        optimizer,  # optimize, optimizer
    )


def build_parser() -> argparse.ArgumentParser:
    from extproc.envoy_contract import DEFAULT_DESTINATION_HEADER

    parser = argparse.ArgumentParser(prog="extproc", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ext_proc gateway")
    serve.add_argument("--config", required=True, help="YAML config file (reloaded on change)")
    serve.add_argument("--port", type=int, default=50052, help="ext_proc gRPC port")
    serve.add_argument("--host", default="127.0.0.1", help="ext_proc gRPC bind address "
                       "(0.0.0.0 when Envoy runs elsewhere: then restrict it)")
    serve.add_argument("--admin-port", type=int, default=9090, help="/metrics and /healthz port")
    serve.add_argument("--admin-host", default="127.0.0.1", help="admin bind address")
    serve.add_argument("--tls-cert", help="PEM certificate (chain) for the gRPC port; reloaded on change")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument("--tls-client-ca", help="PEM CA bundle: clients must present a certificate it signed")
    serve.add_argument("--workers", type=int, default=1,
                       help="gateway processes (one per core): worker i serves ext_proc on --port + i "
                            "(`extproc envoy-config --extproc-workers N`); one admin port for all")
    serve.add_argument("--worker", help=argparse.SUPPRESS)  # set by the supervisor of --workers
    serve.set_defaults(func=_serve)

    check = sub.add_parser("check-config", help="validate a config file and print what it would serve")
    check.add_argument("file")
    check.set_defaults(func=_check_config)

    envoy = sub.add_parser("envoy-config", help="print an Envoy bootstrap for the gateway")
    envoy.add_argument("--listen-port", type=int, default=8888)
    envoy.add_argument("--listen-address", default="127.0.0.1",
                       help="the clients' listener (0.0.0.0 to serve other machines)")
    envoy.add_argument("--idle-timeout", type=int, default=600,
                       help="seconds a request may see no bytes from the pod before it gets a 504")
    envoy.add_argument("--extproc-port", type=int, default=50052)
    envoy.add_argument("--extproc-workers", type=int, default=1,
                       help="the gateway's `extproc serve --workers N`: one endpoint per worker port")
    envoy.add_argument("--admin-port", type=int, default=9901)
    envoy.add_argument("--destination-header", default=DEFAULT_DESTINATION_HEADER)
    envoy.add_argument("--gateway-config", metavar="GATEWAY.yaml",
                       help="the gateway's config: with gateway.fail_open, Envoy sends the model paths "
                            "round robin to each model's pods while the gateway is unreachable")
    envoy.add_argument("--body-mode",
                       choices=("BUFFERED", "STREAMED", "BUFFERED_PARTIAL", "FULL_DUPLEX_STREAMED"),
                       help="how ext_proc sends the request body (default: BUFFERED; with --pool: "
                            "FULL_DUPLEX_STREAMED, as gateways configure a pool)")
    envoy.add_argument("--pool", action="store_true",
                       help="Envoy as a gateway configures an InferencePool's endpoint picker (the "
                            "protocol: full-duplex body, envoy.lb metadata, the fallback list retried, the "
                            "served endpoint reported); the pool's endpoints from --gateway-config or "
                            "--pool-endpoint; docs/conformance.md")
    envoy.add_argument("--pool-endpoint", action="append", metavar="IP:PORT",
                       help="with --pool: one of the pool's endpoints (repeat for each)")
    envoy.add_argument("--subset-from-header", action="store_true",
                       help="with --pool: the subset hint taken from the request's "
                            "x-gateway-destination-endpoint-subset header (tests, demos: a client then "
                            "narrows the pool)")
    envoy.set_defaults(func=_envoy_config)

    for tool in _subcommand_modules():
        tool.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command != "demo" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ToolsMissing as e:  # a tool's plot or progress bar, in an image without the tools extra
        print(f"extproc {args.command}: {e}", file=sys.stderr)
        return 1
