"""`extproc bench overhead`: what the gateway adds to Envoy alone, measured side by side in one run.

Paths (extproc/perf/stack.py): "upstream" (client -> upstream, for reference), (a) "envoy" alone (the
client names the pod: the physical limit of this proxy), (b) "routed" (Envoy + the gateway's ext_proc
routing), (c) "full" (routing + Lua tally + access log: the product). Rounds interleave the paths, in
a rotating order, so machine noise hits each alike; every figure is the median over rounds, and every
"added" figure is computed per round against (a) in that round, then the median taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from extproc.perf import profile
from extproc.perf.epoll_client import LoadResult, run_load
from extproc.perf.report import BODY_MODES
from extproc.perf.stack import BenchPath, Stack
from extproc.perf.stats import cpu_seconds, median, metric_sum, percentile, tree_cpu_seconds

TALLY_METRIC = "extproc_output_tokens_total"
RUNNING_METRIC = "extproc_pod_running_requests"
ITL_BUDGET_MS = 1.0  # the added inter-token latency p99 a tallied stream rate may cost


@dataclass(slots=True)
class Settings:
    duration: float = 3.0                 # seconds measured per request-path run
    rounds: int = 3
    stream_rounds: int = 2
    concurrencies: tuple[int, ...] = (1, 16, 64)
    streams: tuple[int, ...] = (64, 128, 256, 384, 512)
    json_tokens: int = 16
    stream_tokens: int = 64               # mean per streamed request (uniform 0.5x-1.5x): 1.28 s at 20 ms
    itl_ms: float = 20.0
    warmup: float = 0.5
    paths: tuple[str, ...] = ("direct", "envoy", "routed", "full")
    stream_paths: tuple[str, ...] = ("envoy", "full")
    profile_dir: Path | None = None       # py-spy the gateways during the heaviest runs of round 1

    @property
    def stream_window(self) -> float:
        return 1.5 * self.duration

    @property
    def stream_warmup(self) -> float:
        # Streams start staggered over one ITL; the first generations end after stream_tokens * ITL,
        # and from then on requests start at spread-out times: measure after that.
        return min(1.5 * self.stream_tokens * self.itl_ms / 1e3, 2.0)


@dataclass(slots=True)
class Run:
    path: str
    load: int                              # concurrency, or concurrent streams
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    rps: float = 0.0
    tokens_per_s: float = 0.0
    itl_p50_ms: float = float("nan")
    itl_p99_ms: float = float("nan")
    ttft_p50_ms: float = float("nan")
    ttft_p99_ms: float = float("nan")
    tokens_sent: int = 0                   # by the upstream during the run, drain included
    tokens_received: int = 0
    tally: float = float("nan")            # the gateway's extproc_output_tokens_total delta
    tally_ok: bool | None = None
    running_after: float = float("nan")    # in-flight count the gateway still holds after the drain
    usage_leaked: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)  # per process, over the run
    upstream_late_max_ms: float = 0.0
    elapsed_s: float = 0.0                 # wall time of the run, warm-up and drain included


def _cpu_snapshot(stack: Stack, path: BenchPath) -> dict[str, float]:
    pids = {"upstream": stack.upstream.popen.pid}
    if path.envoy is not None:
        pids["envoy"] = path.envoy.popen.pid
    cpu = {k: cpu_seconds(pid) for k, pid in pids.items()}
    if path.gateway is not None:  # with its children: the workers of `serve --workers`, the body parser
        cpu["gateway"] = tree_cpu_seconds(path.gateway.pid)
    return cpu | {"client": time.process_time()}


def _measure(stack: Stack, path: BenchPath, load: int, drive: Callable[[], LoadResult],
             tally_timeout: float = 5.0) -> Run:
    tally0 = (metric_sum(path.gateway.metrics(), TALLY_METRIC)
              if path.gateway is not None and path.name in ACCESS_LOG_PATHS else 0.0)
    sent0 = stack.upstream_stats()["tokens"]
    cpu0 = _cpu_snapshot(stack, path)
    t0 = time.perf_counter()
    result = drive()
    up = stack.upstream_stats()
    run = Run(path=path.name, load=load, tokens_sent=int(up["tokens"] - sent0), tokens_received=result.tokens,
              rps=result.rps, tokens_per_s=result.tokens_per_s, usage_leaked=result.usage_leaked,
              errors=result.errors, completed=result.completed, upstream_late_max_ms=up["late_max_ms"])
    if path.gateway is not None and path.name in ACCESS_LOG_PATHS:
        # Records reach the gateway every 20 ms after each request ends: wait for the last ones.
        deadline = time.monotonic() + tally_timeout
        while True:
            text = path.gateway.metrics()
            run.tally = metric_sum(text, TALLY_METRIC) - tally0
            run.running_after = metric_sum(text, RUNNING_METRIC)
            if (run.tally == run.tokens_sent and run.running_after == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # polling a counter across processes; the loop condition decides
        run.tally_ok = run.tally == run.tokens_sent
    cpu1 = _cpu_snapshot(stack, path)
    run.cpu_s = {k: cpu1[k] - cpu0[k] for k in cpu0}
    run.elapsed_s = time.perf_counter() - t0
    ms = 1e3
    run.p50_ms, run.p99_ms = percentile(result.latencies, 0.5) * ms, percentile(result.latencies, 0.99) * ms
    run.itl_p50_ms, run.itl_p99_ms = percentile(result.gaps, 0.5) * ms, percentile(result.gaps, 0.99) * ms
    run.ttft_p50_ms, run.ttft_p99_ms = percentile(result.ttft, 0.5) * ms, percentile(result.ttft, 0.99) * ms
    return run


def request_run(stack: Stack, path: BenchPath, concurrency: int, s: Settings) -> Run:
    return _measure(stack, path, concurrency, lambda: run_load(
        path.target, concurrency=concurrency, duration=s.duration, stream=False, max_tokens=s.json_tokens,
        warmup=s.warmup))


def stream_run(stack: Stack, path: BenchPath, streams: int, s: Settings) -> Run:
    return _measure(stack, path, streams, lambda: run_load(
        path.target, concurrency=streams, duration=s.stream_window, stream=True,
        max_tokens=(max(1, s.stream_tokens // 2), s.stream_tokens * 3 // 2), warmup=s.stream_warmup,
        stagger=s.itl_ms / 1e3))


def _rotate(items: tuple[str, ...], n: int) -> tuple[str, ...]:
    n %= len(items)
    return items[n:] + items[:n]


def _profiled(path: BenchPath, seconds: float, out: Path | None, measure: Callable[[], Run]) -> Run:
    """`measure()` with py-spy sampling the path's gateway into `out` (when given and it has one)."""
    rec = None
    if out is not None and path.gateway is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        rec = profile.record(path.gateway.pid, seconds, out)
    run = measure()
    if rec is not None:
        rec.wait()
    return run


