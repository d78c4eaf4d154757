"""From a run's raw outcomes to the report's figures: per GPU type and for the cluster.

Every figure covers requests that *arrived* in the measured window [warmup, duration), and engine work
done in it. Definitions (also in scenarios/README.md):
  qps                 requests routed to the type per second
  utilization         output tokens/s achieved / saturated output tokens/s for the same mix (saturation.py),
                      summed over the type's replicas while they were alive
  busy_fraction       share of time an engine step was running (~1 under any load with continuous batching)
  ttft / tpot         per request; tpot = (finish - first token) / (output tokens - 1)
  e2e / tpat          per request (cluster P99s); tpat = e2e / (prompt + output tokens)
  slo_attainment      share of arrived requests that completed within the SLO (rejected/failed ones miss)
  goodput_rps         requests meeting the SLO per second
  capacity_estimate   the gateway's saturated-capacity estimate / the engine model's saturated throughput:
                      lowest and highest over the type's replicas at the end of the arrivals (after
                      CAPACITY_AFTER_S of traffic), the median over every BUCKET_S sample since, and the
                      least traffic any of them got (its requests relative to an even split)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from extproc.fleetsim.autoscale import summary as autoscale_summary
from extproc.fleetsim.loop import BUCKET_S, FAILED, OK, REJECTED, RunResult
from extproc.slo.model import tokens_per

CAPACITY_AFTER_S = 120.0  # the capacity metric is judged after two minutes of traffic


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (no interpolation: a p99 is a latency some request really had)."""
    if not values:
        return None
    values = sorted(values)
    k = max(0, min(len(values) - 1, math.ceil(q / 100 * len(values)) - 1))
    return values[k]


def _latency(ttft: list[float], tpot: list[float]) -> dict[str, float | None]:
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99)}


def summarize(run: RunResult) -> dict[str, Any]:
    sc = run.scenario
    lo, hi = sc.warmup_s, sc.duration_s
    window = hi - lo
    slo = sc.slo
    gpus = sorted({r.gpu for r in run.replicas})
    per: dict[str, dict[str, Any]] = {g: {"routed": 0, "ok": 0, "met": 0, "ttft": [], "tpot": []} for g in gpus}
    counts = {"arrived": 0, "completed": 0, "rejected": 0, "failed": 0}
    met_total = 0
    all_ttft: list[float] = []
    all_tpot: list[float] = []
    all_e2e: list[float] = []
    all_tpat: list[float] = []
    out_tokens = 0
    for i, a in enumerate(run.arrivals):
        if not lo <= a.time < hi:
            continue
        counts["arrived"] += 1
        status = run.status[i]
        if status == REJECTED:
            counts["rejected"] += 1
        elif status == FAILED:
            counts["failed"] += 1
        r = run.replica_of[i]
        g = per[run.replicas[r].gpu] if r >= 0 else None
        if g is not None:
            g["routed"] += 1
        if status != OK:
            continue
        counts["completed"] += 1
        ttft, tpot, e2e = run.ttft[i], run.tpot[i], run.e2e[i]
        has_tpot = not math.isnan(tpot)
        tpat = e2e / tokens_per("tpat", a.prompt_tokens, run.output[i])
        met = slo.met(ttft, tpot if has_tpot else None, e2e, tpat)
        met_total += met
        all_ttft.append(ttft)
        all_e2e.append(e2e)
        all_tpat.append(tpat)
        if has_tpot:
            all_tpot.append(tpot)
        out_tokens += run.output[i]
        if g is not None:
            g["ok"] += 1
            g["met"] += met
            g["ttft"].append(ttft)
            if has_tpot:
                g["tpot"].append(tpot)
    gpu_types: dict[str, Any] = {}
    for gpu in gpus:
        reps = [r for r in run.replicas if r.gpu == gpu]
        alive_s = [serving_s(run, r.index, lo, hi) for r in reps]
        capacity = sum(r.saturated * s for r, s in zip(reps, alive_s))  # saturated token-seconds
        tokens = sum(r.tokens for r in reps)
        busy = sum(r.busy_s for r in reps)
        p = per[gpu]
        gpu_types[gpu] = {
            "replicas": len(reps),
            "saturated_tokens_per_s_per_replica": reps[0].saturated,
            "qps": p["routed"] / window,
            "utilization": tokens / capacity if capacity else 0.0,
            "busy_fraction": busy / sum(alive_s) if sum(alive_s) else 0.0,
            "output_tokens_per_s": tokens / window,
            **_latency(p["ttft"], p["tpot"]),
            "slo_attainment": p["met"] / p["routed"] if p["routed"] else None,
            "goodput_rps": p["met"] / window,
            "peak_queue": max(r.peak_waiting for r in reps),
            "preemptions": sum(r.preemptions for r in reps),
            "capacity_estimate": _capacity_estimate(run, reps),
        }
    cluster = {
        "qps": counts["arrived"] / window,
        "output_tokens_per_s": sum(r.tokens for r in run.replicas) / window,
        **_latency(all_ttft, all_tpot),
        "e2e_p99_s": percentile(all_e2e, 99),
        "tpat_p99_s": percentile(all_tpat, 99),  # E2E over prompt + output tokens
        "slo_attainment": met_total / counts["arrived"] if counts["arrived"] else None,
        "goodput_rps": met_total / window,
        "peak_queue": max(r.peak_waiting for r in run.replicas),
        "preemptions": sum(r.preemptions for r in run.replicas),
        # prompt tokens found in the engines' prefix caches / looked up, over the whole run
        "prefix_hit_rate": _prefix_hit_rate(run.replicas),
        **counts,
    }
    total = len(run.arrivals)
    conservation = {"arrivals": total,
                    "completed": sum(1 for s in run.status if s == OK),
                    "rejected": sum(1 for s in run.status if s == REJECTED),
                    "failed": sum(1 for s in run.status if s == FAILED)}
    out = {"gpu_types": gpu_types, "cluster": cluster, "all_requests": conservation,
           "slo_met": _slo_met(slo, cluster), "series": series(run)}
    if run.autoscale is not None:
        out["autoscale"] = autoscale_summary(run.autoscale, lo, hi)
    return out


