"""GPU presets from public spec sheets.

Figures are per GPU: memory (GB, decimal), peak memory bandwidth (GB/s), dense (no-sparsity) bf16/fp16
tensor TFLOPs, and an *indicative* on-demand price per GPU-hour in USD. Prices move weekly and differ by
provider; they are here so the optimizer and demos have a plausible cost ratio, and every figure can be
overridden (``--gpu-override price_per_hour=...`` or a fleet file).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_gb: float
    bandwidth_gbps: float
    tflops: float  # dense bf16/fp16 tensor throughput
    price_per_hour: float
    # Datasheet capacities are binary: an "80 GB" A100 has 81,920 MiB. HBM parts and the (non-ECC)
    # RTX 4090 give all of it to CUDA; GDDR6 datacenter parts keep ECC on by default, which takes 1/16,
    # leaving about the decimal figure. So binary for the former, decimal (the default) for the latter.
    memory_binary: bool = False

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * (1 << 30 if self.memory_binary else 1e9)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        # NVIDIA Tesla V100 SXM2 datasheet: 32 GB HBM2, 900 GB/s, 125 TFLOPS tensor (fp16).
        # Price: AWS p3.2xlarge (1x V100 16GB) on-demand us-east-1, $3.06/h.
        GpuSpec("V100", 32, 900, 125, 3.06, memory_binary=True),
        # NVIDIA T4 datasheet: 16 GB GDDR6, 320 GB/s, 65 TFLOPS mixed fp16.
        # Price: AWS g4dn.xlarge on-demand, $0.526/h.
        GpuSpec("T4", 16, 320, 65, 0.526),
        # NVIDIA A10 datasheet: 24 GB GDDR6, 600 GB/s, 125 TFLOPS bf16 (250 with sparsity).
        # Price: Lambda Cloud 1x A10 on-demand, $0.75/h.
        GpuSpec("A10", 24, 600, 125, 0.75),
        # NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TFLOPS bf16 (242 with sparsity).
        # Price: GCP g2-standard-4 (1x L4) on-demand us-central1, ~$0.71/h.
        GpuSpec("L4", 24, 300, 121, 0.71),
        # NVIDIA L20 product brief: 48 GB GDDR6, 864 GB/s, 119.5 TFLOPS bf16 (239 with sparsity).
        # Price: no broad public list price (China-market part); $0.90/h is an estimate between L4 and A40.
        GpuSpec("L20", 48, 864, 119.5, 0.90),
        # NVIDIA A40 datasheet: 48 GB GDDR6, 696 GB/s, 149.7 TFLOPS bf16 (299.4 with sparsity).
        # Price: RunPod secure-cloud A40 list, ~$0.44/h (2024).
        GpuSpec("A40", 48, 696, 149.7, 0.44),
        # NVIDIA A100 datasheet (SXM4 40GB): 40 GB HBM2, 1,555 GB/s, 312 TFLOPS bf16 dense.
        # Price: Lambda Cloud 1x A100 40GB SXM4 on-demand, $1.29/h.
        GpuSpec("A100-40GB", 40, 1555, 312, 1.29, memory_binary=True),
        # NVIDIA A100 datasheet (SXM4 80GB): 80 GB HBM2e, 2,039 GB/s, 312 TFLOPS bf16 dense.
        # Price: Lambda Cloud 1x A100 80GB SXM4 on-demand, $1.79/h.
        GpuSpec("A100-80GB", 80, 2039, 312, 1.79, memory_binary=True),
        # NVIDIA H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, 989 TFLOPS bf16 dense (1,979 with sparsity).
        # Price: Lambda Cloud 1x H100 SXM on-demand, $2.99/h.
        GpuSpec("H100", 80, 3350, 989, 2.99, memory_binary=True),
        # NVIDIA H100 datasheet (PCIe): 80 GB HBM2e, 2.0 TB/s, 756 TFLOPS bf16 dense.
        # Price: Lambda Cloud 1x H100 PCIe on-demand, $2.49/h.
        GpuSpec("H100-PCIE", 80, 2000, 756, 2.49, memory_binary=True),
        # NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS bf16 dense.
        # Price: ~$3.99/h, indicative neocloud on-demand (2025).
        GpuSpec("H200", 141, 4800, 989, 3.99, memory_binary=True),
        # NVIDIA HGX B100 spec: 192 GB HBM3e, 8 TB/s, 3.5 PFLOPS fp16 with sparsity -> 1,750 dense.
        # Price: no public on-demand list; $5.00/h estimate.
        GpuSpec("B100", 192, 8000, 1750, 5.00, memory_binary=True),
        # NVIDIA DGX B200 spec: 1,440 GB across 8 GPUs -> 180 GB each, 8 TB/s, 2.25 PFLOPS bf16 dense per GPU.
        # Price: Lambda Cloud 1x B200 on-demand, $4.99/h (2025).
        GpuSpec("B200", 180, 8000, 2250, 4.99, memory_binary=True),
        # NVIDIA RTX 4090 (Ada whitepaper): 24 GB GDDR6X, 1,008 GB/s, 165 TFLOPS dense FP16/BF16 tensor with
        # FP32 accumulate (what serving kernels use; 330 with FP16 accumulate).
        # Price: RunPod community cloud, ~$0.34/h. Present so calibration.md's 4090 line can be checked.
        GpuSpec("RTX4090", 24, 1008, 165, 0.34, memory_binary=True),
    )
}

# Names people type; "A100" means the 80 GB SXM part, as in most serving write-ups.
ALIASES: dict[str, str] = {
    "A100": "A100-80GB",
    "A100-80G": "A100-80GB",
    "A100-40G": "A100-40GB",
    "H100-SXM": "H100",
    "H100-80GB": "H100",
    "H200-SXM": "H200",
    "V100-32GB": "V100",
    "4090": "RTX4090",
    "RTX-4090": "RTX4090",
    # No "A10G" -> "A10": AWS's A10G has about half the A10's tensor throughput; it needs its own preset.
}


def get_gpu(name: str) -> GpuSpec:
    return lookup("GPU", name, GPUS, ALIASES)


def lookup(kind: str, name: str, table: dict[str, Any], aliases: dict[str, str]) -> Any:
    """A preset by its name or an alias, case-insensitively; KeyError lists the known names."""
    folded = {k.lower(): k for k in table}
    folded.update({k.lower(): v for k, v in aliases.items()})
    key = folded.get(name.strip().lower())
    if key is None:
        raise KeyError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}")
    return table[key]


def override(spec: Any, values: dict[str, Any]) -> Any:
    """A copy of a frozen spec dataclass with fields replaced, values coerced to the field's type."""
    if not values:
        return spec
    fields = {f.name: f for f in dataclasses.fields(spec)}
    changes: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in fields:
            raise KeyError(f"{type(spec).__name__} has no field {key!r}; fields: {', '.join(fields)}")
        changes[key] = _coerce(raw, str(fields[key].type))
    return dataclasses.replace(spec, **changes)


def _coerce(raw: Any, type_name: str) -> Any:
    # Annotations are strings here (``from __future__ import annotations``).
    type_name = type_name.replace(" | None", "")
    if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
        return None
    if type_name == "bool":
        return raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
    if type_name == "int":
        return int(float(raw))
    if type_name == "float":
        return float(raw)
    return raw


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """``["bandwidth_gbps=1500", "tflops=200"]`` -> dict; the CLI form of overrides."""
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out
