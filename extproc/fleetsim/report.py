"""The report as markdown (stdout, docs) and JSON (without the bulky time series unless asked)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = ("strategy", "scope", "QPS", "util %", "busy %", "out tok/s", "TTFT p50/p99 ms",
           "TPOT p50/p99 ms", "SLO %", "goodput rps", "peak queue", "preempt")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}" if v >= 0.1 else f"{v * 1000:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}"


def _row(strategy: str, scope: str, m: dict[str, Any]) -> str:
    cells = [strategy, scope, f"{m['qps']:.1f}", _pct(m.get("utilization")), _pct(m.get("busy_fraction")),
             f"{m['output_tokens_per_s']:.0f}", f"{_ms(m['ttft_p50_s'])} / {_ms(m['ttft_p99_s'])}",
             f"{_ms(m['tpot_p50_s'])} / {_ms(m['tpot_p99_s'])}", _pct(m.get("slo_attainment")),
             f"{m['goodput_rps']:.1f}", str(m["peak_queue"]), str(m["preemptions"])]
    return "| " + " | ".join(cells) + " |"


def markdown(report: dict[str, Any]) -> str:
    fleet = ", ".join(f"{g['replicas']} x {g['gpu']}" for g in report["fleet"])
    slo = report["slo"]
    slo_text = ", ".join(f"{k.split('_')[0].upper()} <= {v * 1000:g} ms" for k, v in slo.items() if v) or "none"
    lines = [
        f"Scenario `{report['scenario']}`: {report['model']} on {fleet}; {report['rate_rps']:.1f} req/s for "
        f"{report['duration_s']:g} s (first {report['warmup_s']:g} s not measured); "
        f"{report['gateways']} gateway(s){'' if report['token_sharing'] else ', token counters NOT shared'}; "
        f"{'ORACLE capacities (diagnostic); ' if report.get('capacity') == 'oracle' else ''}"
        f"seed {report['seed']}; SLO per request: {slo_text}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for name, s in report["strategies"].items():
        for gpu, m in s["gpu_types"].items():
            lines.append(_row(name, gpu, m))
        lines.append(_row(name, "**cluster**", s["cluster"]))
    lines.append("")
    for name, s in report["strategies"].items():
        c = s["cluster"]
        extra = ""
        if "max_rate_rps" in s:
            rps, bound = s["max_rate_rps"], report.get("bound_rps")
            extra = f"; max rate meeting the SLO {'-' if rps is None else f'{rps:.1f} req/s'}"
            if rps is not None and bound:
                extra += f" ({rps / bound:.2f} of bound_rps)"
        if c.get("prefix_hit_rate") is not None:
            extra += f"; prefix-cache hit rate {c['prefix_hit_rate'] * 100:.1f} % of prompt tokens"
        caps = [f"{gpu} {e['ratio_min']:.2f}-{e['ratio_max']:.2f} (median over time {e['ratio_median_over_time']:.2f}; "
                f"least-served replica {e['least_traffic_share']:.2f}x an even share)"
                for gpu, m in s["gpu_types"].items() if (e := m.get("capacity_estimate"))]
        if caps:
            extra += "; capacity estimate / engine saturated throughput, every replica at the end: " + ", ".join(caps)
        lines.append(f"- {name}: {c['arrived']} requests measured ({c['completed']} completed, {c['rejected']} "
                     f"rejected, {c['failed']} failed); {s['wall_s']:.1f} s wall{extra}")
    autoscaled = {name: s["autoscale"] for name, s in report["strategies"].items() if s.get("autoscale")}
    if autoscaled:
        lines += ["", "| strategy | GPU cost / h (mean, measured) | at the end | replicas (min-max, measured) | "
                  "most direction changes in 5 min | SLO % |", "|---|---|---|---|---|---|"]
        for name, a in autoscaled.items():
            reps = ", ".join(f"{d} {lo}-{hi}" for d, (lo, hi) in a["replicas_range"].items())
            turns = ", ".join(f"{d} {n}" for d, n in a["turns_per_5min"].items())
            slo_pct = report["strategies"][name]["cluster"]["slo_attainment"] * 100
            lines.append(f"| {name} | {a['cost_per_hour_mean']:.2f} | {a['cost_per_hour_end']:.2f} | {reps} | "
                         f"{turns} | {slo_pct:.1f} |")
        for name, a in autoscaled.items():
            for err in a["plan_errors"]:
                lines.append(f"- {name}, re-plan at {err}")
    if report.get("bound_rps") is not None:
        parts = ", ".join(f"{gpu} {'-' if v is None else f'{v:.1f}'}" for gpu, v in report["bound_by_gpu"].items())
        lines.append(f"- bound_rps (each GPU type alone at its highest rate meeting the SLO, summed): "
                     f"{report['bound_rps']:.1f} req/s ({parts})")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str | Path, series: bool = True) -> None:
    out = report if series else {**report, "strategies": {
        k: {kk: vv for kk, vv in v.items() if kk != "series"} for k, v in report["strategies"].items()}}
    Path(path).write_text(json.dumps(out, indent=1, sort_keys=False) + "\n")
