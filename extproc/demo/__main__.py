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

from extproc.demo.open_loop import Outcome, drive
from extproc.demo.plan import (
    BURST_LOAD,
    BURST_PHASES,
    BURST_SEED_OFFSET,
    FULL,
    LOAD,
    MODEL,
    POOL,
    QUICK,
    STRATEGIES,
    Phases,
    Plan,
    burst_label,
    burst_phases,
)
from extproc.demo.report import PhaseResult, quantile_from_buckets, summarise, table, write_json, write_png
from extproc.localstack import LocalStack, Proc, free_port, http_get

GENERATED = "vllm:generation_tokens_total"
WAITING = "vllm:num_requests_waiting"
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
QUEUE_SAMPLE_S = 0.25  # how often a burst phase reads the engines' queues
CAPACITY = "extproc_pod_capacity_tokens_per_second"
OBSERVED = "extproc_pod_observed_tokens_per_second"
RELOAD_TIMEOUT_S = 20.0  # the gateway polls its file every second and applies a change after two polls


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


def gateway_config(ports: dict[str, int], capacity: str | None = None) -> dict:
    """The demo's gateway.yaml; `capacity` sets routing.load_balance.capacity (None: the default)."""
    config: dict = {"models": {MODEL: {"pods": [
        {"name": n, "address": f"127.0.0.1:{ports[n]}", "deployment": f"{MODEL}-{g.lower()}",
         "labels": {"gpu": g}} for n, g in POOL]}}}
    if capacity is not None:
        config["routing"] = {"load_balance": {"capacity": capacity}}
    return config


def mode_shown(gauges: dict[str, dict[str, float]]) -> str | None:
    """Which capacity mode the gateway's gauges show: under `observed` the capacity gauge is the observed
    one for every pod; under `speed` it is the fitted saturated figure, which differs. None: no pod has
    both gauges yet, so the metrics cannot tell."""
    both = [(c, gauges[OBSERVED][pod]) for pod, c in gauges[CAPACITY].items() if pod in gauges[OBSERVED]]
    if not both:
        return None
    return "observed" if all(abs(c - o) <= 1e-9 * max(1.0, o) for c, o in both) else "speed"


