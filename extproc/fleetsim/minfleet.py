"""The cheapest fixed fleet that keeps a scenario's SLO: "what fleet do I need before I buy".

For a scenario and a strategy: the count per GPU type (deployment) with the lowest cost per hour whose
run meets the SLO — SLO attainment >= 99 % of the measured window's arrivals, nothing rejected or
failed — and beside it each type alone at its own cheapest count. Every run replays the same arrivals
(the seed fixes them), so the answer is deterministic; runs that miss stop as soon as the miss is
certain (`loop.run(give_up=True)`).

The search assumes more replicas never hurt (a fleet that meets the SLO still does with one more):
  * one type: bisection over [1, replicas];
  * two or more: for every count of the types but the last two (cheapest first, while it can still
    beat the best found), a staircase over the last two: with one more of the first, the fewest of the
    second never grows, so it is found by stepping down from the previous one. Chains over the first
    of the two run in parallel (`jobs`), each its own staircase.
The answer meets the SLO and, with one replica fewer of any type in it, the search saw it miss (or the
monotonicity it assumes says it would): `MinFleet.tested` keeps every run.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from extproc.fleetsim.arrivals import generate
from extproc.fleetsim.loop import run
from extproc.fleetsim.metrics import summarize
from extproc.fleetsim.scenario import Scenario

ATTAINMENT = 0.99
Counts = tuple[int, ...]  # replicas per deployment, in the scenario's fleet order


@dataclass(frozen=True, slots=True)
class Trial:
    counts: dict[str, int]
    cost: float
    ok: bool
    attainment: float | None  # None: the run stopped early, the miss already certain


@dataclass(slots=True)
class MinFleet:
    scenario: str
    strategy: str
    counts: dict[str, int] | None  # None: nothing within the fleet's `replicas` meets the SLO
    cost: float | None
    attainment: float | None
    alone: dict[str, tuple[int | None, float | None]]  # deployment -> (count, cost) serving everything
    tested: list[Trial] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        return {"scenario": self.scenario, "strategy": self.strategy, "counts": self.counts,
                "cost_per_hour": self.cost, "slo_attainment": self.attainment,
                "alone": {d: {"replicas": n, "cost_per_hour": c} for d, (n, c) in self.alone.items()},
                "runs": len(self.tested),
                "tested": [{"counts": t.counts, "ok": t.ok, "slo_attainment": t.attainment}
                           for t in self.tested]}


def fixed(scenario: Scenario, counts: Mapping[str, int]) -> Scenario:
    """The scenario's fleet at these counts (deployments at 0 left out), no autoscaling."""
    groups = tuple(replace(g, replicas=counts[g.name], initial=None) for g in scenario.groups
                   if counts.get(g.name, 0) > 0)
    kept = {g.gpu for g in groups}
    return replace(scenario, groups=groups, autoscale=None,
                   losses=tuple(x for x in scenario.losses if x.gpu in kept))


def only_deployment(scenario: Scenario, strategy: str) -> tuple[Scenario, str]:
    """`strategy@dep` (the Scalar baseline): the scenario with deployment `dep` alone, and `strategy`.
    Checked here, before any run: a wrong name must not fail the search minutes in."""
    base, _, only = strategy.partition("@")
    if not only:
        return scenario, strategy
    if only not in {g.name for g in scenario.groups}:
        raise ValueError(f"{strategy}: no deployment named {only!r} in the fleet")
    return fixed(scenario, {g.name: g.replicas if g.name == only else 0 for g in scenario.groups}), base


class _Prober:
    """Runs one fleet at a time and remembers every answer (a chain never runs a fleet twice)."""

    def __init__(self, scenario: Scenario, strategy: str, seed: int) -> None:
        self.scenario = scenario
        self.strategy = strategy
        self.seed = seed
        self.names = [g.name for g in scenario.groups]
        self.costs = [g.cost for g in scenario.groups]
        self.seen: dict[Counts, Trial] = {}

    def cost(self, counts: Counts) -> float:
        return round(math.fsum(n * c for n, c in zip(counts, self.costs)), 9)

    def ok(self, counts: Counts) -> bool:
        if counts not in self.seen:
            by_name = dict(zip(self.names, counts))
            self.seen[counts] = _trial(self.scenario, self.strategy, self.seed, by_name, self.cost(counts))
        return self.seen[counts].ok


def _trial(scenario: Scenario, strategy: str, seed: int, counts: dict[str, int], cost: float) -> Trial:
    if not any(counts.values()):
        return Trial(counts, cost, False, 0.0)
    sc = fixed(scenario, counts)
    result = run(sc, strategy, generate(sc, seed), seed=seed, give_up=True)
    if result.gave_up:
        return Trial(counts, cost, False, None)
    cluster = summarize(result)["cluster"]
    attained = cluster["slo_attainment"]
    ok = (attained is not None and attained >= ATTAINMENT and not cluster["rejected"]
          and not cluster["failed"])
    return Trial(counts, cost, ok, attained)


