"""Fleet files: several simulated replicas (different GPU types) served by one process.

Schema (YAML)::

    defaults:                 # optional; merged under every replica
      model: llama2-7b
      time_scale: 1
    replicas:
      - name: a100-0          # required, unique
        gpu: A100-80GB        # preset name (see gpus.py); required
        port: 8001            # required, unique
        model: llama2-7b      # preset name (see models.py)
        host: 127.0.0.1
        served_model_name: llama2-7b
        engine: vllm          # vllm | sglang metric names
        tensor_parallel: 1
        seed: 0
        output_len_median: 200
        gpu_overrides: {bandwidth_gbps: 1800}        # any GpuSpec field
        model_overrides: {max_model_len: 4096}       # any ModelSpec field
        perf_overrides: {mem_efficiency: 0.75}       # any PerfParams field
        engine_overrides: {max_num_seqs: 128}        # any EngineConfig field
        faults: {error_rate: 0.05, error_status: 503}  # any FaultConfig field
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from pathlib import Path
from typing import Any

import yaml

from extproc.sim.faults import FaultConfig
from extproc.sim.replica import ReplicaSpec

_FIELDS = {f.name for f in dataclasses.fields(ReplicaSpec)}


def replica_from_dict(data: dict[str, Any]) -> ReplicaSpec:
    unknown = set(data) - _FIELDS
    if unknown:
        raise KeyError(
            f"unknown replica fields: {', '.join(sorted(unknown))}; known: {', '.join(sorted(_FIELDS))}"
        )
    values = dict(data)
    values["faults"] = FaultConfig.from_dict(values.get("faults"))
    for key in ("gpu_overrides", "model_overrides", "perf_overrides", "engine_overrides"):
        values[key] = dict(values.get(key) or {})
    return ReplicaSpec(**values)


def parse_fleet(doc: Any) -> list[ReplicaSpec]:
    if not isinstance(doc, dict) or not isinstance(doc.get("replicas"), list) or not doc["replicas"]:
        raise ValueError("a fleet file needs a non-empty 'replicas' list")
    defaults = doc.get("defaults") or {}
    specs: list[ReplicaSpec] = []
    for i, raw in enumerate(doc["replicas"]):
        if not isinstance(raw, dict):
            raise ValueError(f"replica #{i} is not a mapping")
        merged = {**defaults, **raw}
        for key in ("faults", "gpu_overrides", "model_overrides", "perf_overrides", "engine_overrides"):
            if key in defaults and key in raw:  # nested dicts merge key by key
                merged[key] = {**defaults[key], **raw[key]}
        for key in ("name", "gpu", "port"):
            if key not in merged:
                raise ValueError(f"replica #{i} has no {key!r}")
        specs.append(replica_from_dict(merged))
    names = [s.name for s in specs]
    ports = [(s.host, s.port) for s in specs if s.port]
    if len(set(names)) != len(names) or len(set(ports)) != len(ports):
        raise ValueError("replica names and ports must be unique")
    for s in specs:
        s.build_engine()  # fail early on unknown presets or a model that does not fit
    return specs


def load_fleet(path: str | Path) -> list[ReplicaSpec]:
    return parse_fleet(yaml.safe_load(Path(path).read_text()))


async def serve(
    specs: list[ReplicaSpec], ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    """Run every replica in this event loop until SIGINT/SIGTERM (or `stop` is set)."""
    from extproc.sim.server import ReplicaServer

    servers = [ReplicaServer(s) for s in specs]
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    started: list[Any] = []
    try:
        for server in servers:
            await server.start()
            started.append(server)
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        for server in reversed(started):
            await server.stop()
