"""The highest arrival rate that meets a scenario's SLO: per strategy, and the fleet's upper bound.

`max rate` of a strategy: the highest rate (the scenario's mix and timeline, every stream scaled
alike) at which the report's SLO holds (`metrics.summarize`'s `slo_met`: p99 TPOT and TTFT of the
measured window within bounds, nothing rejected or failed), found by search.

`bound_rps`: each GPU type's replicas serving the scenario's mix *alone* (the fleet cut down to that
type; its losses kept), searched the same way, summed. No router can split the traffic better than
every type at its own limit, so each strategy's max rate is reported as a fraction of it. Within one
type the replicas are alike and routed by least-request, which keeps them equally loaded.

The search: a bracket by doubling or halving from a starting guess, then bisection until the bracket
is within `precision`. A run that fails the SLO stops as soon as the failure is certain
(`loop.run(give_up=True)`), so the failing half of a search costs little. Every search is one task
in a pool of forked workers; each run is fixed by the seed, so the result does not depend on the
number of workers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from extproc.fleetsim.arrivals import generate
from extproc.fleetsim.loop import run
from extproc.fleetsim.metrics import summarize
from extproc.fleetsim.runner import Options
from extproc.fleetsim.saturation import saturated_throughput
from extproc.fleetsim.scenario import Scenario

BOUND_STRATEGY = "least-request"  # inside one GPU type: replicas alike, equal load is the right split
PRECISION = 0.02  # the search stops when the bracket's ends are within 2 % of each other
MAX_RUNS = 24


@dataclass(frozen=True, slots=True)
class Search:
    """One rate search: `strategy` on `scenario`, starting from `guess` (a rate scale)."""

    label: str
    scenario: Scenario
    strategy: str
    guess: float = 1.0


def meets_slo(scenario: Scenario, strategy: str, options: Options) -> bool:
    arrivals = generate(scenario, options.seed, options.gateways)
    result = run(scenario, strategy, arrivals, gateways=options.gateways, share_tokens=options.share_tokens,
                 seed=options.seed, oracle_capacity=options.oracle_capacity, give_up=True)
    return not result.gave_up and bool(summarize(result)["slo_met"])


def max_rate(search: Search, options: Options, precision: float = PRECISION) -> float | None:
    """Requests per second at the highest rate scale found to meet the SLO; None when the scenario has
    no SLO or even the guess halved MAX_RUNS // 2 - 1 times misses it."""
    sc = search.scenario
    if not sc.slo.targets:
        return None

    def ok(scale: float) -> bool:
        return meets_slo(sc.scaled(scale), search.strategy, options)

    runs = 1
    lo = hi = search.guess
    if ok(lo):
        hi = lo * 2
        while runs < MAX_RUNS // 2 and ok(hi):
            lo, hi, runs = hi, hi * 2, runs + 1
    else:
        lo = hi / 2
        while not ok(lo):
            runs += 1
            if runs >= MAX_RUNS // 2:
                return None
            lo, hi = lo / 2, lo
    while hi / lo > 1 + precision and runs < MAX_RUNS:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        runs += 1
    return lo * sc.total_rate


def alone(scenario: Scenario, gpu: str) -> Scenario:
    """The scenario's fleet cut down to one GPU type: same mix, timeline and SLO."""
    return replace(scenario, groups=tuple(g for g in scenario.groups if g.gpu == gpu),
                   losses=tuple(x for x in scenario.losses if x.gpu == gpu))


def searches(scenario: Scenario, strategies: Sequence[str], seed: int = 0) -> list[Search]:
    """One search per strategy and one per GPU type (`bound:<gpu>`); each type's first guess is its
    share of the fleet's saturated throughput, so its bracket is found in a step or two."""
    sat = {g.gpu: 0.0 for g in scenario.groups}
    for g in scenario.groups:
        sat[g.gpu] += g.replicas * saturated_throughput(scenario, g.gpu, g.tensor_parallel, seed)
    total = sum(sat.values())
    out = [Search(s, scenario, s) for s in strategies]
    out += [Search(f"bound:{gpu}", alone(scenario, gpu), BOUND_STRATEGY, max(1e-3, cap / total))
            for gpu, cap in sat.items()]
    return out


def find_max_rates(scenario: Scenario, strategies: Sequence[str], options: Options,
                   precision: float = PRECISION) -> dict[str, object]:
    """{"strategies": {name: rps or None}, "bound_rps": sum, "bound_by_gpu": {gpu: rps or None}}."""
    todo = searches(scenario, strategies, options.seed)
    jobs = options.jobs or min(len(todo), os.cpu_count() or 1)
    if jobs <= 1:
        found = {s.label: max_rate(s, options, precision) for s in todo}
    else:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:
            futures = {s.label: pool.submit(max_rate, s, options, precision) for s in todo}
            found = {label: f.result() for label, f in futures.items()}
    by_gpu = {s.label.split(":", 1)[1]: found[s.label] for s in todo if s.label.startswith("bound:")}
    bound = sum(v or 0.0 for v in by_gpu.values())  # a type that misses the SLO even idle adds nothing
    return {"strategies": {s: found[s] for s in strategies}, "bound_rps": bound, "bound_by_gpu": by_gpu}
