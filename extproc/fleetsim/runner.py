"""Run a scenario under several strategies (in parallel worker processes) and collect one report.

Every strategy replays the same arrivals (same seed), so differences are the strategy's. Workers are
forked processes, one strategy each: the engine model is pure Python and CPU-bound, and results do not
depend on how many run at once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.fleetsim.arrivals import generate
from extproc.fleetsim.loop import run
from extproc.fleetsim.metrics import summarize
from extproc.fleetsim.saturation import saturated_throughput
from extproc.fleetsim.scenario import SLO_KEYS, Scenario
from extproc.gpu_profiles import GpuProfile, load_profile


@dataclass(frozen=True, slots=True)
class Options:
    gateways: int = 1
    share_tokens: bool = True
    seed: int = 0
    jobs: int = 0  # 0: one per strategy, at most the CPU count
    oracle_capacity: bool = False  # diagnostic: true saturated capacities instead of learned ones
    optimizer: bool = False  # the GPU optimizer scales each deployment (fleetsim.autoscale)
    profiles_dir: str | None = None  # the optimizer's GPU profiles (AIBrix JSON, "gpu" = deployment)


Progress = Callable[[str, float], None]  # (strategy, virtual seconds done)
_queue: Any = None  # the forked workers' progress channel


def run_strategy(scenario: Scenario, strategy: str, options: Options,
                 progress: Progress | None = None) -> dict[str, Any]:
    arrivals = generate(scenario, options.seed, options.gateways)
    started = time.perf_counter()
    result = run(scenario, strategy, arrivals, gateways=options.gateways, share_tokens=options.share_tokens,
                 seed=options.seed, oracle_capacity=options.oracle_capacity, optimizer=options.optimizer,
                 gpu_profiles=given_profiles(options.profiles_dir),
                 progress=(lambda t: progress(strategy, t)) if progress else None)
    summary = summarize(result)
    summary["wall_s"] = time.perf_counter() - started
    summary["virtual_end_s"] = result.end_time
    return summary


def given_profiles(directory: str | None) -> dict[str, GpuProfile] | None:
    if directory is None:
        return None
    profiles = [load_profile(path) for path in sorted(Path(directory).glob("*.json"))]
    return {p.gpu: p for p in profiles}


def _worker(scenario: Scenario, strategy: str, options: Options) -> dict[str, Any]:
    q = _queue
    return run_strategy(scenario, strategy, options, (lambda s, t: q.put((s, t))) if q is not None else None)


def compare(scenario: Scenario, strategies: Sequence[str], options: Options,
            progress: Progress | None = None) -> dict[str, Any]:
    """The report dict: scenario, settings, and per strategy its summary (metrics.summarize)."""
    for group in scenario.groups:  # measured once here, inherited by the forked workers
        saturated_throughput(scenario, group.gpu, group.tensor_parallel, options.seed)
    jobs = options.jobs or min(len(strategies), os.cpu_count() or 1)
    results: dict[str, dict[str, Any]] = {}
    if jobs <= 1 or len(strategies) == 1:
        for s in strategies:
            results[s] = run_strategy(scenario, s, options, progress)
    else:
        global _queue
        ctx = mp.get_context("fork")  # workers inherit the registry, the saturation cache, the scenario
        _queue = ctx.Queue()
        try:
            with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
                futures = {s: pool.submit(_worker, scenario, s, options) for s in strategies}
                while not all(f.done() for f in futures.values()):
                    _drain(_queue, progress, timeout=0.5)
                _drain(_queue, progress, timeout=0.0)
                results = {s: f.result() for s, f in futures.items()}
        finally:
            _queue = None
    return {
        "scenario": scenario.name,
        "model": scenario.model,
        "fleet": [{"gpu": g.gpu, "replicas": g.replicas, "deployment": g.name} for g in scenario.groups],
        "rate_rps": scenario.total_rate,
        "duration_s": scenario.duration_s,
        "warmup_s": scenario.warmup_s,
        "slo": {key: getattr(scenario.slo, key) for key in SLO_KEYS},
        "gateways": options.gateways,
        "token_sharing": options.share_tokens,
        "capacity": "oracle" if options.oracle_capacity else "learned",
        "optimizer": options.optimizer,
        "seed": options.seed,
        "strategies": results,
    }


def _drain(q: Any, progress: Progress | None, timeout: float) -> None:
    import queue

    try:
        item = q.get(timeout=timeout) if timeout else q.get_nowait()
        while True:
            if progress is not None:
                progress(*item)
            item = q.get_nowait()
    except queue.Empty:
        return
