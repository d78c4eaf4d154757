"""The optimizer's acceptance check: one scenario and seed, the loop against the verified cheapest fleet.

    extproc fleet-sim --scenario S --seed N --acceptance [--strategies slo] [--jobs J] [--profiles DIR]
                      [--seeds 0,1,2]
    python -m extproc.fleetsim.acceptance [--seeds 0,1,2] [--scenarios a,b] [--out TABLE.md]   # all of them
                                          [--every-seed]

For the scenario's optimizer run (`--optimizer`, strategy `slo` unless one is given) and the same seed's
cheapest fixed fleet (`--find-min-fleet`, every cheaper fleet verified): the loop's mean cost over the
measured window, the fleet's cost, their ratio, the run's SLO attainment, requests rejected, and the most
direction changes of any deployment's count in 5 minutes; and whether it meets the bar (docs/optimizer.md,
"Acceptance"). With `--seeds` (the first form) or `--every-seed` (the second) the yardstick is the
cheapest fleet that holds on every one of the seeds instead: one seed's is often a fleet at its edge
that refuses a few requests on another seed of the same load. The second form runs every built-in
scenario with an `autoscale` section for each seed, one at a time, and writes the table. Long:
`make optimizer-acceptance`, not part of `make test`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from extproc.fleetsim.minfleet import RunSettings, find_min_fleet
from extproc.fleetsim.runner import Options, run_strategy
from extproc.fleetsim.scenario import Scenario, builtin_names, load

RATIO = 1.1  # the loop's mean cost at most this times the cheapest fixed fleet's
ATTAINMENT = 0.99
TURNS = 1  # direction changes per deployment per 5 minutes


@dataclass(frozen=True, slots=True)
class Verdict:
    scenario: str
    strategy: str
    seed: int
    loop_cost: float
    cheapest_cost: float | None  # None: no fixed fleet within the caps keeps the SLO
    cheapest: dict[str, int] | None
    attainment: float | None
    rejected: int
    turns: dict[str, int]
    fleets_run: int
    yardstick_seeds: tuple[int, ...] = ()  # the cheapest fleet held on each of these (`seed` first)

    @property
    def ratio(self) -> float | None:
        return self.loop_cost / self.cheapest_cost if self.cheapest_cost else None

    @property
    def passed(self) -> bool:
        return (self.ratio is not None and self.ratio <= RATIO and self.attainment is not None
                and self.attainment >= ATTAINMENT and self.rejected == 0
                and max(self.turns.values(), default=0) <= TURNS)

    def row(self) -> str:
        fleet = " + ".join(f"{n} {d}" for d, n in (self.cheapest or {}).items() if n) or "none"
        if len(self.yardstick_seeds) > 1:
            fleet += "; on every one of seeds " + ", ".join(map(str, self.yardstick_seeds))
        ratio = f"{self.ratio:.2f}x" if self.ratio is not None else "-"
        cheapest = f"${self.cheapest_cost:.2f}" if self.cheapest_cost is not None else "-"
        att = f"{self.attainment:.2%}" if self.attainment is not None else "-"
        turns = ", ".join(f"{d} {n}" for d, n in self.turns.items())
        return (f"| {self.scenario} | {self.seed} | ${self.loop_cost:.2f} | {cheapest} ({fleet}) | {ratio} | "
                f"{att} | {self.rejected} | {turns} | {self.fleets_run} | "
                f"{'pass' if self.passed else '**fail**'} |")


HEADER = ("| scenario | seed | loop mean cost / h | cheapest fixed fleet | ratio | SLO attainment | "
          "rejected | most direction changes in 5 min | fleets run | verdict |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def accept(scenario: Scenario, seed: int, strategy: str = "slo", jobs: int = 0,
           profiles_dir: str | None = None, settings: RunSettings | None = None,
           yardstick_seeds: Sequence[int] = ()) -> Verdict:
    """`settings`: gateways, token sharing, capacity, the same for the search and the loop (its seed
    is `seed`). `yardstick_seeds`: the yardstick is the cheapest fleet that holds on each of them and
    on `seed` (`--find-min-fleet --seeds`), not that seed's alone, which is often a fleet at its edge."""
    if scenario.autoscale is None:
        raise ValueError(f"scenario {scenario.name} has no autoscale section: nothing to accept")
    s = replace(RunSettings(seed) if settings is None else settings, seed=seed,
                more_seeds=tuple(yardstick_seeds))
    found = find_min_fleet(scenario, strategy, jobs=jobs, settings=s)
    loop = run_strategy(scenario, strategy, Options(
        gateways=s.gateways, share_tokens=s.share_tokens, seed=seed, oracle_capacity=s.oracle_capacity,
        optimizer=True, profiles_dir=profiles_dir))
    auto: dict[str, Any] = loop["autoscale"]
    cluster = loop["cluster"]
    return Verdict(scenario.name, strategy, seed, auto["cost_per_hour_mean"], found.cost, found.counts,
                   cluster["slo_attainment"], cluster["rejected"] + cluster["failed"],
                   dict(auto["turns_per_5min"]), len(found.tested), found.seeds)


def with_autoscale() -> list[str]:
    return [n for n in builtin_names() if load(n).autoscale is not None]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m extproc.fleetsim.acceptance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", help="comma-separated (default: every built-in one with autoscale)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--strategy", default="slo")
    p.add_argument("--jobs", type=int, default=0, help="worker processes for each fleet search")
    p.add_argument("--out", help="also write the table (markdown) here")
    p.add_argument("--every-seed", action="store_true",
                   help="hold each row to the cheapest fleet that keeps the SLO on every one of --seeds "
                        "(fleet-sim --find-min-fleet --seeds), not to its own seed's")
    args = p.parse_args(argv)
    names = args.scenarios.split(",") if args.scenarios else with_autoscale()
    seeds = [int(s) for s in args.seeds.split(",")]
    lines = [HEADER]
    print(HEADER, flush=True)
    passed = True
    for name in names:
        for seed in seeds:
            verdict = accept(load(name), seed, args.strategy, args.jobs,
                             yardstick_seeds=seeds if args.every_seed else ())
            passed &= verdict.passed
            lines.append(verdict.row())
            print(lines[-1], flush=True)
            if args.out:
                with open(args.out, "w") as f:  # rewritten after each row: a long run shows progress
                    f.write("\n".join(lines) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