def run_all(stack: Stack, s: Settings, progress: Callable[[str], None] = print) -> dict[str, list[Run]]:
    """Every run, keyed "req/<c>/<path>" or "stream/<n>/<path>", one Run per round."""
    runs: dict[str, list[Run]] = {}
    paths = tuple(p for p in s.paths if p in stack.paths and p != "tally")  # tally: streaming only
    top_c, top_n = max(s.concurrencies, default=0), max(s.streams, default=0)
    for r in range(s.rounds):
        for c in s.concurrencies:
            for name in _rotate(paths, r + c):
                path = stack.paths[name]
                out = s.profile_dir / f"{name}-c{c}.txt" if s.profile_dir and r == 0 and c == top_c else None
                run = _profiled(path, s.warmup + s.duration, out, lambda: request_run(stack, path, c, s))
                runs.setdefault(f"req/{c}/{name}", []).append(run)
                progress(f"round {r + 1} c={c:<4} {name:7} p50 {run.p50_ms:6.2f} ms  p99 {run.p99_ms:6.2f} ms"
                         f"  {run.rps:7.0f} req/s  {_errors(run)}")
    stream_paths = tuple(p for p in s.stream_paths if p in stack.paths)
    for r in range(s.stream_rounds):
        for n in s.streams:
            for name in _rotate(stream_paths, r + n):
                path = stack.paths[name]
                out = s.profile_dir / f"{name}-streams{n}.txt" if s.profile_dir and r == 0 and n == top_n \
                    else None
                run = _profiled(path, s.stream_warmup + s.stream_window, out,
                                lambda: stream_run(stack, path, n, s))
                runs.setdefault(f"stream/{n}/{name}", []).append(run)
                progress(f"round {r + 1} streams={n:<5} {name:7} {run.tokens_per_s:7.0f} tok/s  ITL p50 "
                         f"{run.itl_p50_ms:6.2f} p99 {run.itl_p99_ms:6.2f} ms  TTFT p50 {run.ttft_p50_ms:7.2f} ms"
                         f"  tally {'ok' if run.tally_ok else run.tally if run.tally_ok is False else '-'}"
                         f"  {_errors(run)}")
    return runs


