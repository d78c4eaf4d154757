"""ReplicaSpec: everything that defines one simulated replica, and how to build its engine model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from extproc.sim.engine import Engine
from extproc.sim.faults import FaultConfig
from extproc.sim.gpus import get_gpu, override
from extproc.sim.models import get_model
from extproc.sim.perf import PerfModel, PerfParams
from extproc.sim.sequences import EngineConfig


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    name: str = "sim-0"
    gpu: str = "A100-80GB"
    model: str = "llama2-7b"
    port: int = 8001
    host: str = "127.0.0.1"
    served_model_name: str | None = None  # name clients send; defaults to `model`
    engine: str = "vllm"  # which metric names to export: vllm | sglang
    tensor_parallel: int | None = None  # defaults to the model preset's
    time_scale: float = 1.0  # simulated seconds per wall second
    seed: int = 0
    output_len_median: int = 200  # when a request sets no max_tokens, lengths are log-normal around this
    record_timeline: bool = False  # keep per-token model timestamps for the benchmark (/sim/timeline)
    gpu_overrides: dict[str, Any] = field(default_factory=dict)
    model_overrides: dict[str, Any] = field(default_factory=dict)
    perf_overrides: dict[str, Any] = field(default_factory=dict)
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    faults: FaultConfig = FaultConfig()

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def perf_model(self) -> PerfModel:
        gpu = override(get_gpu(self.gpu), self.gpu_overrides)
        model = override(get_model(self.model), self.model_overrides)
        params = override(PerfParams(), self.perf_overrides)
        tp = self.tensor_parallel or model.tensor_parallel
        return PerfModel(gpu, model, tp, params)

    def engine_config(self) -> EngineConfig:
        cfg = override(EngineConfig(), self.engine_overrides)
        if self.faults.kv_pressure:
            cfg = dataclasses.replace(cfg, kv_pressure=self.faults.kv_pressure)
        return cfg

    def build_engine(self) -> Engine:
        return Engine(self.perf_model(), self.engine_config())


def build_engine(gpu: str, model: str, tensor_parallel: int | None = None, **engine: Any) -> Engine:
    """Shortcut for simulations and tests: an engine for a GPU/model preset pair."""
    return ReplicaSpec(
        gpu=gpu, model=model, tensor_parallel=tensor_parallel, engine_overrides=engine
    ).build_engine()
