"""Small hand-made profiles for optimizer tests."""

from __future__ import annotations

from extproc.gpu_profiles import GpuProfile

SHORT = (128, 16)  # (input, output) tokens
LONG = (2048, 512)


def profile(gpu: str, cost: float, short: float, long: float, created: float = 1.0) -> GpuProfile:
    """A 2×2 grid: outputs (16, 512) × inputs (128, 2048); SHORT and LONG on the diagonal, the rest 0."""
    return GpuProfile(gpu=gpu, cost=cost, outputs=(16, 512), inputs=(128, 2048),
                   tputs=((short, 0.0), (0.0, long)), e2e=None, ttft=None, slos={}, created=created)


def one_cell(gpu: str, cost: float, tput: float) -> GpuProfile:
    return GpuProfile(gpu=gpu, cost=cost, outputs=(16,), inputs=(128,), tputs=((tput,),), e2e=None, ttft=None,
                   slos={}, created=1.0)
