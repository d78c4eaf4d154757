"""How much of a GPU's datasheet peak vLLM achieves: the fitted efficiencies the step-time model divides by.

Three fractions per GPU (perf.py says where each enters a step):

* ``weights``: of peak memory bandwidth while the linear layers stream the weights (decode GEMVs);
* ``kv``: of peak memory bandwidth while attention reads the KV cache (paged attention: scattered blocks,
  short rows, so below the weight stream);
* ``compute``: of dense bf16/fp16 tensor peak in the linear layers and prefill attention (MFU).

They are fitted to the published measurements in data/calibration/ on the fit split only, within
``BOUNDS``, by ``extproc engine-sim calibrate --fit``; the values below are what that command printed
(docs/fleet-simulation.md, "Engine model"). A GPU no measurement covers takes its class's values: the
class is fitted on every fit row of its GPUs at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Efficiency:
    weights: float
    kv: float
    compute: float


# Physical bounds the fit keeps to: bandwidth efficiency 0.5-0.95 (HBM and GDDR stream at 70-90 % of
# peak in practice), paged-attention KV reads 0.3-0.95, tensor MFU 0.2-0.85.
BOUNDS: dict[str, tuple[float, float]] = {"weights": (0.5, 0.95), "kv": (0.5, 0.95), "compute": (0.2, 0.85)}

# Memory technology sets how close a kernel gets to peak bandwidth; the datacenter HBM parts and the
# GDDR parts (workstation, inference and consumer cards) form the two classes.
GPU_CLASS: dict[str, str] = {
    "V100": "hbm", "A100-40GB": "hbm", "A100-80GB": "hbm", "H100": "hbm", "H100-PCIE": "hbm",
    "H200": "hbm", "B100": "hbm", "B200": "hbm",
    "T4": "gddr", "A10": "gddr", "L4": "gddr", "L20": "gddr", "A40": "gddr", "RTX4090": "gddr",
}

# Printed by `extproc engine-sim calibrate --fit` (fit split of data/calibration/vllm_measurements.csv).
CLASS_EFFICIENCY: dict[str, Efficiency] = {
    "gddr": Efficiency(weights=0.796, kv=0.607, compute=0.557),
    "hbm": Efficiency(weights=0.839, kv=0.503, compute=0.657),
}
FITTED: dict[str, Efficiency] = {
    "A100-40GB": Efficiency(weights=0.838, kv=0.503, compute=0.716),
    "A100-80GB": Efficiency(weights=0.839, kv=0.503, compute=0.663),
    "A40": Efficiency(weights=0.812, kv=0.607, compute=0.405),
    "H100": Efficiency(weights=0.839, kv=0.503, compute=0.374),
    "L4": Efficiency(weights=0.711, kv=0.607, compute=0.557),
    "RTX4090": Efficiency(weights=0.843, kv=0.607, compute=0.556),
}

DEFAULT_CLASS = "hbm"


def gpu_class(gpu: str) -> str:
    return GPU_CLASS.get(gpu, DEFAULT_CLASS)


def efficiency_for(gpu: str) -> Efficiency:
    """The GPU's own fitted values, else its class's (a preset with no measurement of its own)."""
    return FITTED.get(gpu) or CLASS_EFFICIENCY[gpu_class(gpu)]
