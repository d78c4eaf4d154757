"""Time the MILP on the issue's size: `python -m extproc.optimizer.bench [--types 5] [--cells 40]`.

Instances are random but shaped like real profiles: throughput falls with prompt and output length, each
GPU type has its own speed and price, and some cells are beyond some types' SLO (tput 0).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Sequence

from extproc.gpu_profiles import GpuProfile
from extproc.optimizer.solver import Demand, solve

OUTPUTS = (4, 8, 16, 32, 64, 128, 256, 512)
INPUTS = (128, 256, 512, 1024, 2048)


def instance(types: int, cells: int, rng: random.Random) -> tuple[list[GpuProfile], list[Demand]]:
    grid = [(o, i) for o in OUTPUTS for i in INPUTS]
    chosen = rng.sample(grid, min(cells, len(grid)))
    profiles = []
    for g in range(types):
        speed, cost = rng.uniform(0.5, 4.0), rng.uniform(0.3, 3.0)
        rows = []
        for o in OUTPUTS:
            row = []
            for i in INPUTS:
                t = speed * 60.0 / (o / 4) ** 0.8 / (i / 128) ** 0.3 * rng.uniform(0.8, 1.2)
                row.append(0.0 if rng.random() < 0.1 * (g % 3) else round(t, 3))
            rows.append(tuple(row))
        profiles.append(GpuProfile(f"gpu{g}", round(cost, 2), OUTPUTS, INPUTS, tuple(rows), None, None, {},
                                   0.0))
    demands = [Demand(i, o, round(rng.uniform(0.1, 20.0), 2)) for o, i in chosen]
    servable = [d for d in demands if any(p.tput(d.input_tokens, d.output_tokens) > 0 for p in profiles)]
    return profiles, servable


def run(types: int, cells: int, runs: int, seed: int, headroom: float = 0.0) -> dict[str, float]:
    rng = random.Random(seed)
    times, replicas = [], []
    for _ in range(runs):
        profiles, demands = instance(types, cells, rng)
        plan = solve(profiles, demands, headroom=headroom)
        times.append(plan.solve_seconds)
        replicas.append(sum(plan.replicas.values()))
    return {"types": types, "cells": cells, "runs": runs, "median_s": statistics.median(times),
            "p90_s": sorted(times)[int(0.9 * (len(times) - 1))], "max_s": max(times),
            "mean_replicas": statistics.mean(replicas)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extproc.optimizer.bench", description=__doc__)
    ap.add_argument("--types", type=int, default=5)
    ap.add_argument("--cells", type=int, default=40)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--headroom", type=float, default=0.0,
                    help="the plan's beta (the service's default: 0.5)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = run(args.types, args.cells, args.runs, args.seed, args.headroom)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['types']} GPU types x {result['cells']} cells, {result['runs']} random instances: "
              f"solve median {result['median_s'] * 1000:.1f} ms, p90 {result['p90_s'] * 1000:.1f} ms, "
              f"max {result['max_s'] * 1000:.1f} ms (mean plan {result['mean_replicas']:.0f} replicas)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
