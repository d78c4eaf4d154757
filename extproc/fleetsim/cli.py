"""`extproc fleet-sim`: compare routing strategies on a simulated heterogeneous fleet, in virtual time."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from typing import Any

from extproc import extras


def add_commands(sub: Any) -> None:
    """Add `fleet-sim` to `extproc`'s subcommands (imports stay lazy)."""
    p = sub.add_parser("fleet-sim", help="simulate a GPU fleet behind the gateway and compare strategies",
                       description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", required=True,
                   help="a built-in scenario (a name it does not know prints them all) or a YAML file")
    p.add_argument("--strategies", help="comma-separated strategies (default: the scenario's)")
    p.add_argument("--duration", type=float, help="simulated seconds of arrivals (default: the scenario's)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply every stream's rate")
    p.add_argument("--gateways", type=int, default=1, help="gateway replicas sharing state (Redis-like sync)")
    p.add_argument("--no-token-sharing", action="store_true",
                   help="with --gateways N: token counters stay local (the spec's known limitation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", metavar="N,N,...",
                   help="with --find-min-fleet, instead of --seed: a fleet passes only when it keeps the SLO "
                        "on each of these seeds' arrivals (one seed's cheapest fleet is often at its edge); "
                        "with --acceptance: the yardstick is that fleet (the loop runs on --seed)")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON (with time series)")
    p.add_argument("--optimizer", action="store_true",
                   help="the GPU optimizer scales each deployment from the gateways' traces (the "
                        "scenario's autoscale section; fleet min_replicas, initial, cost)")
    p.add_argument("--profiles", metavar="DIR",
                   help="GPU profiles (AIBrix JSON, gpu = the deployment name) for the optimizer's plan and "
                        "the slo* strategies' router alike, instead of profiles measured on the engine model")
    p.add_argument("--profile-max-budget", type=int, metavar="N", default=None,
                   help="measure the engine model's profiles with "
                        "`extproc benchmark --admitted --max-budget N` (the budget ladder climbs; the "
                        "scenario's profiling.max_budget; default: the factors only)")
    p.add_argument("--profile-budget-margin", type=float, metavar="M", default=None,
                   help="measure the engine model's profiles with `extproc gen-profile --budget-margin M` "
                        "(the scenario's profiling.budget_margin; default 2)")
    p.add_argument("--plot", metavar="OUT.png", help="utilization and QPS over time per GPU type")
    p.add_argument("--markdown", metavar="OUT.md", help="also write the markdown table to a file")
    p.add_argument("--find-max-rate", action="store_true",
                   help="also search the highest arrival rate that meets the scenario's SLO, per strategy, "
                        "and the fleet's upper bound (bound_rps: each GPU type alone at its limit, summed)")
    p.add_argument("--find-min-fleet", action="store_true",
                   help="instead of one run: per strategy, the cheapest fixed count per deployment that "
                        "meets the scenario's SLO (attainment >= 99 %%, nothing rejected), and each type alone "
                        "(\"what fleet do I need before I buy\"): every cheaper fleet within the caps "
                        "is run; --jobs runs fleets in parallel; --gateways, --no-token-sharing and "
                        "--capacity apply to every fleet")
    p.add_argument("--acceptance", action="store_true",
                   help="the optimizer's acceptance check for this scenario and --seed: the loop's mean cost "
                        "(--optimizer, strategy slo unless --strategies names one) against the verified "
                        "cheapest fixed fleet, SLO attainment, rejected, direction changes "
                        "(extproc/fleetsim/acceptance.py)")
    p.add_argument("--capacity", choices=("learned", "oracle"), default="learned",
                   help="diagnostic: 'oracle' gives routing each replica's true saturated throughput "
                        "instead of the gateway's learned estimate")
    p.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per strategy, <= CPUs)")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from extproc.fleetsim.report import markdown, write_json
    from extproc.fleetsim.runner import Options, compare
    from extproc.fleetsim.scenario import load

    try:
        scenario = load(args.scenario)
    except (OSError, ValueError, KeyError) as exc:
        print(f"fleet-sim: {exc}", file=sys.stderr)
        return 2
    scenario = scenario.scaled(args.rate_scale, args.duration)
    if args.profile_max_budget is not None:
        if args.profile_max_budget < 1:
            print("fleet-sim: --profile-max-budget must be >= 1", file=sys.stderr)
            return 2
        scenario = replace(scenario, profile_max_budget=args.profile_max_budget)
    if args.profile_budget_margin is not None:
        if not (math.isfinite(args.profile_budget_margin) and args.profile_budget_margin >= 1):
            print("fleet-sim: --profile-budget-margin must be a number >= 1", file=sys.stderr)
            return 2
        scenario = replace(scenario, profile_budget_margin=args.profile_budget_margin)
    strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else list(scenario.strategies)
    if args.gateways < 1:
        print("fleet-sim: --gateways must be >= 1", file=sys.stderr)
        return 2
    seeds = _seeds(args)
    if seeds is None:
        return 2
    options = Options(gateways=args.gateways, share_tokens=not args.no_token_sharing, seed=args.seed,
                      jobs=args.jobs, oracle_capacity=args.capacity == "oracle", optimizer=args.optimizer,
                      profiles_dir=args.profiles)
    if args.acceptance:
        return _acceptance(scenario, strategies if args.strategies else ["slo"], args, seeds)
    if args.find_min_fleet:
        refused = [flag for flag, on in (("--optimizer", args.optimizer), ("--profiles", args.profiles),
                                         ("--find-max-rate", args.find_max_rate), ("--plot", args.plot))
                   if on]
        if refused:  # fixed fleets: nothing here would use them
            print(f"fleet-sim: --find-min-fleet runs fixed fleets; {', '.join(refused)} does not apply",
                  file=sys.stderr)
            return 2
        return _min_fleet(scenario, strategies, args, seeds or [args.seed])
    bars = _Bars(strategies, scenario.duration_s, enabled=not args.no_progress)
    try:
        report = compare(scenario, strategies, options, bars.update)
    finally:
        bars.close()
    if args.find_max_rate:
        from extproc.fleetsim.maxrate import find_max_rates

        rates = find_max_rates(scenario, strategies, options)
        report["bound_rps"], report["bound_by_gpu"] = rates["bound_rps"], rates["bound_by_gpu"]
        for s, rps in rates["strategies"].items():  # type: ignore[union-attr]
            report["strategies"][s]["max_rate_rps"] = rps
    text = markdown(report)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        write_json(report, args.json)
    if args.plot:
        from extproc.fleetsim.plots import plot

        plot(report, args.plot)
    return 0