def fewest(ok, hi: int, lo: int = 1) -> int | None:
    """The least n in [lo, hi] with ok(n), by bisection (ok is monotone); None when ok(hi) fails."""
    if hi < lo or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def _alone(scenario: Scenario, strategy: str, seed: int, k: int) -> tuple[int | None, list[Trial]]:
    p = _Prober(scenario, strategy, seed)
    size = len(scenario.groups)
    n = fewest(lambda m: p.ok(tuple(m if j == k else 0 for j in range(size))), scenario.groups[k].replicas)
    return n, list(p.seen.values())


def _chain(scenario: Scenario, strategy: str, seed: int, prefix: Counts, firsts: Sequence[int],
           start: int, budget: float) -> list[Trial]:
    """A staircase over the last two types for counts `prefix` of the others: for each count of the
    first in `firsts` (ascending), the fewest of the second, stepping down from the previous one."""
    p = _Prober(scenario, strategy, seed)
    second = start
    for a in firsts:
        if p.cost((*prefix, a, 0)) >= budget:
            break
        cap = second  # the most of the second type that still beats the budget with `a` of the first
        while cap > 0 and p.cost((*prefix, a, cap)) >= budget:
            cap -= 1
        if not p.ok((*prefix, a, cap)):
            continue  # nothing under the budget with `a`: try one more of the first
        second = cap
        while second > 0 and p.ok((*prefix, a, second - 1)):
            second -= 1
        budget = p.cost((*prefix, a, second))
    return list(p.seen.values())


def find_min_fleet(scenario: Scenario, strategy: str, seed: int = 0, jobs: int = 0) -> MinFleet:
    """The cheapest fixed fleet for `strategy` on `scenario` (see the module's docstring)."""
    if scenario.slo.tpot_s is None and scenario.slo.ttft_s is None:
        raise ValueError(f"scenario {scenario.name} has no SLO: there is no fleet to find")
    scenario, strategy = only_deployment(scenario, strategy)
    groups = scenario.groups
    size = len(groups)
    jobs = jobs or os.cpu_count() or 1
    tested: list[Trial] = []
    with ProcessPoolExecutor(max(1, jobs), mp_context=mp.get_context("fork")) as pool:
        singles = [pool.submit(_alone, scenario, strategy, seed, k) for k in range(size)]
        alone_counts = []
        for f in singles:
            n, trials = f.result()
            alone_counts.append(n)
            tested += trials
        alone = {g.name: (n, None if n is None else round(n * g.cost, 9))
                 for g, n in zip(groups, alone_counts)}
        budget = min((c for _, c in alone.values() if c is not None), default=math.inf) + 1e-9
        if size >= 2:
            tested += _pairs(pool, scenario, strategy, seed, alone_counts, budget, jobs)
    ok = [t for t in tested if t.ok]
    best = min(ok, key=lambda t: (t.cost, sorted(t.counts.items()))) if ok else None
    return MinFleet(scenario.name, strategy, best.counts if best else None, best.cost if best else None,
                    best.attainment if best else None, alone, tested)


def _pairs(pool: ProcessPoolExecutor, scenario: Scenario, strategy: str, seed: int,
           alone: Sequence[int | None], budget: float, jobs: int) -> list[Trial]:
    """Staircases over the last two types for every count of the others that can still win."""
    groups = scenario.groups
    heads = [range(0, g.replicas + 1) for g in groups[:-2]]
    first, second = groups[-2], groups[-1]
    top = second.replicas if alone[-1] is None else alone[-1]
    tested: list[Trial] = []
    for prefix in sorted(itertools.product(*heads), key=lambda c: sum(n * g.cost for n, g in zip(c, groups))):
        if sum(n * g.cost for n, g in zip(prefix, groups)) >= budget:
            continue
        # None of `first` and none of the others: the last type alone, already known
        firsts = list(range(0 if any(prefix) else 1, first.replicas + 1))
        lanes = max(1, min(jobs, len(firsts)))
        futures = [pool.submit(_chain, scenario, strategy, seed, prefix, firsts[j::lanes], top, budget)
                   for j in range(lanes)]
        for f in futures:
            trials = f.result()
            tested += trials
            budget = min([budget, *(t.cost for t in trials if t.ok)])
    return tested


def markdown(m: MinFleet) -> str:
    def fleet(counts: Mapping[str, int] | None) -> str:
        return "none within the fleet's replicas" if not counts else \
            " + ".join(f"{n} {d}" for d, n in counts.items() if n)

    rows = [f"### Cheapest fixed fleet: {m.scenario}, `{m.strategy}` ({len(m.tested)} runs)", "",
            "| fleet | cost / h | SLO attainment |", "|---|---|---|"]
    att = f"{m.attainment:.2%}" if m.attainment is not None else "-"
    rows.append(f"| **{fleet(m.counts)}** | **{m.cost:.2f}** | {att} |" if m.cost is not None
                else f"| {fleet(None)} | - | - |")
    for d, (n, cost) in m.alone.items():
        rows.append(f"| {d} alone: {n if n is not None else 'none'} | "
                    f"{f'{cost:.2f}' if cost is not None else '-'} | |")
    return "\n".join(rows)
