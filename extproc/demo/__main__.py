"""`extproc demo` / `make demo`: a heterogeneous pool behind real Envoy and the gateway, the same open-loop
load routed by round-robin, least-request and load-balance, and the spec's before/after table.

No cluster, no Redis, no GPU: the engine simulator stands in for two L20s and one A100-80GB serving
llama3-8b. Everything binds to 127.0.0.1. See docs/demo.md for what the figures mean.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.demo.load import Outcome, drive
from extproc.demo.plan import FULL, LOAD, MODEL, POOL, QUICK, STRATEGIES, Phases, Plan
from extproc.demo.report import PhaseResult, summarise, table, write_json, write_png
from extproc.localstack import LocalStack, Proc, free_port, http_get

GENERATED = "vllm:generation_tokens_total"


def start_engine(name: str, gpu: str, log_dir: Path) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc(f"engine-{name}", [sys.executable, "-m", "extproc", "engine-sim", "--gpu", gpu,
                                   "--model", MODEL, "--port", str(port), "--name", name,
                                   "--seed", str(port)], log_dir)
    proc.wait_ready(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200)
    return proc, port


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (Linux /proc); 0 where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class Demo:
    def __init__(self, plan: Plan, phases: Phases, stack: LocalStack, ports: dict[str, int],
                 seed: int) -> None:
        self.plan, self.phases, self.stack, self.ports = plan, phases, stack, ports
        self.rng = random.Random(seed)
        self.tty = sys.stdout.isatty()

    async def generated(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """Output tokens each engine has generated so far."""
        out = {}
        for name, port in self.ports.items():
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            out[name] = sum(s.value for f in text_string_to_metric_families(text)
                            for s in f.samples if s.name == GENERATED)
        return out

    async def progress(self, strategy: str, stage: list[str], outcomes: list[Outcome], started: float,
                       total_s: float) -> None:
        last_line = 0.0
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            answered = sum(o.latency_s is not None for o in outcomes)
            line = (f"[{strategy}] {stage[0]:9} {now - started:5.0f}/{total_s:.0f} s  sent {len(outcomes)}"
                    f"  answered {answered}  in flight {len(outcomes) - answered}")
            if self.tty:
                print("\r" + line.ljust(90), end="", flush=True)
            elif now - last_line >= 10:
                print(line, flush=True)
                last_line = now

    async def phase(self, session: aiohttp.ClientSession, strategy: str) -> PhaseResult:
        header, ph = STRATEGIES[strategy], self.phases
        outcomes: list[Outcome] = []
        tasks: set[asyncio.Task] = set()
        stage = ["warm-up"]
        started = time.monotonic()
        shown = asyncio.create_task(self.progress(strategy, stage, outcomes, started,
                                                  ph.warmup_s + ph.measure_s + ph.drain_s))
        try:
            await drive(self.stack.url, header, self.plan, ph.warmup_s, self.rng, session, [], tasks)
            stage[0] = "measuring"
            before, t0 = await self.generated(session), time.monotonic()
            await drive(self.stack.url, header, self.plan, ph.measure_s, self.rng, session, outcomes, tasks)
            after, seconds = await self.generated(session), time.monotonic() - t0
            stage[0] = "draining"
            deadline = time.monotonic() + ph.drain_s
            while any(o.latency_s is None for o in outcomes) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            shown.cancel()
            for o in outcomes:
                o.unfinished = o.latency_s is None
            for task in list(tasks):  # the rest are cut off; their latency so far is a lower bound
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.tty:
            print()
        return summarise(strategy, header, outcomes, POOL, {n: after[n] - before[n] for n in after},
                         self.plan.saturated, seconds)

    async def run(self, strategies: list[str]) -> list[PhaseResult]:
        timeout = aiohttp.ClientTimeout(total=self.phases.measure_s + self.phases.drain_s + 60)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            return [await self.phase(session, s) for s in strategies]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="extproc demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter phases: about a minute in all")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help=f"comma-separated, in order (default: {','.join(STRATEGIES)})")
    parser.add_argument("--load", type=float, default=LOAD,
                        help="offered load, a fraction of the pool's saturated throughput (%(default)s)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the results as JSON")
    parser.add_argument("--png", type=Path, metavar="OUT", help="the chart (default: in the run's log dir)")
    parser.add_argument("--phases", metavar="WARMUP,MEASURE,DRAIN",
                        help="seconds of each strategy's phases (default: 10,30,30; --quick 5,12,15)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.phase_times = QUICK if args.quick else FULL
    if args.phases:
        try:
            args.phase_times = Phases(*(float(x) for x in args.phases.split(",")))
        except (TypeError, ValueError):
            parser.error("--phases: three numbers of seconds, e.g. 5,12,15")
        if min(args.phase_times.warmup_s, args.phase_times.drain_s) < 0 or args.phase_times.measure_s <= 0:
            parser.error("--phases: the measured window must be positive, the others not negative")
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown or not args.strategies:
        parser.error(f"--strategies: choose from {', '.join(STRATEGIES)} "
                     f"(got {', '.join(unknown) or 'none'})")
    if not 0 < args.load <= 2:
        parser.error("--load must be in (0, 2]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan, phases = Plan.make(args.load, args.seed), args.phase_times
    log_dir = Path(tempfile.mkdtemp(prefix="extproc-demo-"))
    print(f"pool: {', '.join(f'{n} ({g})' for n, g in POOL)} serving {MODEL} (engine simulator, live pace)")
    print("saturated output tokens/s per replica for this mix: "
          + ", ".join(f"{g} {v:.0f}" for g, v in plan.saturated.items()))
    print(f"load: {plan.rate:.1f} requests/s (Poisson, non-streaming, ~{plan.mean_output:.0f} output tokens "
          f"each) = {args.load:.0%} of the pool's saturated throughput")
    print(f"each strategy: {phases.warmup_s:.0f} s warm-up, {phases.measure_s:.0f} s measured, up to "
          f"{phases.drain_s:.0f} s drain; logs in {log_dir}\n")
    engines: dict[str, Proc] = {}
    stack = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
    try:
        ports = {}
        for name, gpu in POOL:
            engines[name], ports[name] = start_engine(name, gpu, log_dir)
        stack.write_config({"models": {MODEL: {"pods": [
            {"name": n, "address": f"127.0.0.1:{ports[n]}", "deployment": f"{MODEL}-{g.lower()}",
             "labels": {"gpu": g}} for n, g in POOL]}}})
        stack.start_gateway()
        stack.start_envoy()
        procs = {"envoy": stack.envoy, "gateway": stack.gateway, **engines}
        cpu_before = {k: cpu_seconds(p.popen.pid) for k, p in procs.items()}
        own_before, wall = os.times(), time.monotonic()
        results = asyncio.run(Demo(plan, phases, stack, ports, args.seed).run(args.strategies))
        wall = time.monotonic() - wall
        print("\n" + table(results))
        shares = {k: (cpu_seconds(p.popen.pid) - cpu_before[k]) / wall for k, p in procs.items()}
        own = os.times()
        shares["load client"] = (own.user + own.system - own_before.user - own_before.system) / wall
        print("\nCPU, share of one core over the run: "
              + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
              + f" (this machine: {os.cpu_count()} cores)")
        png = args.png or log_dir / "demo.png"
        write_png(results, png, f"{MODEL} on 2x L20 + 1x A100-80GB, {plan.rate:.0f} req/s "
                                f"({args.load:.0%} of saturated)")
        print(f"chart: {png}")
        if args.json:
            write_json(results, args.json, {"model": MODEL, "rate_rps": plan.rate, "load": args.load,
                                            "saturated_tokens_per_s": plan.saturated, "cpu_share": shares})
            print(f"json: {args.json}")
        return 0
    finally:
        stack.stop()
        for proc in engines.values():
            proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
