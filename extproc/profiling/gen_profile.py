"""`gen-profile` as a library call: benchmark lines + SLOs → the profile (AIBrix's JSON) and its grid."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from extproc.gpu_profiles import BUDGET_MARGIN, GpuProfile, dump_profile, parse_profile
from extproc.profiling.records import BenchmarkError, MetricLine, read_benchmark
from extproc.profiling.selection import ADMITTED_KEY, Grid, SLOs, admitted, select


def build_profile(deployment: str, grid: Grid, cost: float, slos: SLOs, created: float) -> GpuProfile:
    return GpuProfile(gpu=deployment, cost=cost, outputs=grid.outputs, inputs=grid.inputs, tputs=grid.tputs,
                      e2e=grid.e2e, ttft=grid.ttft, tpot=grid.tpot, slos=slos.as_profile(), created=created)


def profile_from_lines(deployment: str, lines: Sequence[MetricLine], cost: float, slos: SLOs,
                       created: float, admitted_lines: Sequence[MetricLine] | None = None,
                       source: str = "benchmark", admitted_source: str = "admitted benchmark",
                       budget_margin: float = BUDGET_MARGIN) -> tuple[GpuProfile, Grid]:
    """The profile of a rate run's lines; with `admitted_lines` (`benchmark --admitted` of this profile's
    grid) its `tputs_admitted` and `concurrency_admitted` too, each cell's budget at most 1/budget_margin
    of the largest that met the SLO, and `tpot` read at that budget where the admitted run's was kept."""
    if not deployment:
        raise ValueError("the deployment name is empty")
    if any(ADMITTED_KEY in line.extra for line in lines):
        raise BenchmarkError(f"{source}: a `benchmark --admitted` run; give it as --admitted, beside the "
                             "rate run it was made from")
    grid = select(lines, slos, source)
    built = build_profile(deployment, grid, cost, slos, created)
    if admitted_lines is not None:
        runs = [line for line in admitted_lines if ADMITTED_KEY in line.extra]
        if not runs:
            raise BenchmarkError(f"{admitted_source}: no `benchmark --admitted` lines (they carry "
                                 f'"{ADMITTED_KEY}")')
        got = admitted(runs, slos, grid.outputs, grid.inputs, grid.tputs, grid.e2e, budget_margin, grid.tpot)
        built = replace(built, tputs_admitted=got.tputs, concurrency_admitted=got.budgets,
                        tputs_admitted_max=got.most, budget_margin=budget_margin, tpot=got.tpot)
    return built, grid


def generate(deployment: str, benchmark: str | Path, cost: float, slos: SLOs, created: float,
             admitted_benchmark: str | Path | None = None,
             budget_margin: float = BUDGET_MARGIN) -> tuple[dict[str, Any], Grid]:
    """`extproc gen-profile`: the files read, the profile as AIBrix's JSON."""
    if not deployment:
        raise ValueError("the deployment name is empty")
    built, grid = profile_from_lines(
        deployment, read_benchmark(benchmark), cost, slos, created,
        None if admitted_benchmark is None else read_benchmark(admitted_benchmark),
        str(benchmark), str(admitted_benchmark), budget_margin)
    profile = dump_profile(built)
    parse_profile(profile)  # what we write must load where it is read (e.g. a negative --cost fails here)
    return profile, grid
