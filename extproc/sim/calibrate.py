"""`extproc engine-sim calibrate`: the engine model against published vLLM measurements.

    extproc engine-sim calibrate                  every row, model vs published, summaries, acceptance
    extproc engine-sim calibrate --split holdout  only the held-out rows (the fit never saw them)
    extproc engine-sim calibrate --json           the same as JSON
    extproc engine-sim calibrate --fit            fit efficiencies and overheads on the fit split and
                                                  print them (the values committed in efficiency.py, ...)
    extproc engine-sim calibrate --csv FILE       another calibration set with the same columns

Rows, figures and the split: extproc/sim/calibration.py and data/calibration/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from extproc.sim import calibration as cal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--csv", type=Path, default=cal.DEFAULT_CSV, help="calibration set (CSV)")
    parser.add_argument("--split", choices=("all", "fit", "holdout"), default="all",
                        help="rows to list (summaries are given per split either way)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--fit", action="store_true",
                        help="fit the model on the fit split and print the values to commit (minutes)")
    parser.add_argument("--max-evals", type=int, default=600, help="--fit: objective evaluations per stage")


def run(args: argparse.Namespace) -> int:
    try:
        rows = cal.load(args.csv)
    except (OSError, cal.CalibrationDataError) as e:
        print(f"engine-sim calibrate: {e}", file=sys.stderr)
        return 2
    if args.fit:
        from extproc.sim import fit

        fitted = fit.fit(rows, args.max_evals)
        print(fit.render(fitted))
        print()
        results = fitted.simulate(rows)
    else:
        results = cal.simulate(rows)
    shown = [r for r in results if args.split == "all" or r.measurement.split == args.split]
    checks = cal.acceptance(results)
    if args.json:
        print(json.dumps(as_json(shown, results, checks), indent=1))
    else:
        print(render(shown, results, checks))
    return 0


def _row(r: cal.Result) -> dict[str, object]:
    m, w = r.measurement, r.measurement.workload
    return {
        "id": m.id, "split": m.split, "gpu": w.gpu, "model": w.model, "input_tokens": w.input_tokens,
        "output_tokens": w.output_tokens, "concurrency": w.concurrency,
        "request_rate": "inf" if w.request_rate is None else w.request_rate, "num_prompts": w.num_prompts,
        "figure": m.figure, "statistic": m.statistic, "unit": m.unit, "published": m.value,
        "model_value": r.simulated, "error": r.error, "excluded": m.exclude_reason or None,
        "source": w.source_url,
    }


def _summaries(results: list[cal.Result]) -> dict[str, dict[str, list[dict[str, object]]]]:
    out: dict[str, dict[str, list[dict[str, object]]]] = {}
    for split in ("holdout", "fit"):
        counted = cal.counted(results, split)
        out[split] = {
            name: [{"group": s.group, "count": s.count, "median_abs_error": s.median_abs_error,
                    "max_abs_error": s.max_abs_error} for s in cal.summarise(counted, key)]
            for name, key in (("by_gpu", cal.by_gpu), ("by_figure", cal.by_figure))
        }
    return out


def as_json(shown: list[cal.Result], results: list[cal.Result], checks: list[cal.Check]) -> dict[str, object]:
    return {
        "rows": [_row(r) for r in shown],
        "summary": _summaries(results),
        "acceptance": [{"check": c.name, "count": c.count, "value": c.value, "limit": c.limit, "ok": c.ok}
                       for c in checks],
    }


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def render(shown: list[cal.Result], results: list[cal.Result], checks: Sequence[cal.Check]) -> str:
    lines = [f"{'id':28} {'split':7} {'GPU':9} {'model':12} {'in/out':>10} {'conc':>4} "
             f"{'figure':24} {'published':>10} {'model':>10} {'error':>6}"]
    for r in shown:
        m, w = r.measurement, r.measurement.workload
        mark = "  (excluded)" if m.exclude_reason else ""
        lines.append(
            f"{m.id:28} {m.split:7} {w.gpu:9} {w.model:12} {f'{w.input_tokens}/{w.output_tokens}':>10} "
            f"{w.concurrency:>4} {f'{m.figure} {m.statistic} {m.unit}':24} {_num(m.value):>10} "
            f"{_num(r.simulated):>10} {r.error * 100:+5.0f}%{mark}")
    for split, title in (("holdout", "held-out rows (never fitted)"), ("fit", "fit rows")):
        counted = cal.counted(results, split)
        lines += ["", f"{title}: {len(counted)} (excluded rows not counted)"]
        for name, key in (("GPU", cal.by_gpu), ("figure", cal.by_figure)):
            for s in cal.summarise(counted, key):
                lines.append(f"  {name:6} {s.group:30} n={s.count:<3} median |error| "
                             f"{s.median_abs_error * 100:5.1f} %   max {s.max_abs_error * 100:5.1f} %")
    lines += ["", "acceptance (issue 43):"]
    for c in checks:
        verdict = "ok " if c.ok else "NO "
        lines.append(f"  {verdict} {c.name}: {c.value * 100:.1f} % (limit {c.limit * 100:.0f} %)")
    return "\n".join(lines)
