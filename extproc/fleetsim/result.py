"""What one fleet run yields (RunResult), the virtual clock its gateways read, and the per-request
status codes the loop writes and the metrics read."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.fleetsim.arrivals import Arrival
from extproc.fleetsim.autoscale import Timeline
from extproc.fleetsim.fleet import Replica
from extproc.fleetsim.scenario import Scenario

PENDING, OK, REJECTED, FAILED = 0, 1, 2, 3
BUCKET_S = 5.0  # resolution of the time series (utilization over time)
NAN = math.nan

ProgressFn = Callable[[float], None]


class Clock:
    """The virtual clock every gateway reads (`Gateway(clock=...)`)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class RunResult:
    strategy: str
    scenario: Scenario
    arrivals: list[Arrival]
    replicas: list[Replica]
    status: list[int]
    replica_of: list[int]
    ttft: list[float]
    tpot: list[float]
    e2e: list[float]
    output: list[int]
    lost_at: dict[int, float] = field(default_factory=dict)  # replica index -> time it disappeared
    # replica index -> [start, end) spans it served (lost or drained: its last span ends then)
    spans: dict[int, list[list[float]]] = field(default_factory=dict)
    autoscale: Timeline | None = None  # the optimizer's re-plans (--optimizer)
    bucket_tokens: dict[str, list[int]] = field(default_factory=dict)  # per GPU type, per BUCKET_S
    bucket_routed: dict[str, list[int]] = field(default_factory=dict)
    end_time: float = 0.0
    gateways: int = 1
    # The first gateway's saturated-capacity estimate per replica (capacity: speed), every BUCKET_S:
    # (virtual time, estimate or NaN per replica index). What the capacity metric would have shown.
    capacity_estimates: list[tuple[float, list[float]]] = field(default_factory=list)
    queue_samples: list[tuple[float, int]] = field(default_factory=list)  # (time, requests in SLO queues)
    gave_up: bool = False  # stopped early (`give_up`): the SLO was already missed for certain