def _seeds(args: argparse.Namespace) -> list[int] | None:
    """--seeds as integers: [] when not given; None, having said why, when they are not integers or no
    fleet search runs."""
    if args.seeds is None:
        return []
    if not (args.find_min_fleet or args.acceptance):
        print("fleet-sim: --seeds applies to --find-min-fleet and --acceptance only", file=sys.stderr)
        return None
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        seeds = []
    if not seeds:
        print(f"fleet-sim: --seeds: expected comma-separated integers, got {args.seeds!r}", file=sys.stderr)
        return None
    return seeds


def _min_fleet(scenario: Any, strategies: list[str], args: argparse.Namespace, seeds: list[int]) -> int:
    import json

    from extproc.fleetsim.minfleet import RunSettings, find_min_fleet, markdown

    settings = RunSettings(seed=seeds[0], more_seeds=tuple(seeds[1:]), gateways=args.gateways,
                           share_tokens=not args.no_token_sharing, oracle_capacity=args.capacity == "oracle")
    found = []
    for strategy in strategies:
        try:
            found.append(find_min_fleet(scenario, strategy, jobs=args.jobs, settings=settings))
        except ValueError as exc:
            print(f"fleet-sim: {exc}", file=sys.stderr)
            return 2
    text = "\n\n".join(markdown(m) for m in found)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([m.as_json() for m in found], f, indent=1)
    return 0 if all(m.counts is not None for m in found) else 1


def _acceptance(scenario: Any, strategies: list[str], args: argparse.Namespace, seeds: list[int]) -> int:
    from extproc.fleetsim.acceptance import HEADER, accept
    from extproc.fleetsim.minfleet import RunSettings

    if len(strategies) != 1:
        print("fleet-sim: --acceptance checks one strategy", file=sys.stderr)
        return 2
    try:
        verdict = accept(scenario, args.seed, strategies[0], args.jobs, args.profiles, RunSettings(
            gateways=args.gateways, share_tokens=not args.no_token_sharing,
            oracle_capacity=args.capacity == "oracle"), yardstick_seeds=seeds)
    except ValueError as exc:
        print(f"fleet-sim: {exc}", file=sys.stderr)
        return 2
    print(HEADER)
    print(verdict.row())
    return 0 if verdict.passed else 1


class _Bars:
    """One tqdm bar per strategy over virtual seconds, on stderr."""

    def __init__(self, strategies: list[str], total: float, enabled: bool) -> None:
        self.bars: dict[str, Any] = {}
        if not enabled:
            return
        tqdm = extras.tqdm()
        for i, s in enumerate(strategies):
            self.bars[s] = tqdm(total=round(total), desc=f"{s:>16}", unit="sim s", position=i, leave=True,
                                file=sys.stderr, mininterval=0.5)

    def update(self, strategy: str, t: float) -> None:
        bar = self.bars.get(strategy)
        if bar is not None:
            bar.update(max(0, round(t) - bar.n))

    def close(self) -> None:
        for bar in self.bars.values():
            bar.update(max(0, bar.total - bar.n))
            bar.close()
