"""`extproc score --pods PODS.json [--strategy load-balance] [--json]`: what routing would do, for operators.

PODS.json is a list of {"name", "running", "queued", "tokens_per_s" (null: no estimate), "kv_free"
(fraction, null: not reported), "cpu_kv_usage" (optional)}. The strategy runs exactly as in the gateway
(imbalance gate, auto-blend, the AIBRIX_* / EXTPROC_* knobs from the environment), with a fixed seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MODEL = "score"


@dataclass(slots=True, frozen=True)
class Scored:
    chosen: str
    scores: dict[str, float]   # after the gate: pods it excluded are absent
    excluded: list[str]        # by the imbalance gate
    lower_is_better: bool
    routed_as: str             # the strategy after auto-blend, weights included


def add_commands(sub: Any) -> None:
    """Add `score` to `extproc`'s subcommands."""
    p = sub.add_parser("score", help="score pods from a JSON snapshot with a routing strategy",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pods", required=True, help="JSON file: a list of pods (see above)")
    p.add_argument("--strategy", default=None,
                   help="a routing-strategy value, e.g. load-balance or prefix-cache:5,load-balance:4 "
                        "(default: the configured default, load-balance)")
    p.add_argument("--json", action="store_true", help='print {"chosen": NAME, "scores": {NAME: score}}')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from extproc.routing import SettingError, StrategySpecError

    try:
        with open(args.pods) as f:
            raw = json.load(f)
        result = score(raw, args.strategy, os.environ)
    except (OSError, ValueError) as exc:  # JSON, settings and strategy errors are all ValueErrors
        kind = "strategy" if isinstance(exc, StrategySpecError) else \
            "setting" if isinstance(exc, SettingError) else "pods"
        print(f"extproc score: {kind}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"chosen": result.chosen, "scores": {k: _json_number(v) for k, v in
                                                              result.scores.items()},
                          **({"excluded": result.excluded} if result.excluded else {})}))
    else:
        print(table(result))
    return 0


def score(raw: Any, strategy: str | None, env: Mapping[str, str]) -> Scored:
    """Score a pod snapshot; raises ValueError (StrategySpecError, SettingError) on bad input."""
    import extproc.strategies  # noqa: F401  (any strategy the gateway offers, the slo family too)
    from extproc.openai import Request
    from extproc.routing import Router
    from extproc.routing.settings import merge_env, parse_settings

    routing: dict[str, Any] = {"seed": 0}
    for var in ("ROUTING_ALGORITHM", "AIBRIX_ROUTING_ALGORITHM", "EXTPROC_DEFAULT_STRATEGY"):
        if env.get(var):
            routing["default_strategy"] = env[var]
    router = Router(parse_settings(merge_env(routing, env)))
    views = pod_views(raw)
    spec = router.parse(strategy)
    profile = router.profile_for(spec, MODEL)
    request = Request(model=MODEL, path="/v1/chat/completions")
    candidates = list(profile.candidates(request, views, 0.0))
    if not candidates:
        raise ValueError("no pods")
    totals = profile.totals(request, candidates, 0.0) if profile.scorers else [math.nan] * len(candidates)
    chosen = profile.picker.pick(candidates, totals) if len(candidates) > 1 else candidates[0]
    kept = {v.pod.name for v in candidates}
    # Routing alone a strategy's raw scores are shown; blended, the weighted normalised totals.
    lower = len(profile.scorers) == 1 and profile.scorers[0][0].lower_is_better
    return Scored(chosen.pod.name, {v.pod.name: s for v, s in zip(candidates, totals)},
                  [v.pod.name for v in views if v.pod.name not in kept], lower,
                  router.resolve(spec, MODEL).weighted)


def pod_views(raw: Any) -> list:
    """PodViews from the JSON list, capacities mean-filled as the gateway does."""
    from extproc.pool.pod import Pod
    from extproc.routing import PodView

    if not isinstance(raw, list) or not raw:
        raise ValueError("PODS must be a non-empty JSON list of pods")
    views, seen = [], set()
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ValueError(f"pods[{i}] needs a name")
        name = entry["name"]
        if name in seen:
            raise ValueError(f"pods[{i}]: duplicate name {name!r}")
        seen.add(name)
        views.append(PodView(
            Pod(MODEL, name, f"127.0.0.1:{1 + i}", labels={"gpu": str(entry.get("gpu", ""))}),
            running=int(_field(entry, "running", i, 0)),
            queued=_field(entry, "queued", i, 0.0),
            kv_free=_fraction(entry, "kv_free", i),
            cpu_kv_usage=_fraction(entry, "cpu_kv_usage", i),
            capacity=_optional(entry, "tokens_per_s", i)))
    known = [v.capacity for v in views if v.capacity is not None and v.capacity > 0]
    for v in views:  # the gateway's mean fill: a pod with no estimate competes as an average one
        if known and (v.capacity is None or v.capacity <= 0):
            v.capacity = sum(known) / len(known)
    return views


def table(result: Scored) -> str:
    order = "lower" if result.lower_is_better else "higher"
    width = max(len(n) for n in [*result.scores, *result.excluded, "pod"])
    lines = [f"strategy: {result.routed_as}", f"{'pod':<{width}}  score ({order} is better)"]
    for name, s in result.scores.items():
        mark = "  <- chosen" if name == result.chosen else ""
        lines.append(f"{name:<{width}}  {_text(s)}{mark}")
    for name in result.excluded:
        lines.append(f"{name:<{width}}  excluded by the load-imbalance gate")
    lines.append(f"chosen: {result.chosen}")
    return "\n".join(lines)


def _text(s: float) -> str:
    if math.isnan(s):
        return "-"
    return "inf" if s == math.inf else f"{s:.4f}" if abs(s) >= 1e-3 or s == 0 else f"{s:.3g}"


def _json_number(s: float) -> float | str | None:
    if math.isnan(s):
        return None
    return "inf" if s == math.inf else s


def _field(entry: dict, key: str, i: int, default: float) -> float:
    value = entry.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or not math.isfinite(value):
        raise ValueError(f"pods[{i}].{key} must be a number >= 0, not {value!r}")
    return value


def _optional(entry: dict, key: str, i: int) -> float | None:
    return None if entry.get(key) is None else _field(entry, key, i, 0.0)


def _fraction(entry: dict, key: str, i: int) -> float | None:
    value = _optional(entry, key, i)
    if value is not None and value > 1:
        raise ValueError(f"pods[{i}].{key} is a fraction from 0 to 1, not {value!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:  # `python -m extproc.score_cli`
    parser = argparse.ArgumentParser(prog="extproc")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["score", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
