"""`gen-profile` as a library call: benchmark file + SLOs → the profile (AIBrix's JSON) and its grid."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from extproc.gpu_profiles import GpuProfile, dump_profile, parse_profile
from extproc.profiling.records import BenchmarkError, read_benchmark
from extproc.profiling.selection import ADMITTED_KEY, Grid, SLOs, admitted, select


def build_profile(deployment: str, grid: Grid, cost: float, slos: SLOs, created: float) -> GpuProfile:
    return GpuProfile(gpu=deployment, cost=cost, outputs=grid.outputs, inputs=grid.inputs, tputs=grid.tputs,
                   e2e=grid.e2e, ttft=grid.ttft, slos=slos.as_profile(), created=created)


def generate(deployment: str, benchmark: str | Path, cost: float, slos: SLOs, created: float,
             admitted_benchmark: str | Path | None = None) -> tuple[dict[str, Any], Grid]:
    """The profile; with `admitted_benchmark` (`extproc benchmark --admitted` of this profile's grid)
    its `tputs_admitted` and `concurrency_admitted` too."""
    if not deployment:
        raise ValueError("the deployment name is empty")
    lines = read_benchmark(benchmark)
    if any(ADMITTED_KEY in line.extra for line in lines):
        raise BenchmarkError(f"{benchmark}: a `benchmark --admitted` run; give it as --admitted, beside the "
                             "rate run it was made from")
    grid = select(lines, slos, str(benchmark))
    built = build_profile(deployment, grid, cost, slos, created)
    if admitted_benchmark is not None:
        runs = [line for line in read_benchmark(admitted_benchmark) if ADMITTED_KEY in line.extra]
        if not runs:
            raise BenchmarkError(f"{admitted_benchmark}: no `benchmark --admitted` lines (they carry "
                                 f'"{ADMITTED_KEY}")')
        got = admitted(runs, slos, grid.outputs, grid.inputs, grid.tputs, grid.e2e)
        built = replace(built, tputs_admitted=got.tputs, concurrency_admitted=got.budgets)
    profile = dump_profile(built)
    parse_profile(profile)  # what we write must load where it is read (e.g. a negative --cost fails here)
    return profile, grid
