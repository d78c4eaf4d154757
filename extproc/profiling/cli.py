"""`extproc benchmark` and `extproc gen-profile`: argument parsing and exit codes over the library calls."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
import time
from pathlib import Path

from extproc.profiling.plan import DEFAULT_INPUT_LENS, DEFAULT_NUM_PROMPTS, DEFAULT_OUTPUT_LENS, DEFAULT_RATES
from extproc.profiling.selection import PERCENTILES, SLO_HELP, SLO_METRICS, SLOs

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C


def _list(kind: type[int] | type[float]):  # type: ignore[no-untyped-def]
    def parse(text: str) -> list[int] | list[float]:
        try:
            values = [kind(v) for v in text.replace(",", " ").split()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
        return values
    return parse


def _flatten(groups: list[list[float]]) -> tuple:  # type: ignore[type-arg]
    return tuple(v for group in groups for v in group)


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = sub.add_parser("benchmark", help="measure an OpenAI endpoint per (input, output, rate) cell "
                       "into AIBrix's benchmark JSONL", description=_benchmark.__doc__)
    b.add_argument("-m", "--model", required=True, help="model name sent in each request")
    b.add_argument("--endpoint", default="http://127.0.0.1:8010",
                   help="engine or gateway base URL (default: AIBrix's port-forward, http://127.0.0.1:8010)")
    b.add_argument("-o", "--output", required=True, type=Path, help="benchmark JSONL to write")
    b.add_argument("--append", action="store_true", help="append to the output instead of replacing it")
    b.add_argument("--input-lens", type=_list(int), nargs="+", default=[list(DEFAULT_INPUT_LENS)],
                   help="prompt lengths in tokens, e.g. 128,256,512 (default 4 … 8192, doubling, and 6144, "
                        "those beyond the model's context less the longest output replaced by the longest "
                        "that fits, when /v1/models reports max_model_len)")
    b.add_argument("--output-lens", type=_list(int), nargs="+", default=[list(DEFAULT_OUTPUT_LENS)],
                   help="output lengths in tokens (default 4 … 4096, doubling)")
    b.add_argument("--rates", type=_list(float), nargs="+", default=[list(DEFAULT_RATES)],
                   help="request rates per second, Poisson arrivals (default 1 … 64, doubling)")
    b.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS,
                   help=f"requests per cell (default {DEFAULT_NUM_PROMPTS})")
    b.add_argument("--seed", type=int, default=0, help="seed for arrivals and prompts (default 0)")
    b.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    b.add_argument("--api-key", default=None, help="sent as a Bearer token; never printed")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--no-exact-length", dest="exact_length", action="store_false",
                   help="do not send min_tokens/ignore_eos (for APIs that reject vLLM's extensions)")
    b.add_argument("--max-backlog", type=int, default=1000,
                   help="cut a cell off as overloaded when this many requests are in flight (0: no limit)")
    b.add_argument("--admitted", type=Path, default=None, metavar="PROFILE.json",
                   help="instead of the rate grid: each cell of this profile (made from a rate run) with the "
                        "replica held at a per-pod budget of k requests in flight, for gen-profile "
                        "--admitted; write it to a file of its own")
    b.add_argument("--budget-factors", type=_list(float), nargs="+", default=None,
                   help="with --admitted: the budgets k to try per cell, as multiples of Little's budget "
                        "max(1, floor(tput x e2e)) (default 1 2 4 8; gen-profile keeps the one that served "
                        "most within the SLO)")
    b.add_argument("--max-budget", type=int, default=None,
                   help="with --admitted: past the factors, double the largest budget while it meets every "
                        "SLO of the profile and serves at least 10%% more than half of it, up to this one "
                        "(e.g. 256, vLLM's default max_num_seqs). Without it every cell climbs up to 256, "
                        "but one where some rate met the SLO only from a budget whose latencies are at "
                        "most half their targets. A budget climbed to (with it: every budget) sends at "
                        "least 3 requests per client")
    b.add_argument("--drain-timeout", type=float, default=600.0,
                   help="cut a cell off as overloaded when requests still run this long after its last "
                        "arrival (with --admitted: when one request runs this long; seconds, default 600)")
    b.set_defaults(func=_benchmark)

    g = sub.add_parser("gen-profile", help="turn a benchmark JSONL into a GPU profile (AIBrix's JSON)",
                       description=_gen_profile.__doc__)
    g.add_argument("deployment", help="deployment (GPU type) the profile is for: the profile's `gpu`")
    g.add_argument("--benchmark", required=True, type=Path, help="benchmark JSONL (ours or AIBrix's)")
    g.add_argument("--cost", required=True, type=float, help="relative cost of one replica of this GPU type")
    for metric in SLO_METRICS:
        g.add_argument(f"--{metric.lower()}", type=float, default=None, help=SLO_HELP[metric])
    g.add_argument("--percentile", type=int, choices=PERCENTILES, default=0,
                   help="statistic the time SLOs are checked at (0: the mean; default)")
    g.add_argument("-o", dest="output", default=None,
                   help="output file, or redis://[user:pass@]host:port/db?model=MODEL (default: stdout)")
    g.add_argument("--plot", type=Path, default=None, help="also draw heatmaps into this PNG")
    g.add_argument("--admitted", type=Path, default=None, metavar="JSONL",
                   help="the benchmark --admitted run of this profile: recorded as tputs_admitted and "
                        "concurrency_admitted (what a replica serves behind the router's admission, and at "
                        "which per-pod budget; the SLO router and optimizer use both)")
    g.add_argument("--budget-margin", type=float, default=None, metavar="M",
                   help="with --admitted: keep per cell the best budget at most 1/M of the largest that met "
                        "every SLO; the SLO router admits past it up to M times it while a pod's measured "
                        "speed shows room (default 2; 1 keeps the largest and leaves the router no margin)")
    g.set_defaults(func=_gen_profile)


def _error(command: str, message: str) -> int:
    sys.stderr.write(f"extproc {command}: error: {message}\n")
    return EXIT_ERROR


def _benchmark(args: argparse.Namespace) -> int:
    """Open-loop Poisson load per (input, output, rate) cell; one AIBrix JSONL line per metric per cell."""
    from extproc.gpu_profiles import ProfileError, load_profile
    from extproc.profiling.benchmark import BenchmarkOptions, EndpointError, public_url, run_benchmark
    from extproc.profiling.plan import LoadPlan

    if args.num_prompts < 1:
        return _error("benchmark", "--num-prompts must be at least 1")
    if args.budget_factors and not all(f > 0 for f in _flatten(args.budget_factors)):
        return _error("benchmark", "--budget-factors must be positive")
    if args.max_budget is not None and args.max_budget < 1:
        return _error("benchmark", "--max-budget must be at least 1")
    try:
        admitted = load_profile(args.admitted) if args.admitted is not None else None
    except ProfileError as exc:
        return _error("benchmark", str(exc))
    if admitted is not None and args.max_budget is not None:  # the climb is judged on the profile's SLOs
        try:
            climb_slos = SLOs.of_profile(admitted.slos)
        except ValueError as exc:
            return _error("benchmark", f"--max-budget: {args.admitted}: slos: {exc}")
        if not climb_slos.targets:
            return _error("benchmark", f"--max-budget: {args.admitted} names no SLO to climb against")
    plan = LoadPlan(
        input_lens=_flatten(args.input_lens), output_lens=_flatten(args.output_lens),
        rates=_flatten(args.rates), num_prompts=args.num_prompts, seed=args.seed,
        max_backlog=args.max_backlog, drain_timeout=args.drain_timeout, admitted=admitted,
        max_budget=args.max_budget,
        **({"budget_factors": _flatten(args.budget_factors)} if args.budget_factors else {}))
    opts = BenchmarkOptions(
        model=args.model, endpoint=args.endpoint, output=args.output, plan=plan, append=args.append,
        api=args.api, api_key=args.api_key, exact_length=args.exact_length, temperature=args.temperature,
        fit_context=args.input_lens == [list(DEFAULT_INPUT_LENS)] and admitted is None)
    cells = plan.cells()
    sys.stderr.write(f"benchmark {opts.model} at {public_url(opts.url())}: {len(cells)} cells × "
                     f"{plan.num_prompts} requests, at least "
                     f"{sum(plan.scheduled_seconds(c) for c in cells):.0f}s "
                     f"→ {opts.output}\n")

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            report = await run_benchmark(opts, stop)
        except EndpointError as exc:
            return _error("benchmark", str(exc))
        except OSError as exc:
            return _error("benchmark", f"cannot write {opts.output}: {exc.strerror or exc}")
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        summary = f"{report.cells_written} cells written to {opts.output}"
        if report.failed_requests:
            summary += f"; {report.failed_requests} failed requests"
        if report.overloaded:
            summary += f"; {len(report.overloaded)} overloaded cells"
        if report.skipped:
            summary += f"; {len(report.skipped)} higher-rate cells skipped after an overload"
        if report.climbed:
            summary += f"; {report.climbed} budgets run past the ladder (they met the SLO below)"
        if report.interrupted:
            sys.stderr.write(f"interrupted: the unfinished cell was dropped; {summary}\n")
            return EXIT_INTERRUPTED
        sys.stderr.write(summary + "\n")
        return 0

    return asyncio.run(main())


def _gen_profile(args: argparse.Namespace) -> int:
    """AIBrix's selection rule over a benchmark file: per (output, input) cell the highest request rate that
    meets every SLO and kept up with its arrivals; written as AIBrix's profile JSON."""
    from extproc.gpu_profiles import BUDGET_MARGIN
    from extproc.profiling.gen_profile import generate
    from extproc.profiling.output import OutputError, is_redis_url, parse_redis_url, write_profile
    from extproc.profiling.records import BenchmarkError
    from extproc.profiling.selection import SLOs

    try:
        if args.output and is_redis_url(args.output):
            parse_redis_url(args.output)  # a bad URL fails before any work
        slos = SLOs(args.percentile, {m.lower(): getattr(args, m.lower()) for m in SLO_METRICS
                                      if getattr(args, m.lower()) is not None})
        margin = BUDGET_MARGIN if args.budget_margin is None else args.budget_margin
        if args.budget_margin is not None and args.admitted is None:
            return _error("gen-profile", "--budget-margin needs --admitted (it picks among admitted budgets)")
        if not (math.isfinite(margin) and margin >= 1):
            return _error("gen-profile", f"--budget-margin must be a number >= 1, got {args.budget_margin:g}")
        profile, grid = generate(args.deployment, args.benchmark, args.cost, slos, created=time.time(),
                                 admitted_benchmark=args.admitted, budget_margin=margin)
        for warning in grid.warnings:
            sys.stderr.write(f"warning: {warning}\n")
        if args.plot:
            from extproc.profiling.plot import plot_grid

            plot_grid(grid, args.plot, f"{args.deployment}: SLOs {slos.as_profile()}")
            sys.stderr.write(f"plot written to {args.plot}\n")
        write_profile(profile, args.deployment, args.output)
    except (BenchmarkError, OutputError, ValueError) as exc:
        return _error("gen-profile", str(exc))
    except OSError as exc:
        return _error("gen-profile", f"{exc.filename or ''} {exc.strerror or exc}".strip())
    return 0