def _errors(run: Run) -> str:
    return " ".join(f"{k}:{v}" for k, v in run.errors.items()) or ""


def _med(runs: list[Run], attr: str) -> float:
    return median(getattr(r, attr) for r in runs)


def _added(runs: dict[str, list[Run]], key: str, base: str, attr: str) -> float:
    """Median over rounds of (run - baseline run of the same round)."""
    pairs = zip(runs.get(key, []), runs.get(base, []))
    return median(getattr(a, attr) - getattr(b, attr) for a, b in pairs)


def _per(runs: list[Run], process: str, unit: str) -> float:
    """Median CPU µs of `process` per request ("completed") or per token ("tokens_sent")."""
    return median(r.cpu_s.get(process, float("nan")) / getattr(r, unit) * 1e6
                  for r in runs if getattr(r, unit))


def _cpu_per(run: Run) -> float:
    """Gateway + Envoy CPU seconds per completed request: what a request costs the proxy tier."""
    if not run.completed:
        return 0.0
    return (run.cpu_s.get("gateway", 0.0) + run.cpu_s.get("envoy", 0.0)) / run.completed


ACCESS_LOG_PATHS = ("full", "workers", "before", "limited", "duplex")  # the paths with the access log
# (label prefix in the summary, path) of the paths through a gateway
GATEWAY_PATHS = (("routed_", "routed"), ("", "full"), ("workers_", "workers"), ("before_", "before"),
                 ("limited_", "limited"), ("duplex_", "duplex"), ("pool_", "pool"),
                 ("pool_buffered_", "pool-buffered"), ("pool_before_", "pool-before"),
                 ("pool_floor_", "pool-floor"))


