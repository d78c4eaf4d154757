"""Simulated gateway replicas: the live `Gateway` object with a virtual clock and virtual inputs.

Nothing of the gateway is re-implemented here. Each replica is an `extproc.server.gateway.Gateway`
built from the same config dict a user would write, with its `Accounting` fed from simulated engine
scrapes instead of HTTP, and its shared state either the in-process `LocalState` (one gateway) or a
`SimSharedState` with the Redis sync's delay (several).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from extproc.config import Config, parse
from extproc.fleetsim.fleet import Replica
from extproc.fleetsim.shared import SimSharedState, SyncHub
from extproc.pool.pod import PodKey
from extproc.server.gateway import Gateway
from extproc.sharing.shared import LocalState, SharedState
from extproc.state.accounting import Accounting
from extproc.state.capacity import CapacityEstimator
from extproc.telemetry.engine_metrics import EngineSample
from extproc.telemetry.health import PodHealth


def gateway_config(model: str, replicas: Sequence[Replica], seed: int, capacity: str = "speed") -> Config:
    """The config file of a gateway serving these replicas (alive ones only); `capacity` is
    routing.load_balance.capacity (`speed`, the default, or AIBrix's `observed`)."""
    raw: dict[str, Any] = {
        "models": {model: {"pods": [r.config_entry() for r in replicas if r.alive]}},
        "routing": {"seed": seed, "load_balance": {"capacity": capacity}},
    }
    return parse(raw, env={})


class Samples:
    """The engine metrics one gateway last scraped: routing reads these, not the live engine state."""

    __slots__ = ("latest",)

    def __init__(self) -> None:
        self.latest: dict[PodKey, EngineSample] = {}

    def __call__(self, key: PodKey, now: float) -> EngineSample | None:
        return self.latest.get(key)

    def scrape(self, replicas: Sequence[Replica], keys: Sequence[PodKey]) -> None:
        latest = self.latest
        latest.clear()
        for r, key in zip(replicas, keys):
            if r.alive:
                e = r.driver.engine
                latest[key] = EngineSample(running=e.num_running, waiting=e.num_waiting,
                                           kv_usage=e.kv_cache_usage, cpu_kv_usage=None)


class OracleCapacity(CapacityEstimator):
    """Diagnostic only (`--capacity oracle`, which routes with `capacity: observed`): every pod's
    observed capacity is its true saturated throughput for the scenario's mix, instead of what the
    gateway learns. Separates the score's behaviour from
    the estimator's dynamics; no live gateway has this."""

    def __init__(self, truth: Mapping[PodKey, float]) -> None:
        super().__init__()
        self.truth = dict(truth)

    def estimate(self, key: PodKey) -> float | None:
        return self.truth.get(key)

    def capacities(self, keys: Iterable[PodKey]) -> dict[PodKey, float | None]:
        return {k: self.truth.get(k) for k in keys}


class SimGateway:
    """One gateway replica: the live Gateway plus its background loops' inputs."""

    __slots__ = ("index", "gateway", "samples", "shared")

    def __init__(self, index: int, config: Config, clock: Callable[[], float],
                 shared: SharedState, capacity: CapacityEstimator | None = None) -> None:
        self.index = index
        self.shared = shared
        self.samples = Samples()
        # One virtual clock for all: the gateways' "wall" clock too (shared speed evidence is timed by it).
        accounting = Accounting(shared, capacity=capacity, health=PodHealth(), samples=self.samples,
                                wall=clock)
        self.gateway = Gateway(config, clock=clock, accounting=accounting)


def build_gateways(count: int, config: Config, clock: Callable[[], float], share_tokens: bool = True,
                   oracle: Mapping[PodKey, float] | None = None) -> list[SimGateway]:
    def capacity() -> CapacityEstimator | None:
        return OracleCapacity(oracle) if oracle is not None else None

    if count == 1:
        return [SimGateway(0, config, clock, LocalState(), capacity())]
    hub = SyncHub(share_tokens)
    return [SimGateway(i, config_with_seed(config, i), clock, SimSharedState(hub, f"sim-gw-{i}"), capacity())
            for i in range(count)]


def config_with_seed(config: Config, index: int) -> Config:
    """Each gateway replica gets its own tie-break stream, as separate processes would."""
    import dataclasses

    seed = config.routing_settings.seed
    routing = dataclasses.replace(config.routing_settings, seed=None if seed is None else seed * 1009 + index)
    return dataclasses.replace(config, routing_settings=routing)