def _capacity_estimate(run: RunResult, reps: list[Any]) -> dict[str, Any] | None:
    """The type's replicas' capacity estimate / engine saturated throughput: at the end of the
    arrivals (each live replica, after CAPACITY_AFTER_S of traffic) and the median over every sample
    since."""
    def ratios(row: list[float], t: float) -> list[float]:
        return [row[r.index] / r.saturated for r in reps
                if serving_s(run, r.index, t, t + 1e-9) > 0 and row[r.index] == row[r.index]]

    end = run.scenario.duration_s  # while traffic arrives: the drain after it is no steady state
    samples = [(t, row) for t, row in run.capacity_estimates if CAPACITY_AFTER_S <= t < end]
    if not samples:
        return None
    t_end, last = samples[-1]
    final = ratios(last, t_end)
    over_time = sorted(x for t, row in samples for x in ratios(row, t))
    if not final:
        return None
    routed = [0] * len(run.replicas)
    for r in run.replica_of:
        if r >= 0:
            routed[r] += 1
    even = sum(routed) / len(routed)
    return {"ratio_min": min(final), "ratio_max": max(final),
            "ratio_median_over_time": over_time[len(over_time) // 2],
            "least_traffic_share": min(routed[r.index] for r in reps) / even if even else None}


def _slo_met(slo: Any, cluster: dict[str, Any]) -> bool | None:
    """The scenario's SLO read as percentile targets: the p99 of each metric it sets within its bound."""
    targets = slo.targets
    if not targets:
        return None
    if cluster["rejected"] or cluster["failed"]:
        return False
    return all(cluster[f"{m}_p99_s"] is not None and cluster[f"{m}_p99_s"] <= bound
               for m, bound in targets.items())


def series(run: RunResult) -> dict[str, Any]:
    """Per BUCKET_S bucket: utilization, QPS and P99 TPOT (by arrival) per GPU type (the spec's figures);
    the gateway's SLO queue (the most waiting in the bucket) and rejections per second."""
    nb = len(next(iter(run.bucket_tokens.values()), []))
    out: dict[str, Any] = {"bucket_s": BUCKET_S, "utilization": {}, "qps": {}, "tpot_p99_s": {},
                           "queue": [0] * nb, "rejected_per_s": [0.0] * nb}
    tpots: dict[str, list[list[float]]] = {gpu: [[] for _ in range(nb)] for gpu in run.bucket_tokens}
    for i, a in enumerate(run.arrivals):
        b = int(a.time // BUCKET_S)
        if not 0 <= b < nb:
            continue
        if run.status[i] == REJECTED:
            out["rejected_per_s"][b] += 1 / BUCKET_S
        elif run.replica_of[i] >= 0 and not math.isnan(run.tpot[i]):
            tpots[run.replicas[run.replica_of[i]].gpu][b].append(run.tpot[i])
    for t, waiting in run.queue_samples:
        b = int(t // BUCKET_S)
        if 0 <= b < nb:
            out["queue"][b] = max(out["queue"][b], waiting)
    for gpu, tokens in run.bucket_tokens.items():
        reps = [r for r in run.replicas if r.gpu == gpu]
        util = []
        for b, n in enumerate(tokens):
            t0, t1 = b * BUCKET_S, min((b + 1) * BUCKET_S, run.scenario.duration_s)
            cap = sum(r.saturated * serving_s(run, r.index, t0, t1) for r in reps)
            util.append(n / cap if cap > 0 else 0.0)
        out["utilization"][gpu] = util
        out["qps"][gpu] = [c / BUCKET_S for c in run.bucket_routed[gpu]]
        out["tpot_p99_s"][gpu] = [percentile(v, 99) for v in tpots[gpu]]
    return out


def serving_s(run: RunResult, index: int, lo: float, hi: float) -> float:
    """Seconds of [lo, hi) the replica was serving (alive, draining included)."""
    return sum(max(0.0, min(hi, end) - max(lo, start)) for start, end in run.spans[index])


def strip_series(summary: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in summary.items() if k != "series"}
    if "autoscale" in out:
        out["autoscale"] = {k: v for k, v in out["autoscale"].items() if k != "series"}
    return out


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _prefix_hit_rate(replicas) -> float | None:  # noqa: ANN001
    queries = sum(r.driver.engine.prefix_queries_total for r in replicas)
    hits = sum(r.driver.engine.prefix_hits_total for r in replicas)
    return hits / queries if queries else None
