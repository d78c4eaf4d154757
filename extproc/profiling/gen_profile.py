"""`gen-profile` as a library call: benchmark file + SLOs → the profile (AIBrix's JSON) and its grid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from extproc.gpu_profiles import GpuProfile, dump_profile, parse_profile
from extproc.profiling.records import read_benchmark
from extproc.profiling.selection import Grid, SLOs, select


def build_profile(deployment: str, grid: Grid, cost: float, slos: SLOs, created: float) -> GpuProfile:
    return GpuProfile(gpu=deployment, cost=cost, outputs=grid.outputs, inputs=grid.inputs, tputs=grid.tputs,
                   e2e=grid.e2e, ttft=grid.ttft, slos=slos.as_profile(), created=created)


def generate(deployment: str, benchmark: str | Path, cost: float, slos: SLOs,
             created: float) -> tuple[dict[str, Any], Grid]:
    if not deployment:
        raise ValueError("the deployment name is empty")
    grid = select(read_benchmark(benchmark), slos, str(benchmark))
    profile = dump_profile(build_profile(deployment, grid, cost, slos, created))
    parse_profile(profile)  # what we write must load where it is read (e.g. a negative --cost fails here)
    return profile, grid
