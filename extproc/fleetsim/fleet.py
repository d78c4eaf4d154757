"""The simulated replicas: one engine model (extproc.sim) per pod, driven in virtual time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from extproc.fleetsim.saturation import build_engine, saturated_throughput
from extproc.fleetsim.scenario import Scenario
from extproc.sim.driver import EngineDriver


@dataclass(slots=True)
class Replica:
    index: int
    name: str
    gpu: str
    address: str
    deployment: str
    driver: EngineDriver
    saturated: float           # output tokens/s when kept full with the scenario's mix
    alive: bool = True         # serving, or draining (the optimizer scaled it down: no new requests)
    ready: bool = True         # False while draining
    starting: bool = False     # the optimizer added it: it serves once provisioned
    scheduled: float = -1.0    # end time of the step the event heap holds for it (lazy invalidation)
    # Figures over the measured window [warmup, duration):
    tokens: int = 0
    busy_s: float = 0.0
    preemptions: int = 0
    peak_waiting: int = 0
    routed: int = 0
    open: dict[str, int] = field(default_factory=dict)  # engine request id -> arrival index

    def config_entry(self) -> dict[str, Any]:
        """This pod as the gateway's config file lists it."""
        return {"name": self.name, "address": self.address, "deployment": self.deployment,
                "labels": {"gpu": self.gpu}, "ready": self.ready}


def build_replicas(scenario: Scenario, seed: int = 0) -> list[Replica]:
    out: list[Replica] = []
    for g, group in enumerate(scenario.groups):
        sat = saturated_throughput(scenario, group.gpu, group.tensor_parallel, seed)
        for i in range(group.replicas):
            out.append(Replica(
                index=len(out), name=f"{group.name}-{i}", gpu=group.gpu,
                address=f"10.{g}.{i // 250}.{i % 250 + 1}:8000", deployment=group.name,
                driver=EngineDriver(build_engine(scenario, group.gpu, group.tensor_parallel)),
                saturated=sat))
    return out
