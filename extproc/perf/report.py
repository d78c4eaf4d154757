"""The readable tables of `extproc bench overhead` (pure: a summary dict in, text out)."""

from __future__ import annotations

from typing import Any

PATH_LABELS = (("upstream", "upstream, no proxy"), ("direct", "(a) Envoy alone"),
               ("routed", "(b) Envoy + gateway routing"), ("gateway", "(c) full path"),
               ("workers", "(c) full path, --workers"), ("before", "(c) before (--baseline)"),
               ("limited", "(c) full path, rate limits on"), ("duplex", "(c) full path, full-duplex body"),
               ("pool", "pool (envoy-config --pool)"), ("pool_buffered", "pool, buffered body"),
               ("pool_before", "pool, before (--baseline)"), ("pool_floor", "pool, fixed-answer picker"))
# Paths set beside a buffered one, round by round (overhead.summarize computes, body_modes_table prints):
# (label prefix, path, the buffered path beside it, its name in the keys, what the line says). A body
# mode is judged within its attachment: our bootstrap's full duplex beside its buffered body, the pool's
# beside the same pool with a buffered body; every pool path is also set beside our bootstrap's buffered
# path, which shows what the pool's protocol (its extra messages) costs.
BODY_MODES = (("duplex_", "duplex", "full", "buffered", "full-duplex body beside buffered (our bootstrap)"),
              ("pool_", "pool", "pool-buffered", "pool_buffered", "pool: full-duplex body beside buffered"),
              ("pool_", "pool", "full", "buffered", "pool beside our bootstrap, buffered"),
              ("pool_buffered_", "pool-buffered", "full", "buffered", "pool, buffered body, beside ours"),
              ("pool_before_", "pool-before", "full", "buffered", "pool, before (--baseline), beside ours"),
              ("pool_floor_", "pool-floor", "full", "buffered", "pool, fixed-answer picker, beside ours"))

# (what, where in the summary, at least/at most, limit)
TARGETS = (  # issue 20
    ("c1 added p50 <= 0.6 ms", ("c1", "added_p50_ms"), "max", 0.6),
    ("c1 added p99 <= 2 ms", ("c1", "added_p99_ms"), "max", 2.0),
    ("c64 >= 3000 routed req/s", ("c64", "gateway_rps"), "min", 3000.0),
    ("c64 full path >= 0.3x Envoy alone's req/s", ("c64", "rps_ratio"), "min", 0.3),
    ("gateway CPU <= 200 us per request (c64)", ("c64", "gateway_cpu_us_per_request"), "max", 200.0),
    (">= 12800 tallied tok/s (256 streams) with added ITL p99 <= 1 ms", ("stream", "max_chunks_per_s"),
     "min", 12800.0),
    ("decision <= 30 us at 100 pods", ("decision_us", "100"), "max", 30.0),
    ("decision <= 300 us at 1000 pods", ("decision_us", "1000"), "max", 300.0),
    # issue 40: a full-duplex body costs at most 15 % more per request than a buffered one, in the same
    # attachment (our bootstrap; a pool), at c1 and c64: time per request, round by round
    *((f"c{c} full-duplex <= 1.15x buffered per request ({where})", (f"c{c}", f"{key}_rps_ratio"),
       "max", 1.15)
      for c in (1, 64)
      for key, where in (("duplex_vs_buffered", "bootstrap"), ("pool_vs_pool_buffered", "pool"))),
)


def target_status(summary: dict[str, Any]) -> list[tuple[str, float | None, bool | None]]:
    """(target, measured value, met) for each target; None where this run did not measure it."""
    out = []
    for name, (section, key), kind, limit in TARGETS:
        value = summary.get(section, {}).get(key)
        if value is None or value != value or (section == "stream" and not summary[section].get("levels")):
            out.append((name, None, None))
            continue
        out.append((name, value, value <= limit if kind == "max" else value >= limit))
    return out

def _f(value: Any, digits: int = 2) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def requests_table(summary: dict[str, Any], concurrencies: tuple[int, ...]) -> str:
    lines = [f"{'path':30} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'+p50 ms':>8} "
             f"{'+p99 ms':>8} {'gw us/req':>9}"]
    for c in concurrencies:
        row = summary.get(f"c{c}", {})
        for key, label in PATH_LABELS:
            if f"{key}_p50_ms" not in row:
                continue
            added = {"routed": "routed_", "gateway": "", "workers": "workers_", "before": "before_",
                     "limited": "limited_", "duplex": "duplex_", "pool": "pool_",
                     "pool_buffered": "pool_buffered_", "pool_before": "pool_before_",
                     "pool_floor": "pool_floor_"}.get(key)
            lines.append(
                f"{label:30} {c:>4} {_f(row[f'{key}_p50_ms']):>8} {_f(row[f'{key}_p99_ms']):>8} "
                f"{_f(row[f'{key}_rps'], 0):>8} "
                f"{_f(row.get(f'{added}added_p50_ms')) if added is not None else '':>8} "
                f"{_f(row.get(f'{added}added_p99_ms')) if added is not None else '':>8} "
                f"{_f(row.get(f'{added}gateway_cpu_us_per_request'), 0) if added is not None else '':>9}")
    return "\n".join(lines)


