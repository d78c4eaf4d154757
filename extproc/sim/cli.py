"""`extproc engine-sim`: one simulated replica from flags, or a fleet from a YAML file."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from typing import Any

from extproc.sim.faults import FaultConfig
from extproc.sim.gpus import GPUS, parse_overrides
from extproc.sim.models import MODELS
from extproc.sim.replica import ReplicaSpec

log = logging.getLogger(__name__)


def add_commands(sub: Any) -> None:
    """Add `engine-sim` to `extproc`'s subcommands."""
    parser = sub.add_parser("engine-sim", help="run a simulated vLLM/SGLang engine (or a fleet of them)")
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fleet", help="YAML fleet file: several replicas in one process (see extproc/sim/fleet.py)"
    )
    parser.add_argument("--gpu", default="A100-80GB", help=f"GPU preset: {', '.join(GPUS)}")
    parser.add_argument("--model", default="llama2-7b", help=f"model preset: {', '.join(MODELS)}")
    parser.add_argument("--served-model-name", help="model name clients use (default: --model)")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    parser.add_argument("--name", default=None, help="replica name (logs, /sim/info)")
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm", help="metric names to export")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="simulated seconds per wall second (10: a 1 s generation takes 0.1 s)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seeds sampled output lengths and faults")
    parser.add_argument(
        "--tensor-parallel", type=int, default=None, help="TP degree (default: model preset's)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="automatic prefix caching (default on, as in vLLM V1)",
    )
    parser.add_argument(
        "--output-len-median",
        type=int,
        default=200,
        help="median of sampled output lengths when a request sets no max_tokens",
    )
    parser.add_argument(
        "--gpu-override",
        action="append",
        metavar="KEY=VALUE",
        help="override a GPU figure, e.g. bandwidth_gbps=1500 (repeatable)",
    )
    parser.add_argument(
        "--model-override", action="append", metavar="KEY=VALUE", help="override a model figure"
    )
    parser.add_argument(
        "--perf-override",
        action="append",
        metavar="KEY=VALUE",
        help="override a roofline parameter, e.g. mem_efficiency=0.7",
    )
    parser.add_argument(
        "--record-timeline",
        action="store_true",
        help="keep per-token model timestamps at /sim/timeline (benchmark use)",
    )
    faults = parser.add_argument_group("fault injection (wall-clock seconds)")
    faults.add_argument("--error-rate", type=float, default=0.0, help="fraction of requests failed at once")
    faults.add_argument("--error-status", type=int, choices=(500, 503), default=500)
    faults.add_argument(
        "--abort-after-tokens", type=int, default=None, help="close the connection after N tokens"
    )
    faults.add_argument(
        "--abort-prob",
        type=float,
        default=0.0,
        help="probability a request is cut mid-stream at a random token",
    )
    faults.add_argument(
        "--stall-after-tokens", type=int, default=None, help="pause the stream after N tokens ..."
    )
    faults.add_argument("--stall-seconds", type=float, default=0.0, help="... for this many seconds")
    faults.add_argument(
        "--slow-start-seconds",
        type=float,
        default=0.0,
        help="after start, /health returns 503 and steps run --slow-start-factor times slower",
    )
    faults.add_argument("--slow-start-factor", type=float, default=5.0)
    faults.add_argument(
        "--refuse-connections",
        choices=("refuse", "reset"),
        default=None,
        help="refuse: nothing listens; reset: accept and close at once",
    )
    faults.add_argument(
        "--kv-pressure",
        type=float,
        default=0.0,
        help="hold this fraction of KV blocks (usage reads >= it; capacity really shrinks)",
    )
    from extproc.sim.calibrate import add_arguments as add_calibrate

    sub = parser.add_subparsers(dest="sim_command", metavar="{calibrate}")
    add_calibrate(sub.add_parser(
        "calibrate", help="the engine model against published vLLM measurements (data/calibration/)"))


def spec_from_args(args: argparse.Namespace) -> ReplicaSpec:
    engine_overrides = {
        k: v
        for k, v in (
            ("max_num_seqs", args.max_num_seqs),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("gpu_memory_utilization", args.gpu_memory_utilization),
            ("max_model_len", args.max_model_len),
            ("enable_prefix_caching", args.enable_prefix_caching),
        )
        if v is not None
    }
    faults = FaultConfig(
        error_rate=args.error_rate,
        error_status=args.error_status,
        abort_after_tokens=args.abort_after_tokens,
        abort_prob=args.abort_prob,
        stall_after_tokens=args.stall_after_tokens,
        stall_seconds=args.stall_seconds,
        slow_start_seconds=args.slow_start_seconds,
        slow_start_factor=args.slow_start_factor,
        refuse_connections=args.refuse_connections,
        kv_pressure=args.kv_pressure,
    )
    return ReplicaSpec(
        name=args.name or f"{args.gpu}-{args.port}",
        gpu=args.gpu,
        model=args.model,
        port=args.port,
        host=args.host or "127.0.0.1",
        served_model_name=args.served_model_name,
        engine=args.engine,
        tensor_parallel=args.tensor_parallel,
        time_scale=args.time_scale or 1.0,
        seed=args.seed or 0,
        output_len_median=args.output_len_median,
        record_timeline=args.record_timeline,
        gpu_overrides=parse_overrides(args.gpu_override),
        model_overrides=parse_overrides(args.model_override),
        perf_overrides=parse_overrides(args.perf_override),
        engine_overrides=engine_overrides,
        faults=faults,
    )


def specs_from_args(args: argparse.Namespace) -> list[ReplicaSpec]:
    if not args.fleet:
        spec = spec_from_args(args)
        spec.build_engine()  # unknown preset / model too big: fail before binding
        return [spec]
    from extproc.sim.fleet import load_fleet

    specs = load_fleet(args.fleet)
    # Flags given explicitly apply to the whole fleet (handy for tests: --time-scale 100).
    changes = {k: v for k, v in (("time_scale", args.time_scale), ("host", args.host)) if v is not None}
    if args.record_timeline:
        changes["record_timeline"] = True
    out = []
    for i, s in enumerate(specs):
        extra = dict(changes)
        if args.seed is not None:
            extra["seed"] = args.seed + i
        out.append(dataclasses.replace(s, **extra))
    return out


def run(args: argparse.Namespace) -> int:
    if getattr(args, "sim_command", None) == "calibrate":
        from extproc.sim.calibrate import run as calibrate

        return calibrate(args)
    from extproc.sim.fleet import serve

    try:
        specs = specs_from_args(args)
    except (KeyError, ValueError, OSError) as e:
        log.error("engine-sim: %s", e)
        return 2
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(specs))
    except KeyboardInterrupt:
        pass
    return 0
