"""The optimizer's own metrics at GET /metrics (beside AIBrix's per-deployment /metrics/<ns>/<name>):
read from the service's state at each scrape, so nothing is counted twice or goes stale."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.optimizer.monitor import Fleet


class OptimizerCollector(Collector):
    def __init__(self, fleet: Fleet, clock: Callable[[], float]) -> None:
        self.fleet = fleet
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self.clock()
        cost = GaugeMetricFamily("extproc_optimizer_plan_cost", "Cost (per hour, the profiles' unit) of the "
                                 "last plan, per model", labels=["model"])
        solve = GaugeMetricFamily("extproc_optimizer_solve_seconds", "Time the last plan took to solve",
                                  labels=["model"])
        skipped = GaugeMetricFamily("extproc_optimizer_cells_skipped", "Workload cells the last plan left "
                                    "out: no GPU type serves them within its SLO", labels=["model"])
        age = GaugeMetricFamily("extproc_optimizer_last_plan_age_seconds", "Seconds since the last re-plan "
                                "that produced a plan (or found no load); grows while re-planning fails",
                                labels=["model"])
        demand = GaugeMetricFamily("extproc_optimizer_demand_requests_per_second", "The workload the last "
                                   "re-plan read from the request traces", labels=["model"])
        replicas = GaugeMetricFamily("extproc_optimizer_replicas", "Replicas each deployment should run now "
                                     "(what /metrics/<namespace>/<deployment> serves, in whole replicas)",
                                     labels=["model", "namespace", "deployment"])
        burst = GaugeMetricFamily("extproc_optimizer_burst_requests_per_second", "A burst in the newest "
                                  "trace windows (two back to back above the window's average by 2 sigmas), "
                                  "while it lasts: its rate, and whether the plan was made for it (planned: "
                                  "the fleet strains) or leaves it to the router's margin (router)",
                                  labels=["model", "handling"])
        for model, state in sorted(self.fleet.models.items()):
            if state.burst is not None:
                burst.add_metric([model, "planned" if state.burst.planned else "router"], state.burst.rps)
            if state.plan is not None:
                cost.add_metric([model], state.plan.cost)
                solve.add_metric([model], state.plan.solve_seconds)
                skipped.add_metric([model], state.plan.skipped)
            if state.planned_at is not None:
                age.add_metric([model], max(0.0, now - state.planned_at))
            demand.add_metric([model], sum(d.rps for d in state.demands))
            for key, d in state.deployments.items():
                replicas.add_metric([model, d.namespace, d.name], state.reported(key))
        yield from (cost, solve, skipped, age, demand, burst, replicas)


def optimizer_registry(fleet: Fleet, clock: Callable[[], float]) -> CollectorRegistry:
    """A registry of its own: several services in one process (tests) never share series."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(OptimizerCollector(fleet, clock))
    return registry
