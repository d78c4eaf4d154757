"""`extproc bench overhead|memory|floor`: the gateway's cost against Envoy alone, its memory over time,
and what a trivial ext_proc server costs (the floor under the gateway)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OVERHEAD_HELP = """\
One run, one local upstream (extproc/perf/upstream.py: JSON at once, SSE at a live pace), four paths
interleaved round by round: the upstream directly (reference), (a) Envoy alone (the client sets the
destination header), (b) Envoy + gateway routing (ext_proc, request side; no Lua, no access log), (c)
the full path (routing + Lua tally + gRPC access log). In the JSON output, "direct_*" means (a), Envoy
alone, and "gateway_*" means (c); "upstream_*" is the no-proxy reference. Added figures are (c) - (a)
per round, median over rounds. Streaming runs sweep concurrent streams through (a) and (c) and check
the gateway's tally (extproc_output_tokens_total) against the tokens the upstream sent.
"""


SYNC_HELP = """\
G gateways (the project's own RedisState, in this process) x P pods against a real redis-server on a
free loopback port; every pod holds --inflight requests and completes --rate a second fleet-wide. Per
gateway turn: sync CPU and latency; per fleet turn: Redis CPU, commands and bytes (INFO), scaled to
1/interval fleet turns a second; staleness and views that disagree with what the others last wrote.
See extproc/perf/sync.py for how each figure is taken.
"""


def add_commands(sub: Any) -> None:
    """Add `bench` to `extproc`'s subcommands."""
    bench = sub.add_parser("bench", help="gateway benchmarks: overhead against Envoy alone, memory")
    kinds = bench.add_subparsers(dest="bench", required=True)

    o = kinds.add_parser("overhead", help="latency, req/s, streamed tokens/s and CPU: gateway vs Envoy alone",
                         description=OVERHEAD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    o.add_argument("--duration", type=float, default=3.0,
                   help="seconds measured per JSON run (streaming runs: 1.5x); scales the whole run")
    o.add_argument("--rounds", type=int, default=3, help="rounds of the JSON runs")
    o.add_argument("--stream-rounds", type=int, default=2, help="rounds of the streaming sweep")
    o.add_argument("--concurrency", type=_ints, default=(1, 16, 64), help="JSON concurrencies, e.g. 1,16,64")
    o.add_argument("--streams", type=_ints, default=(64, 128, 256, 384, 512),
                   help="concurrent streams of the sweep, e.g. 64,256,512 (empty: no streaming)")
    o.add_argument("--stream-tokens", type=int, default=64, help="output tokens per streamed request")
    o.add_argument("--itl-ms", type=float, default=20.0, help="upstream pace: ms between tokens of a stream")
    o.add_argument("--paths", type=lambda t: tuple(t.split(",")), default=("direct", "envoy", "routed", "full"),
                   help="subset of direct,envoy,routed,full,workers,tally,limited,duplex,pool,pool-buffered,"
                        "pool-floor (processes to start; duplex: full with a full-duplex body, "
                        "pool: `extproc envoy-config --pool`, pool-buffered: that pool with a buffered body, "
                        "pool-floor: the pool's Envoy with a fixed-answer picker)")
    o.add_argument("--stream-paths", type=lambda t: tuple(t.split(",")), default=("envoy", "full"),
                   help="paths of the streaming sweep, of envoy,routed,full,tally (tally: Envoy + the Lua "
                        "tally without a gateway: the Lua's share of (c); needs it in --paths too)")
    o.add_argument("--workers", type=int, default=2, help="gateway processes of the 'workers' path")
    o.add_argument("--limits-redis-url", help="the 'limited' path keeps its budgets in this Redis "
                   "(default: in process)")
    o.add_argument("--decisions", type=int, default=3000, help="routing decisions timed per pool size")
    o.add_argument("--baseline", type=Path, metavar="DIR",
                   help="a checkout of an earlier version (git worktree or `git archive`): its gateway and "
                        "Envoy bootstrap run as path 'before' beside the others, JSON and streaming (and "
                        "its picker behind the pool's Envoy as 'pool-before', with pool in --paths)")
    o.add_argument("--json", type=Path, help="write the summary (and every run) here")
    o.add_argument("--profile", type=Path, metavar="DIR",
                   help="py-spy the gateways during round 1's heaviest runs; collapsed stacks go to DIR")
    o.add_argument("--keep-logs", action="store_true", help="print where process logs are and keep them")
    o.set_defaults(func=_overhead)

    m = kinds.add_parser("memory", help="RSS of the state machine over many requests (in process)")
    m.add_argument("--requests", type=int, default=1_000_000)
    m.add_argument("--every", type=int, default=50_000, help="sample RSS every N requests")
    m.add_argument("--png", type=Path, default=Path("bench-memory.png"),
                   help="plot here when matplotlib is installed")
    m.add_argument("--json", type=Path, help="write the curve here")
    m.add_argument("--large-bodies", action="store_true",
                   help="instead: the live gateway's RSS after large bodies through Envoy, one after "
                        "another, then several at once (extproc/perf/large_bodies.py)")
    m.add_argument("--body-mib", type=float, default=7.0, help="--large-bodies: each body's size")
    m.add_argument("--sequential", type=int, default=80, help="--large-bodies: bodies one after another")
    m.add_argument("--concurrent", type=int, default=8, help="--large-bodies: bodies at once, per round")
    m.set_defaults(func=_memory)

    s = kinds.add_parser("sync", help="Redis sharing: sync CPU, Redis CPU, commands, bytes, staleness; G x P",
                         description=SYNC_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--sizes", type=_sizes, default=((1, 1000), (16, 1000)),
                   help="gateways x pods per run, e.g. 1x1000,16x1000")
    s.add_argument("--models", type=int, default=4,
                   help="models the pods are spread over (a model's keys share a Redis hash slot)")
    s.add_argument("--rate", type=float, default=10.0, help="completions per pod per second, fleet-wide")
    s.add_argument("--inflight", type=int, default=32, help="requests each pod holds, fleet-wide")
    s.add_argument("--interval", type=float, default=0.1, help="the gateways' sync interval, seconds")
    s.add_argument("--turns", type=int, default=40,
                   help="fleet turns measured per run (after 5 warm-up), rounded up to whole cycles of the "
                        "speed read (every other heartbeat: 20 turns at 0.1 s), so its turns count fairly")
    s.add_argument("--no-speed", dest="speed", action="store_false",
                   help="leave out the speed evidence gateways share once a heartbeat")
    s.add_argument("--baseline", type=Path, metavar="DIR",
                   help="a checkout of an earlier version (git worktree or `git archive`): its RedisState "
                        "runs each size first, against the same redis-server")
    s.add_argument("--collector", choices=("on", "frozen"), default="on",
                   help="frozen: the heap as of the warm-up (all G gateways' state, in this one process) "
                        "leaves the garbage collector's walks, as one gateway's process would not carry "
                        "the others'; on: as is, an upper bound")
    s.add_argument("--redis-cluster", type=lambda t: [n for n in t.split(",") if n], metavar="HOST:PORT,...",
                   help="run against this Redis Cluster (seed nodes; it is flushed) instead of a "
                        "redis-server of the bench's own; Redis's figures summed over its masters, and "
                        "given per master")
    s.add_argument("--processes", action="store_true",
                   help="the gateways side by side, one process each (extproc/perf/sync_procs.py), "
                        "instead of one after another in this process; the views and speed sums are "
                        "checked only there")
    s.add_argument("--json", type=Path, help="write every run's summary here")
    s.set_defaults(func=_sync)

    f = kinds.add_parser("floor", help="server CPU per ext_proc stream of a trivial server (no routing)")
    f.add_argument("--servers", type=lambda t: tuple(t.split(",")), default=("aio", "sync"),
                   help="of aio (grpc.aio, the gateway's) and sync (grpc's thread-pool server)")
    f.add_argument("--rates", type=lambda t: tuple(float(x) for x in t.split(",")), default=(0.0, 1000.0),
                   help="stream starts per second; 0: back to back (closed loop)")
    f.add_argument("--concurrency", type=int, default=64, help="streams open at most")
    f.add_argument("--duration", type=float, default=5.0, help="seconds measured per run")
    f.add_argument("--rounds", type=int, default=3)
    f.add_argument("--threads", type=int, default=8, help="the sync server's thread pool")
    f.set_defaults(func=_floor)

    rl = kinds.add_parser("limits", help="what the rate-limit check adds to a request's side, in process")
    rl.add_argument("--requests", type=int, default=2000, help="requests per variant and round")
    rl.add_argument("--rounds", type=int, default=5, help="rounds; the variants take turns in each")
    rl.add_argument("--redis-url", help="also time limits kept in this Redis (e.g. a local redis-server)")
    rl.set_defaults(func=_limits)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


def _clean(value: Any) -> Any:
    """NaN is not JSON: write null; paths as text."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _overhead(args: argparse.Namespace) -> int:
    from extproc.perf.decision import decision_times
    from extproc.perf.overhead import Settings, raw, run_all, summarize
    from extproc.perf.report import render
    from extproc.perf.stack import Stack, strategy_for_bench

    paths, stream_paths = args.paths, args.stream_paths
    if args.baseline is not None:
        paths, stream_paths = (*paths, "before"), (*stream_paths, "before")
        if "pool" in paths:  # the pool path with the baseline's picker too
            paths = (*paths, "pool-before")
    s = Settings(duration=args.duration, rounds=args.rounds, stream_rounds=args.stream_rounds,
                 concurrencies=args.concurrency, streams=args.streams, stream_tokens=args.stream_tokens,
                 itl_ms=args.itl_ms, paths=paths, stream_paths=stream_paths,
                 profile_dir=args.profile)
    strategy = strategy_for_bench()
    if strategy != "load-balance":
        print("note: load-balance is not registered; routing with least-request", file=sys.stderr)
    started = time.time()
    log_dir = Path(tempfile.mkdtemp(prefix="extproc-bench-"))
    if args.keep_logs:
        print(f"process logs: {log_dir}", file=sys.stderr)
    with Stack(log_dir, s.itl_ms, strategy, paths=s.paths, baseline=args.baseline,
               workers=args.workers, limits_redis_url=args.limits_redis_url) as stack:
        runs = run_all(stack, s, progress=lambda line: print(line, file=sys.stderr, flush=True))
        upstream_cpu = stack.upstream_stats()["cpu_s"]
    summary = summarize(runs, s)
    summary["decision_us"] = decision_times(decisions=args.decisions, strategy=strategy) \
        if "full" in s.paths or "routed" in s.paths else {}
    summary["meta"] = {"strategy": strategy, "settings": {k: getattr(s, k) for k in s.__slots__},
                       "wall_s": time.time() - started, "upstream_cpu_s": upstream_cpu,
                       "cpus": _cpu_count(), "loadavg": _loadavg()}
    print(render(summary, s.concurrencies))
    if args.profile:
        _print_profiles(args.profile)
    if args.json:
        args.json.write_text(json.dumps(_clean({**summary, "runs": raw(runs)}), indent=1))
    if not args.keep_logs:
        import shutil

        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _print_profiles(directory: Path) -> None:
    from extproc.perf.profile import top_frames, top_self

    for path in sorted(directory.glob("*.txt")):
        text = path.read_text()
        print(f"\npy-spy, gateway during {path.stem} ({path}); share of samples, self:")
        for frame, own in top_self(text, 10):
            print(f"  {own * 100:5.1f}  {frame}")
        print("  the gateway's own code (self, inclusive):")
        for frame, own, incl in top_frames(text, 10_000):
            if "extproc/" in frame and incl >= 0.01 and not frame.endswith(("(extproc/cli.py)",
                                                                            "(extproc/server/app.py)")):
                print(f"  {own * 100:5.1f} {incl * 100:5.1f}  {frame}")


def _limits(args: argparse.Namespace) -> int:
    from extproc.perf.limits import limit_times, render

    print(render(limit_times(args.requests, args.rounds, args.redis_url)))
    return 0


def _floor(args: argparse.Namespace) -> int:
    from extproc.perf.floor import VARIANTS, render, run

    unknown = set(args.servers) - set(VARIANTS)
    if unknown:
        print(f"extproc bench floor: unknown --servers {sorted(unknown)} (of {', '.join(VARIANTS)})",
              file=sys.stderr)
        return 2
    runs = run(args.servers, args.rates, args.concurrency, args.duration, args.rounds, args.threads,
               Path(tempfile.mkdtemp(prefix="extproc-floor-")))
    print(render(runs, args.concurrency))
    return 0


def _sync(args: argparse.Namespace) -> int:
    from extproc.perf import sync, sync_procs

    print(" | ".join(sync.HEADER), flush=True)
    runs = sync.run(list(args.sizes), models=args.models, rate=args.rate, inflight=args.inflight,
                    interval=args.interval, turns=args.turns, speed=args.speed, collector=args.collector,
                    baseline=args.baseline, cluster=args.redis_cluster,
                    side_by_side=sync_procs.run_processes if args.processes else None,
                    progress=lambda line: print(line, flush=True))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in text.split(","):
        g, _, p = part.partition("x")
        out.append((int(g), int(p)))
    return tuple(out)


def _memory(args: argparse.Namespace) -> int:
    if args.large_bodies:
        from extproc.perf import large_bodies

        report = large_bodies.run(int(args.body_mib * large_bodies.MIB), args.sequential, args.concurrent,
                                  progress=lambda line: print(line, flush=True))
        print("\n".join(report.lines()))
        return 0
    from extproc.perf.memory import plot, run

    curve = run(args.requests, args.every, progress=lambda line: print(line, flush=True))
    slope = curve.slope()
    print(f"\n{args.requests} requests in {curve.seconds:.1f} s; RSS {curve.rss[0] / 2**20:.1f} -> "
          f"{curve.rss[-1] / 2**20:.1f} MiB; slope over the second half: {slope:.3f} bytes/request; "
          f"routed {curve.routed}, still open {curve.open_after}")
    if plot(curve, args.png):
        print(f"plot: {args.png}")
    if args.json:
        args.json.write_text(json.dumps({"requests": curve.requests, "rss": curve.rss,
                                         "slope_bytes_per_request": _clean(slope), "seconds": curve.seconds,
                                         "routed": curve.routed, "open_after": curve.open_after}))
    return 0


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 0


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="extproc")  # its one subcommand prints as "extproc bench"
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