class Demo:
    def __init__(self, plan: Plan, phases: Phases, stack: LocalStack, ports: dict[str, int],
                 seed: int, burst_factor: float | None = None) -> None:
        self.plan, self.phases, self.stack, self.ports = plan, phases, stack, ports
        self.rng = random.Random(seed)
        self.seed, self.burst_factor = seed, burst_factor
        self.tty = sys.stdout.isatty()

    async def engine_samples(self, session: aiohttp.ClientSession) -> dict[str, list]:
        """Each engine's /metrics samples."""
        out = {}
        for name, port in self.ports.items():
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            out[name] = [s for f in text_string_to_metric_families(text) for s in f.samples]
        return out

    async def generated(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """Output tokens each engine has generated so far."""
        return {name: sum(s.value for s in samples if s.name == GENERATED)
                for name, samples in (await self.engine_samples(session)).items()}

    async def ttft_buckets(self, session: aiohttp.ClientSession) -> dict[float, float]:
        """The pool's time-to-first-token histogram so far: cumulative count per upper bound, all engines."""
        out: dict[float, float] = {}
        for samples in (await self.engine_samples(session)).values():
            for s in samples:
                if s.name == TTFT_BUCKET:
                    le = float(s.labels["le"])
                    out[le] = out.get(le, 0.0) + s.value
        return out

    async def watch_queues(self, session: aiohttp.ClientSession, peaks: dict[str, float]) -> None:
        """The deepest queue each engine has had, sampled until cancelled."""
        while True:
            for name, samples in (await self.engine_samples(session)).items():
                waiting = sum(s.value for s in samples if s.name == WAITING)
                peaks[name] = max(peaks.get(name, 0.0), waiting)
            await asyncio.sleep(QUEUE_SAMPLE_S)

    async def gauges(self, session: aiohttp.ClientSession) -> dict[str, dict[str, float]]:
        """The gateway's capacity and observed gauges per pod of the demo's model."""
        async with session.get(self.stack.admin_url + "/metrics") as resp:
            text = await resp.text()
        out: dict[str, dict[str, float]] = {CAPACITY: {}, OBSERVED: {}}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in out and s.labels.get("model") == MODEL:
                    out[s.name][s.labels["pod"]] = s.value
        return out

    def reloads(self) -> int:
        """How many config reloads the gateway has logged (it has no reload counter, only one of errors)."""
        assert self.stack.gateway is not None
        return self.stack.gateway.log_path.read_text(errors="replace").count(
            f"config {self.stack.config_path} reloaded")

    async def set_capacity_mode(self, session: aiohttp.ClientSession, mode: str) -> None:
        """Rewrite the config with `mode` and wait until the gateway has applied it: it has logged one more
        reload and its gauges show the mode (see mode_shown)."""
        before = self.reloads()
        self.stack.write_config(gateway_config(self.ports, mode))
        deadline = time.monotonic() + RELOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.reloads() > before and mode_shown(await self.gauges(session)) == mode:
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"the gateway did not switch to capacity: {mode} within {RELOAD_TIMEOUT_S:.0f} s "
                           f"(reloads logged: {self.reloads() - before}; see {self.stack.gateway.log_path})")

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

    async def phase(self, session: aiohttp.ClientSession, label: str, header: str, ph: Phases,
                    rng: random.Random, burst_rate: float | None = None) -> PhaseResult:
        """Warm-up at the plan's rate, the measured window (at `burst_rate` when given), the drain. A burst
        phase also samples the gateway's capacity gauges as the burst begins and as its window ends, the
        engines' queues from the burst's start to the end of the drain, and their TTFT histograms then."""
        outcomes: list[Outcome] = []
        tasks: set[asyncio.Task] = set()
        stage = ["normal" if burst_rate else "warm-up"]
        started = time.monotonic()
        shown = asyncio.create_task(self.progress(label, stage, outcomes, started,
                                                  ph.warmup_s + ph.measure_s + ph.drain_s))
        gauges: list[dict[str, dict[str, float]]] = []
        ttft: list[dict[float, float]] = []
        peaks: dict[str, float] = {}
        watcher: asyncio.Task | None = None
        try:
            await drive(self.stack.url, header, self.plan, ph.warmup_s, rng, session, [], tasks)
            stage[0] = "burst" if burst_rate else "measuring"
            if burst_rate:
                gauges.append(await self.gauges(session))
                ttft.append(await self.ttft_buckets(session))
                watcher = asyncio.create_task(self.watch_queues(session, peaks))
            before, t0 = await self.generated(session), time.monotonic()
            await drive(self.stack.url, header, self.plan, ph.measure_s, rng, session, outcomes, tasks,
                        rate=burst_rate)
            after, seconds = await self.generated(session), time.monotonic() - t0
            if burst_rate:
                gauges.append(await self.gauges(session))
            stage[0] = "draining"
            deadline = time.monotonic() + ph.drain_s
            while any(o.latency_s is None for o in outcomes) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if burst_rate:
                ttft.append(await self.ttft_buckets(session))
        finally:
            shown.cancel()
            if watcher is not None:
                watcher.cancel()
            for o in outcomes:
                o.unfinished = o.latency_s is None
            for task in list(tasks):  # the rest are cut off; their latency so far is a lower bound
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.tty:
            print()
        result = summarise(label, header, outcomes, POOL, {n: after[n] - before[n] for n in after},
                           self.plan.saturated, seconds)
        if gauges:
            start, end = gauges
            for name, pod in result.pods.items():
                pod.capacity_start = start[CAPACITY].get(name)
                pod.capacity_end = end[CAPACITY].get(name)
                pod.observed_end = end[OBSERVED].get(name)
                pod.peak_waiting = int(peaks.get(name, 0))
        if len(ttft) == 2:
            start, end = ttft
            burst = sorted((le, end[le] - start.get(le, 0.0)) for le in end)
            result.ttft_p99_s = quantile_from_buckets(burst, 0.99)
        return result

    async def burst(self, session: aiohttp.ClientSession, strategy: str, mode: str) -> PhaseResult:
        """`strategy` under one capacity mode, on the same arrivals as the other burst phases."""
        await self.set_capacity_mode(session, mode)
        assert self.burst_factor is not None
        rng = random.Random(self.seed + BURST_SEED_OFFSET)
        rate = self.plan.rate * self.burst_factor
        result = await self.phase(session, burst_label(strategy, mode), STRATEGIES[strategy],
                                  burst_phases(self.phases), rng, burst_rate=rate)
        result.capacity_mode, result.rate_rps = mode, rate
        return result

    async def run(self, strategies: list[str]) -> list[PhaseResult]:
        timeout = aiohttp.ClientTimeout(total=self.phases.measure_s + self.phases.drain_s + 60)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            results = [await self.phase(session, s, STRATEGIES[s], self.phases, self.rng) for s in strategies]
            if self.burst_factor is not None:
                results += [await self.burst(session, *phase) for phase in BURST_PHASES]
            return results


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
    parser.add_argument("--burst", action="store_true",
                        help="then least-request, and load-balance under capacity: observed and capacity: "
                             "speed, each with the same load burst: the engines' TTFT p99 and queues, and "
                             "the capacity the gateway reported per pod")
    parser.add_argument("--burst-factor", type=float, metavar="X",
                        help=f"the burst's rate as a multiple of the normal one (default: up to "
                             f"{BURST_LOAD * 100:.0f}%% of the pool's saturated throughput, "  # %%: argparse
                             f"{BURST_LOAD / LOAD:.2f}x at the default load)")
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
    if args.burst_factor is not None and not args.burst:
        parser.error("--burst-factor needs --burst")
    if args.burst:
        args.burst_factor = args.burst_factor or BURST_LOAD / args.load
        if not 0 < args.burst_factor * args.load <= 2:
            parser.error("--burst-factor: the burst's load must be in (0, 2] of the saturated throughput")
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
          f"{phases.drain_s:.0f} s drain; logs in {log_dir}")
    if args.burst:
        bp = burst_phases(phases)
        print(f"then --burst: {', '.join(burst_label(*p) for p in BURST_PHASES)}, each "
              f"{bp.warmup_s:.0f} s at {plan.rate:.1f} req/s, then {bp.measure_s:.0f} s measured at "
              f"{plan.rate * args.burst_factor:.1f} req/s ({args.burst_factor:.2f}x = "
              f"{args.load * args.burst_factor:.0%} of saturated), the same arrivals for all")
    print()
    engines: dict[str, Proc] = {}
    stack = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
    try:
        ports = {}
        for name, gpu in POOL:
            engines[name], ports[name] = start_engine(name, gpu, log_dir)
        stack.write_config(gateway_config(ports))
        stack.start_gateway()
        stack.start_envoy()
        procs = {"envoy": stack.envoy, "gateway": stack.gateway, **engines}
        cpu_before = {k: cpu_seconds(p.popen.pid) for k, p in procs.items()}
        own_before, wall = os.times(), time.monotonic()
        demo = Demo(plan, phases, stack, ports, args.seed, args.burst_factor if args.burst else None)
        results = asyncio.run(demo.run(args.strategies))
        wall = time.monotonic() - wall
        print("\n" + table(results, plan.saturated))
        shares = {k: (cpu_seconds(p.popen.pid) - cpu_before[k]) / wall for k, p in procs.items()}
        own = os.times()
        shares["load client"] = (own.user + own.system - own_before.user - own_before.system) / wall
        print("\nCPU, share of one core over the run: "
              + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
              + f" (this machine: {os.cpu_count()} cores)")
        png = args.png or log_dir / "demo.png"
        burst = f"; burst {plan.rate * args.burst_factor:.0f} req/s" if args.burst else ""
        write_png(results, png, f"{MODEL} on 2x L20 + 1x A100-80GB, {plan.rate:.0f} req/s "
                                f"({args.load:.0%} of saturated){burst}", plan.saturated)
        print(f"chart: {png}")
        if args.json:
            extra = {"model": MODEL, "rate_rps": plan.rate, "load": args.load,
                     "saturated_tokens_per_s": plan.saturated, "cpu_share": shares}
            if args.burst:
                extra["burst"] = {"factor": args.burst_factor, "rate_rps": plan.rate * args.burst_factor,
                                  "phases": [burst_label(*p) for p in BURST_PHASES]}
            write_json(results, args.json, extra)
            print(f"json: {args.json}")
        return 0
    finally:
        stack.stop()
        for proc in engines.values():
            proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
