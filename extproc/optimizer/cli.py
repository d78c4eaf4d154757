"""`extproc optimize` (one plan from files) and `extproc optimizer` (the service)."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from extproc.optimizer.policy import HEADROOM

log = logging.getLogger(__name__)

SHUTDOWN_SECONDS = 5.0  # open HTTP requests get this long to finish on SIGTERM


def add_commands(sub: Any) -> None:
    opt = sub.add_parser(
        "optimize",
        help="the cheapest replica mix per GPU type for a workload (one shot)",
        description="Solve one plan from AIBrix profile files and a workload file.",
    )
    opt.add_argument(
        "--profile",
        action="append",
        required=True,
        metavar="P.json",
        help="an AIBrix profile (one per GPU type / deployment); repeat",
    )
    opt.add_argument(
        "--workload",
        required=True,
        metavar="W.json",
        help='{"rates": [{"input_tokens": 128, "output_tokens": 64, "rps": 5.0}, ...]}',
    )
    opt.add_argument("--json", action="store_true", help="print {replicas, cost, solve_seconds} as JSON")
    opt.add_argument("--headroom", type=float, default=HEADROOM, metavar="BETA",
                     help="replicas kept spare per GPU type, in standard deviations of its load, as the "
                          "service plans (0: the mean load alone, as AIBrix plans). Default %(default)s")
    opt.set_defaults(func=optimize_command)

    svc = sub.add_parser(
        "optimizer",
        help="the GPU optimizer service (PodAutoscaler metrics, dashboard)",
        description="Re-plan every model from request traces and profiles; serve "
        "/metrics/<ns>/<deployment>, /scale, /monitor and /dash/<model>.",
    )
    svc.add_argument("--config", help="YAML: deployments (name, namespace, model, min_replicas) and profiles")
    svc.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="P.json",
        help="a profile file, in addition to Redis aibrix:profile_<model>_<deployment>; repeat",
    )
    svc.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    svc.add_argument("--port", type=int, default=8080)
    svc.add_argument("--redis-url", help="default: REDIS_HOST/REDIS_PORT/REDIS_PASSWORD, else localhost:6379")
    svc.add_argument("--interval", type=float, default=10.0, help="re-plan period, seconds")
    svc.add_argument("--window", type=float, default=240.0, help="sliding workload window, seconds")
    svc.add_argument("--headroom", type=float, default=None, metavar="BETA",
                     help="replicas kept spare per GPU type, in standard deviations of its load "
                          "(square-root staffing; 0: plan for the mean load). Overrides the config's "
                          f"planning.headroom; default {HEADROOM}")
    svc.set_defaults(func=optimizer_command)


def _table(plan: Any, profiles: list[Any]) -> str:
    width = max(len("deployment"), *(len(p.gpu) for p in profiles))
    lines = [f"{'deployment':<{width}}  replicas  load    cost/replica  cost"]
    for p in profiles:
        n = plan.replicas[p.gpu]
        lines.append(
            f"{p.gpu:<{width}}  {n:>8}  {plan.load[p.gpu]:>6.2f}  {p.cost:>12.3g}  {n * p.cost:>.3g}"
        )
    lines.append(
        f"total cost {plan.cost:.4g} for {plan.rps:.4g} req/s (solved in {plan.solve_seconds * 1000:.1f} ms)"
    )
    return "\n".join(lines)


def optimize_command(args: argparse.Namespace) -> int:
    from extproc.gpu_profiles import ProfileError, load_profile
    from extproc.optimizer.solver import PlanError, solve
    from extproc.optimizer.workload import WorkloadError, load_workload

    try:
        profiles = [load_profile(p) for p in args.profile]
        demands = load_workload(args.workload)
        if args.headroom < 0:
            raise PlanError(f"--headroom must be >= 0, not {args.headroom}")
        plan = solve(profiles, demands, headroom=args.headroom)
    except (ProfileError, WorkloadError, PlanError) as e:
        print(f"extproc optimize: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_json()) if args.json else _table(plan, profiles))
    return 0


def optimizer_command(args: argparse.Namespace) -> int:
    from extproc.optimizer.deployments import ConfigError

    try:
        return asyncio.run(_serve(args))
    except ConfigError as e:
        print(f"extproc optimizer: {e}", file=sys.stderr)
        return 2


async def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from extproc import redis_connect
    from extproc.environment import in_cluster, redis_url_from_env
    from extproc.gpu_profiles import ProfileStore
    from extproc.optimizer.deployments import (
        ConfigError,
        DeploymentSource,
        FileDeploymentSource,
        StaticDeploymentSource,
    )
    from extproc.optimizer.kubernetes import KubernetesDeploymentSource, MergedDeploymentSource
    from extproc.optimizer.policy import PlanPolicy
    from extproc.optimizer.service import OptimizerService, ServiceSettings
    from extproc.redact import redact_url

    file_source = FileDeploymentSource(args.config) if args.config else None
    source: DeploymentSource = file_source or StaticDeploymentSource([])
    cluster = None
    if file_source is not None and file_source.config.kubernetes is not None:  # read at start-up only
        cluster = KubernetesDeploymentSource(replace(file_source.config.kubernetes,
                                                     in_cluster=in_cluster(os.environ)))
        source = MergedDeploymentSource(file_source, cluster)

    def profile_files() -> list[Path]:
        return [*(file_source.config.profiles if file_source else ()), *map(Path, args.profile)]

    policy = file_source.config.policy if file_source else PlanPolicy()
    if args.headroom is not None:
        if args.headroom < 0:
            raise ConfigError(f"--headroom must be >= 0, not {args.headroom}")
        policy = replace(policy, headroom=args.headroom)
    store = ProfileStore()
    errors = store.load_files(profile_files())
    if errors:
        for e in errors:
            print(f"extproc optimizer: {e}", file=sys.stderr)
        return 2
    url = redis_url_from_env(os.environ, args.redis_url) or "redis://localhost:6379/0"
    where = redis_connect.target_from_env(os.environ, url)  # EXTPROC_REDIS_MODE: cluster, sentinel
    redis = redis_connect.open_async(where or url, timeout=5)
    service = OptimizerService(
        source,
        store,
        redis,
        ServiceSettings(interval=args.interval, window_seconds=args.window, policy=policy),
        profile_files=profile_files,
    )
    # A dashboard tab left open must not hold shutdown for aiohttp's default 60 s.
    runner = web.AppRunner(service.app(), access_log=None, shutdown_timeout=SHUTDOWN_SECONDS)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("GPU optimizer on http://%s:%d (Redis %s)", args.host, args.port,
             where.describe() if where else redact_url(url))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(service.run(), name="optimizer")]
    if cluster is not None:
        tasks.append(asyncio.create_task(cluster.run(), name="deployment-discovery"))
    try:
        await stop.wait()
    finally:
        # If shutdown ever hangs, the stacks land in the log before the supervisor's SIGKILL.
        faulthandler.dump_traceback_later(SHUTDOWN_SECONDS + 5, exit=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()
        await redis.aclose()
    return 0