def summarize(runs: dict[str, list[Run]], s: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in s.concurrencies:
        key = lambda path: f"req/{c}/{path}"  # noqa: E731
        row: dict[str, float] = {}
        for label, path in (("upstream", "direct"), ("direct", "envoy"), ("routed", "routed"),
                            ("gateway", "full"), ("workers", "workers"), ("before", "before"),
                            ("limited", "limited"), ("duplex", "duplex"), ("pool", "pool"),
                            ("pool_buffered", "pool-buffered"), ("pool_before", "pool-before"),
                            ("pool_floor", "pool-floor")):
            if key(path) in runs:
                row[f"{label}_p50_ms"] = _med(runs[key(path)], "p50_ms")
                row[f"{label}_p99_ms"] = _med(runs[key(path)], "p99_ms")
                row[f"{label}_rps"] = _med(runs[key(path)], "rps")
        for label, path in GATEWAY_PATHS:
            if key(path) in runs and key("envoy") in runs:
                row[f"{label}added_p50_ms"] = _added(runs, key(path), key("envoy"), "p50_ms")
                row[f"{label}added_p99_ms"] = _added(runs, key(path), key("envoy"), "p99_ms")
        for label, path in GATEWAY_PATHS:
            if key(path) in runs:
                row[f"{label}gateway_cpu_us_per_request"] = _per(runs[key(path)], "gateway", "completed")
                row[f"{label}envoy_cpu_us_per_request"] = _per(runs[key(path)], "envoy", "completed")
        if key("envoy") in runs:
            row["direct_envoy_cpu_us_per_request"] = _per(runs[key("envoy")], "envoy", "completed")
        for label, path, ref, ref_name, _ in BODY_MODES:  # beside a buffered path, per round
            if key(path) in runs and key(ref) in runs:
                pairs = list(zip(runs[key(path)], runs[key(ref)]))
                vs = f"{label}vs_{ref_name}"
                row[f"{vs}_p50_ratio"] = median(a.p50_ms / b.p50_ms for a, b in pairs)
                row[f"{vs}_rps_ratio"] = median(b.rps / a.rps for a, b in pairs if a.rps)
                row[f"{vs}_cpu_ratio"] = median(_cpu_per(a) / _cpu_per(b) for a, b in pairs if _cpu_per(b))
        for label, path in (("", "full"), ("workers_", "workers"), ("before_", "before"),
                            ("limited_", "limited")):  # vs Envoy alone
            if key(path) in runs and key("envoy") in runs:
                pairs = zip(runs[key(path)], runs[key("envoy")])
                row[f"{label}rps_ratio"] = median(a.rps / b.rps for a, b in pairs if b.rps)
        out[f"c{c}"] = row
    out["stream"] = _summarize_streams(runs, s)
    return out


def _summarize_streams(runs: dict[str, list[Run]], s: Settings) -> dict[str, Any]:
    levels = []
    for n in s.streams:
        full, alone = runs.get(f"stream/{n}/full", []), runs.get(f"stream/{n}/envoy", [])
        lua, routed = runs.get(f"stream/{n}/tally", []), runs.get(f"stream/{n}/routed", [])
        before = runs.get(f"stream/{n}/before", [])
        if not full and not alone:
            continue
        level: dict[str, Any] = {"streams": n}
        for label, rs in (("direct", alone), ("gateway", full), ("lua", lua), ("routed", routed),
                          ("before", before)):
            if rs:
                level |= {f"{label}_tokens_per_s": _med(rs, "tokens_per_s"),
                          f"{label}_itl_p50_ms": _med(rs, "itl_p50_ms"),
                          f"{label}_itl_p99_ms": _med(rs, "itl_p99_ms"),
                          f"{label}_ttft_p50_ms": _med(rs, "ttft_p50_ms"),
                          f"{label}_ttft_p99_ms": _med(rs, "ttft_p99_ms"),
                          f"{label}_envoy_cpu_us_per_token": _per(rs, "envoy", "tokens_sent"),
                          f"{label}_errors": sum(sum(r.errors.values()) for r in rs)}
        if full and alone:
            level["added_itl_p50_ms"] = _added(runs, f"stream/{n}/full", f"stream/{n}/envoy", "itl_p50_ms")
            level["added_itl_p99_ms"] = _added(runs, f"stream/{n}/full", f"stream/{n}/envoy", "itl_p99_ms")
            level["added_ttft_p50_ms"] = _added(runs, f"stream/{n}/full", f"stream/{n}/envoy", "ttft_p50_ms")
        for label, rs, name in (("lua_", lua, "tally"), ("routed_", routed, "routed"),
                                ("before_", before, "before")):
            if rs and alone:
                level[f"{label}added_itl_p99_ms"] = _added(runs, f"stream/{n}/{name}", f"stream/{n}/envoy",
                                                           "itl_p99_ms")
        if full:
            level["gateway_cpu_us_per_token"] = _per(full, "gateway", "tokens_sent")
            level["gateway_cpu_share"] = median(r.cpu_s.get("gateway", 0) / r.elapsed_s for r in full)
            level["envoy_cpu_share"] = median(r.cpu_s.get("envoy", 0) / r.elapsed_s for r in full)
            level["tally_ok"] = all(r.tally_ok for r in full)
            level["tally_missing"] = max(r.tokens_sent - r.tally for r in full)
            level["running_after"] = max(r.running_after for r in full)
            level["usage_leaked"] = sum(r.usage_leaked for r in full)
        if before:
            level["before_gateway_cpu_us_per_token"] = _per(before, "gateway", "tokens_sent")
            level["before_tally_ok"] = all(r.tally_ok for r in before)
        everything = full + alone + lua + routed + before
        level["upstream_late_max_ms"] = max(r.upstream_late_max_ms for r in everything)
        level["upstream_cpu_us_per_token"] = _per(everything, "upstream", "tokens_sent")
        level["client_cpu_us_per_token"] = _per(everything, "client", "tokens_sent")
        levels.append(level)
    passing = [lv for lv in levels if lv.get("tally_ok") and lv.get("added_itl_p99_ms", 1e9) <= ITL_BUDGET_MS
               and not lv.get("gateway_errors")]
    best = max(passing, key=lambda lv: lv["gateway_tokens_per_s"]) if passing else None
    shown = best or (levels[-1] if levels else {})
    return {
        "max_chunks_per_s": best["gateway_tokens_per_s"] if best else 0.0,
        "max_chunks_streams": best["streams"] if best else 0,
        "added_itl_p50_ms": shown.get("added_itl_p50_ms", float("nan")),
        "added_itl_p99_ms": shown.get("added_itl_p99_ms", float("nan")),
        "gateway_cpu_us_per_token": shown.get("gateway_cpu_us_per_token", float("nan")),
        "envoy_cpu_us_per_token": shown.get("gateway_envoy_cpu_us_per_token", float("nan")),
        "direct_envoy_cpu_us_per_token": shown.get("direct_envoy_cpu_us_per_token", float("nan")),
        "levels": levels,
    }


def raw(runs: dict[str, list[Run]]) -> dict[str, list[dict[str, Any]]]:
    return {k: [asdict(r) for r in v] for k, v in runs.items()}
