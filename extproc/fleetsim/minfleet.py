"""The cheapest fixed fleet that keeps a scenario's SLO: "what fleet do I need before I buy", and the
yardstick the optimizer's plans are held against.

For a scenario and a strategy: the count per GPU type (deployment) with the lowest cost per hour whose
run meets the SLO — SLO attainment >= 99 % of the measured window's arrivals, nothing rejected or
failed — and beside it each type alone at its own cheapest count. Every run replays the same arrivals
(the seed fixes them), so a fleet's answer is a fact of the scenario; runs that miss stop as soon as the
miss is certain (`loop.run(give_up=True)`).

One seed's answer is the cheapest fleet that held on that seed's draws, often one at its edge: on
`slo-optimizer-chat` 2 L20 hold seed 2 and refuse 2 and 3 requests on seeds 0 and 1 (docs/optimizer.md,
"Acceptance"). With more seeds (`--seeds 0,1,2`) a fleet passes only when it passes on each of them, so
the answer is a fleet to count on for that load, not one draw's luck; a fleet stops at its first missed
seed.

It assumes nothing about how attainment grows with replicas (it need not: a replica more changes what
the router sends where, and a fleet near the line can pass where a larger one misses). Every fleet within
the caps (0 to each deployment's `replicas`) is run in order of cost, cheapest first, ties by counts,
`jobs` at a time, until one passes: that one is the answer, and every cheaper fleet was run and missed.
The answer is therefore the same for any `jobs`; only how many fleets past it were started in the last
batch (at most jobs - 1) differs. Each type alone, shown beside it, is a bisection over that type's counts
(cheap, and it does assume one more replica never hurts: the output says so); `--strategies s@deployment`
runs the verified search on that type alone.

Floors: none. The loop's PodAutoscalers floor at 0 and `min_replicas` holds only without load (the
spec), so under load a deployment may run none; the search holds fixed fleets to the same.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from extproc.fleetsim.arrivals import generate
from extproc.fleetsim.loop import run
from extproc.fleetsim.metrics import summarize
from extproc.fleetsim.scenario import Scenario

ATTAINMENT = 0.99
Counts = tuple[int, ...]  # replicas per deployment, in the scenario's fleet order
FLOORS = ("none under load: min_replicas applies only without load (the loop's PodAutoscalers floor at 0), "
          "so every deployment may run 0")


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
    cheaper: int = 0  # fleets within the caps cheaper than the answer (every one run, every one missed)
    seeds: tuple[int, ...] = (0,)  # the arrivals every fleet was judged on; it passes only on all of them

    def as_json(self) -> dict[str, object]:
        return {"scenario": self.scenario, "strategy": self.strategy, "counts": self.counts,
                "cost_per_hour": self.cost, "slo_attainment": self.attainment,
                "alone": {d: {"replicas": n, "cost_per_hour": c} for d, (n, c) in self.alone.items()},
                "seeds": list(self.seeds), "runs": len(self.tested), "cheaper_fleets_run": self.cheaper,
                "floors": FLOORS,
                "tested": [{"counts": t.counts, "ok": t.ok, "slo_attainment": t.attainment}
                           for t in self.tested]}


@dataclass(frozen=True, slots=True)
class RunSettings:
    """How each fleet runs: the fleet-sim flags a single run honours, held the same for every fleet."""

    seed: int = 0
    more_seeds: tuple[int, ...] = ()  # the fixed-fleet search: a fleet must hold on these seeds' too
    gateways: int = 1
    share_tokens: bool = True
    oracle_capacity: bool = False

    @property
    def seeds(self) -> tuple[int, ...]:
        return (self.seed, *(s for s in self.more_seeds if s != self.seed))


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


@dataclass(frozen=True, slots=True)
class SimulatedFleets:
    """Runs one fixed fleet of the scenario (picklable: the search's workers call it)."""

    scenario: Scenario
    strategy: str
    settings: RunSettings = RunSettings()

    def __call__(self, counts: Mapping[str, int]) -> tuple[bool, float | None]:
        """(kept the SLO on every seed of the settings, the lowest attainment; the missed seed's when
        one misses, None when that run stopped at a certain miss). Stops at the first missed seed."""
        if not any(counts.values()):
            return False, 0.0
        worst = 1.0
        for seed in self.settings.seeds:
            ok, attained = self.one(counts, seed)
            if not ok or attained is None:
                return False, attained
            worst = min(worst, attained)
        return True, worst

    def one(self, counts: Mapping[str, int], seed: int) -> tuple[bool, float | None]:
        sc, s = fixed(self.scenario, counts), self.settings
        result = run(sc, self.strategy, generate(sc, seed, s.gateways), seed=seed, give_up=True,
                     gateways=s.gateways, share_tokens=s.share_tokens, oracle_capacity=s.oracle_capacity)
        if result.gave_up:
            return False, None
        cluster = summarize(result)["cluster"]
        attained = cluster["slo_attainment"]
        ok = (attained is not None and attained >= ATTAINMENT and not cluster["rejected"]
              and not cluster["failed"])
        return ok, attained


Judge = Callable[[Mapping[str, int]], tuple[bool, "float | None"]]  # a fleet -> (ok, attainment)


def _trial(scenario: Scenario, strategy: str, seed: int, counts: dict[str, int], cost: float) -> Trial:
    ok, attained = SimulatedFleets(scenario, strategy, RunSettings(seed))(counts)
    return Trial(counts, cost, ok, attained)


class _Runner:
    """Runs fleets `jobs` at a time in a given order, remembering every answer (none runs twice)."""

    def __init__(self, judge: Judge, names: Sequence[str], costs: Sequence[float], jobs: int,
                 pool: Executor | None) -> None:
        self.judge, self.names, self.costs, self.jobs, self.pool = judge, list(names), list(costs), jobs, pool
        self.seen: dict[Counts, Trial] = {}

    def cost(self, counts: Counts) -> float:
        return round(math.fsum(n * c for n, c in zip(counts, self.costs)), 9)

    def first_passing(self, order: Iterable[Counts]) -> Counts | None:
        """The first fleet of `order` that keeps the SLO, running every one before it."""
        batch: list[Counts] = []
        for counts in itertools.chain(order, [None]):  # None: flush the last batch
            if counts is not None:
                batch.append(counts)
                if len(batch) < self.jobs:
                    continue
            self._run([c for c in batch if c not in self.seen])
            for c in batch:
                if self.seen[c].ok:
                    return c
            batch = []
        return None

    def ok(self, counts: Counts) -> bool:
        if counts not in self.seen:
            self._run([counts])
        return self.seen[counts].ok

    def _run(self, fleets: list[Counts]) -> None:
        named = [dict(zip(self.names, c)) for c in fleets]
        if self.pool is None or len(fleets) < 2:
            results = [self.judge(n) for n in named]
        else:
            results = list(self.pool.map(self.judge, named))
        for c, n, (ok, attained) in zip(fleets, named, results):
            self.seen[c] = Trial(n, self.cost(c), ok, attained)


def cheapest(judge: Judge, names: Sequence[str], costs: Sequence[float], caps: Sequence[int],
             jobs: int = 1, pool: Executor | None = None
             ) -> tuple[Counts | None, dict[str, int | None], list[Trial], int]:
    """The search itself, for any judge: (the cheapest passing fleet, each type alone, every run, how many
    fleets are cheaper than the answer). Cost order, ties by counts; see the module's docstring."""
    runner = _Runner(judge, names, costs, max(1, jobs), pool)
    fleets = sorted((c for c in itertools.product(*(range(n + 1) for n in caps)) if any(c)),
                    key=lambda c: (runner.cost(c), c))
    best = runner.first_passing(fleets)
    alone: dict[str, int | None] = {}
    for k, name in enumerate(names):
        def ok(n: int, k: int = k) -> bool:
            return runner.ok(tuple(n if j == k else 0 for j in range(len(names))))
        alone[name] = fewest(ok, caps[k])
    cheaper = len(fleets) if best is None else fleets.index(best)
    return best, alone, list(runner.seen.values()), cheaper


def fewest(ok: Callable[[int], bool], hi: int, lo: int = 1) -> int | None:
    """The least n in [lo, hi] with ok(n) by bisection, were ok monotone; None when ok(hi) fails."""
    if hi < lo or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def find_min_fleet(scenario: Scenario, strategy: str, seed: int = 0, jobs: int = 0,
                   settings: RunSettings | None = None) -> MinFleet:
    """The cheapest fixed fleet for `strategy` on `scenario` (see the module's docstring)."""
    if not scenario.slo.targets:
        raise ValueError(f"scenario {scenario.name} has no SLO: there is no fleet to find")
    scenario, strategy = only_deployment(scenario, strategy)
    settings = settings or RunSettings(seed)
    groups = scenario.groups
    names, costs, caps = [g.name for g in groups], [g.cost for g in groups], [g.replicas for g in groups]
    jobs = jobs or os.cpu_count() or 1
    judge = SimulatedFleets(scenario, strategy, settings)
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:
            best, alone, tested, cheaper = cheapest(judge, names, costs, caps, jobs, pool)
    else:
        best, alone, tested, cheaper = cheapest(judge, names, costs, caps)
    trial = next((t for t in tested if best is not None and t.counts == dict(zip(names, best))), None)
    costs_alone = {g.name: (n, None if n is None else round(n * g.cost, 9))
                   for g in groups for n in [alone[g.name]]}
    return MinFleet(scenario.name, strategy, trial.counts if trial else None, trial.cost if trial else None,
                    trial.attainment if trial else None, costs_alone, tested, cheaper, settings.seeds)


def markdown(m: MinFleet) -> str:
    def fleet(counts: Mapping[str, int] | None) -> str:
        return "none within the fleet's replicas" if not counts else \
            " + ".join(f"{n} {d}" for d, n in counts.items() if n)

    on = f"seed {m.seeds[0]}" if len(m.seeds) == 1 else "every one of seeds " + ", ".join(map(str, m.seeds))
    rows = [f"### Cheapest fixed fleet: {m.scenario}, `{m.strategy}`, on {on} ({len(m.tested)} fleets run)",
            "",
            f"Verified: all {m.cheaper} fleets within the caps before the answer in cost order were run and "
            f"missed. Floors: {FLOORS}. Each type alone: by bisection (assumes one more replica never "
            "hurts; `--strategies <s>@<deployment>` verifies it)."
            + (" SLO attainment: the lowest of the seeds'." if len(m.seeds) > 1 else ""), "",
            "| fleet | cost / h | SLO attainment |", "|---|---|---|"]
    att = f"{m.attainment:.2%}" if m.attainment is not None else "-"
    rows.append(f"| **{fleet(m.counts)}** | **{m.cost:.2f}** | {att} |" if m.cost is not None
                else f"| {fleet(None)} | - | - |")
    for d, (n, cost) in m.alone.items():
        rows.append(f"| {d} alone: {n if n is not None else 'none'} | "
                    f"{f'{cost:.2f}' if cost is not None else '-'} | |")
    return "\n".join(rows)