def streams_table(summary: dict[str, Any]) -> str:
    lines = [f"{'streams':>7} {'tok/s (a)':>9} {'tok/s (c)':>9} {'ITL p99 a':>9} {'ITL p99 c':>9} "
             f"{'+ITL p50':>8} {'+ITL p99':>8} {'TTFT p50 a/c ms':>16} {'tally':>6} {'gw us/tok':>9} "
             f"{'envoy us/tok a/c':>17} {'gw core':>7} {'+ITL p99 lua':>12}"]
    for lv in summary["stream"]["levels"]:
        tally = "ok" if lv.get("tally_ok") else f"-{lv.get('tally_missing', 0):.0f}" if "tally_ok" in lv else "-"
        lines.append(
            f"{lv['streams']:>7} {_f(lv.get('direct_tokens_per_s'), 0):>9} {_f(lv.get('gateway_tokens_per_s'), 0):>9} "
            f"{_f(lv.get('direct_itl_p99_ms')):>9} {_f(lv.get('gateway_itl_p99_ms')):>9} "
            f"{_f(lv.get('added_itl_p50_ms')):>8} {_f(lv.get('added_itl_p99_ms')):>8} "
            f"{_f(lv.get('direct_ttft_p50_ms')) + '/' + _f(lv.get('gateway_ttft_p50_ms')):>16} {tally:>6} "
            f"{_f(lv.get('gateway_cpu_us_per_token'), 1):>9} "
            f"{_f(lv.get('direct_envoy_cpu_us_per_token'), 1) + '/' + _f(lv.get('gateway_envoy_cpu_us_per_token'), 1):>17} "
            f"{_f(lv.get('gateway_cpu_share')):>7} {_f(lv.get('lua_added_itl_p99_ms')):>12}")
    return "\n".join(lines)


def body_modes_table(summary: dict[str, Any], concurrencies: tuple[int, ...]) -> str:
    lines = []
    for c in concurrencies:
        row = summary.get(f"c{c}", {})
        for label, _, _, ref_name, name in BODY_MODES:
            vs = f"{label}vs_{ref_name}"
            if f"{vs}_p50_ratio" in row:
                lines.append(f"  c{c:<4} {name:48} p50 x{_f(row[f'{vs}_p50_ratio'], 3)}  "
                             f"time per request (1/req/s) x{_f(row[f'{vs}_rps_ratio'], 3)}  "
                             f"gateway+Envoy CPU per request x{_f(row[f'{vs}_cpu_ratio'], 3)}")
    return "\n".join(lines)


def decision_table(decision: dict[str, Any]) -> str:
    sizes = [k for k in decision if k.isdigit()]
    return (f"routing decision ({decision.get('strategy')}), in process: "
            + ", ".join(f"{k} pods {decision[k]:.1f} us (p99 {decision[f'{k}_p99']:.1f})" for k in sizes))


def targets_table(summary: dict[str, Any]) -> str:
    return "\n".join(f"  {'met ' if ok else 'MISS' if ok is False else '  - '}  {name}: {_f(value)}"
                     for name, value, ok in target_status(summary))

def render(summary: dict[str, Any], concurrencies: tuple[int, ...]) -> str:
    parts = ["request path (JSON, medians over rounds; + = added over (a) in the same round):",
             requests_table(summary, concurrencies)]
    modes = body_modes_table(summary, concurrencies)
    if modes:
        parts += ["", "body modes beside a buffered path, per round (x = times the buffered one):", modes]
    if summary["stream"]["levels"]:
        s = summary["stream"]
        parts += ["", "streaming at live pace, (a) Envoy alone vs (c) full path (tally checked against the "
                  "upstream's count):", streams_table(summary),
                  f"max tallied rate with added ITL p99 <= 1 ms: {s['max_chunks_per_s']:.0f} tok/s "
                  f"({s['max_chunks_streams']} streams)"]
    if summary.get("decision_us"):
        parts += ["", decision_table(summary["decision_us"])]
    parts += ["", "targets:", targets_table(summary)]
    return "\n".join(parts)
