"""The demo's results: per strategy and pod, QPS, output tokens/s, utilization and p99 latency, printed as
the spec's before/after table, written as JSON and drawn as a PNG.

Utilization is a pod's generated output tokens/s during the measured window (from the engine's own
`vllm:generation_tokens_total`) divided by what the same GPU type produces when kept full with the
demo's request mix (extproc.fleetsim.saturation). 100 % means the pod cannot go faster: past it,
requests queue inside the engine and their latency grows without bound.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from extproc.demo.open_loop import Outcome
from extproc.extras import pyplot


@dataclass(slots=True)
class PodResult:
    gpu: str
    qps: float
    output_tokens_per_s: float
    utilization: float
    p99_latency_s: float | None
    p99_is_lower_bound: bool = False  # some requests were cut off before they finished
    # --burst phases: the gateway's extproc_pod_capacity_tokens_per_second when the burst began and when
    # its window ended, and its observed gauge then (equal to the capacity under `capacity: observed`)
    capacity_start: float | None = None
    capacity_end: float | None = None
    observed_end: float | None = None
    peak_waiting: int | None = None  # --burst phases: the deepest engine queue (vllm:num_requests_waiting)

    def as_json(self) -> dict:
        out = {"gpu": self.gpu, "qps": self.qps, "output_tokens_per_s": self.output_tokens_per_s,
               "utilization": self.utilization, "p99_latency_s": self.p99_latency_s,
               "p99_is_lower_bound": self.p99_is_lower_bound}
        if self.capacity_end is not None:
            out["capacity_tokens_per_s"] = {"start": self.capacity_start, "end": self.capacity_end}
            out["observed_tokens_per_s_end"] = self.observed_end
        if self.peak_waiting is not None:
            out["peak_waiting"] = self.peak_waiting
        return out


@dataclass(slots=True)
class PhaseResult:
    strategy: str
    header: str                    # the routing-strategy header sent
    pods: dict[str, PodResult] = field(default_factory=dict)
    requests: int = 0              # measured (arrived in the window)
    failed: int = 0                # answered with an error or not at all
    unfinished: int = 0            # still running when the drain time ran out
    p99_latency_s: float | None = None
    p99_is_lower_bound: bool = False
    capacity_mode: str | None = None  # --burst phases: routing.load_balance.capacity in effect
    rate_rps: float | None = None     # --burst phases: the measured window's arrival rate
    # --burst phases: time to first token, p99 over the pool, from the engines' own histograms between
    # the burst's start and the end of its drain (the requests are not streamed: the client cannot time it)
    ttft_p99_s: float | None = None

    @property
    def burst(self) -> bool:
        return self.capacity_mode is not None

    def as_json(self) -> dict:
        out = {"header": self.header, "requests": self.requests, "failed": self.failed,
               "unfinished": self.unfinished, "p99_latency_s": self.p99_latency_s,
               "p99_is_lower_bound": self.p99_is_lower_bound,
               "pods": {name: p.as_json() for name, p in self.pods.items()}}
        if self.burst:
            out.update(capacity_mode=self.capacity_mode, rate_rps=self.rate_rps, ttft_p99_s=self.ttft_p99_s)
        return out


def p99(values: Sequence[float]) -> float | None:
    """Nearest-rank 99th percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def quantile_from_buckets(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a histogram given as cumulative (upper bound, count) buckets in ascending order,
    interpolated linearly inside its bucket as Prometheus' histogram_quantile does. None: no count."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: that bound is all we know
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def summarise(strategy: str, header: str, measured: Sequence[Outcome], pods: Sequence[tuple[str, str]],
              generated: dict[str, float], saturated: dict[str, float], seconds: float) -> PhaseResult:
    """`measured`: the outcomes of requests sent in the window; `generated`: output tokens each engine
    produced in it."""
    result = PhaseResult(strategy, header, requests=len(measured))
    ok = [o for o in measured if o.status == 200]
    cut = [o for o in measured if o.unfinished]
    result.unfinished = len(cut)
    result.failed = len(measured) - len(ok) - len(cut)
    timed = ok + cut  # a cut-off request's latency so far is a lower bound of its own
    result.p99_latency_s, result.p99_is_lower_bound = p99([o.latency_s for o in timed]), bool(cut)  # type: ignore[misc]
    for name, gpu in pods:
        # A cut-off request's pod is unknown (the header comes with the reply): with any cut off,
        # every pod's p99 is only a lower bound.
        mine = [o for o in ok if o.pod == name]
        tokens_per_s = generated.get(name, 0.0) / seconds
        result.pods[name] = PodResult(
            gpu=gpu, qps=sum(o.pod == name for o in measured) / seconds, output_tokens_per_s=tokens_per_s,
            utilization=tokens_per_s / saturated[gpu], p99_latency_s=p99([o.latency_s for o in mine]),  # type: ignore[misc]
            p99_is_lower_bound=bool(cut))
    return result


def _seconds(value: float | None, lower_bound: bool = False) -> str:
    return "-" if value is None else (">" if lower_bound else "") + f"{value:.1f}"


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def _block(r: PhaseResult) -> list[str]:
    """One phase's per-pod rows; a burst phase adds the capacity the gateway reported."""
    rate = (f"burst {r.rate_rps:.1f} req/s, capacity: {r.capacity_mode}, TTFT p99 "
            f"{_ms(r.ttft_p99_s)} ms; " if r.burst else "")
    lines = [f"{r.strategy}  (routing-strategy: {r.header}; {rate}{r.requests} requests measured, "
             f"{r.failed} failed, {r.unfinished} cut off, p99 "
             f"{_seconds(r.p99_latency_s, r.p99_is_lower_bound)} s)"]
    cap_head = f" {'cap start':>10} {'cap end':>8} {'peak queue':>10}" if r.burst else ""
    lines.append(f"  {'pod':8} {'GPU':10} {'QPS':>6} {'out tok/s':>10} {'util':>6} {'p99 s':>7}{cap_head}")
    for name, p in r.pods.items():
        cap = (f" {_tokens(p.capacity_start):>10} {_tokens(p.capacity_end):>8} {_tokens(p.peak_waiting):>10}"
               if r.burst else "")
        lines.append(f"  {name:8} {p.gpu:10} {p.qps:6.1f} {p.output_tokens_per_s:10.0f} "
                     f"{p.utilization:6.0%} {_seconds(p.p99_latency_s, p.p99_is_lower_bound):>7}{cap}")
    return lines + [""]


def _capacities(results: Sequence[PhaseResult], names: list[str], width: int,
                saturated: dict[str, float] | None) -> list[str]:
    """The burst phases' reported capacity at the end of the burst, against the saturated figures."""
    bursts = [r for r in results if r.burst]
    if not bursts:
        return []
    lines = [f"{'capacity tok/s':{width}} " + " ".join(f"{n:>8}" for n in names) + "   (end of burst)"]
    if saturated:
        gpus = [results[0].pods[n].gpu for n in names]
        lines.append(f"{'saturated':{width}} " + " ".join(f"{saturated[g]:8.0f}" for g in gpus))
    for r in bursts:
        caps = (_tokens(r.pods[n].capacity_end) for n in names)
        lines.append(f"{r.strategy:{width}} " + " ".join(f"{c:>8}" for c in caps))
    lines.append(f"{'burst: queue':{width}} " + " ".join(f"{n:>8}" for n in names) + "  TTFT p99 ms")
    for r in bursts:
        peaks = (_tokens(r.pods[n].peak_waiting) for n in names)
        lines.append(f"{r.strategy:{width}} " + " ".join(f"{c:>8}" for c in peaks)
                     + f" {_ms(r.ttft_p99_s):>12}")
    return lines


def table(results: Sequence[PhaseResult], saturated: dict[str, float] | None = None) -> str:
    """One block per strategy, then utilization and p99 side by side (the spec's before/after), then
    with --burst the capacity each burst phase ended on."""
    lines = [line for r in results for line in _block(r)]
    names = list(results[0].pods) if results else []
    width = max([len(r.strategy) for r in results] + [12])
    lines.append(f"{'utilization':{width}} " + " ".join(f"{n:>8}" for n in names) + "   spread")
    for r in results:
        utils = [r.pods[n].utilization for n in names]
        lines.append(f"{r.strategy:{width}} " + " ".join(f"{u:8.0%}" for u in utils)
                     + f"   {max(utils) - min(utils):5.0%}")
    lines.append(f"{'p99 latency s':{width}} " + " ".join(f"{n:>8}" for n in names) + "      all")
    for r in results:
        pods_p99 = (_seconds(r.pods[n].p99_latency_s, r.pods[n].p99_is_lower_bound) for n in names)
        lines.append(f"{r.strategy:{width}} " + " ".join(f"{v:>8}" for v in pods_p99)
                     + f" {_seconds(r.p99_latency_s, r.p99_is_lower_bound):>8}")
    return "\n".join(lines + _capacities(results, names, width, saturated))


def write_json(results: Sequence[PhaseResult], path: Path, extra: dict) -> None:
    path.write_text(json.dumps({**extra, "strategies": {r.strategy: r.as_json() for r in results}}, indent=2))


def write_png(results: Sequence[PhaseResult], path: Path, title: str,
              saturated: dict[str, float] | None = None) -> None:
    """Utilization and p99 per pod and phase; with --burst a third panel: the capacity each burst phase
    ended on, against the saturated figure (a black tick per pod)."""
    plt = pyplot()

    names = list(results[0].pods)
    bursts = [i for i, r in enumerate(results) if r.burst]
    fig, axes = plt.subplots(1, 3 if bursts else 2, figsize=(16 if bursts else 11, 4.6 if bursts else 4.2))
    util_ax, lat_ax = axes[0], axes[1]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(names))]
        color = colors[i % len(colors)]
        util_ax.bar(xs, [100 * r.pods[n].utilization for n in names], width, label=r.strategy, color=color)
        lat_ax.bar(xs, [r.pods[n].p99_latency_s or 0.0 for n in names], width, label=r.strategy, color=color)
    labels = [f"{n}\n{results[0].pods[n].gpu}" for n in names]
    panels = [(util_ax, "utilization %"), (lat_ax, "p99 latency (s)")]
    if bursts:
        cap_ax = axes[2]
        _capacity_panel(cap_ax, [results[i] for i in bursts], [colors[i % len(colors)] for i in bursts],
                        names, saturated)
        panels.append((cap_ax, "capacity reported, end of burst (tok/s)"))
    for ax, what in panels:
        ax.set_xticks(range(len(names)), labels)
        ax.set_ylabel(what)
        ax.grid(axis="y", alpha=0.3)
    util_ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
    # the fast pod's latency bars are short: room there; with five phases the legend goes below
    if bursts:
        fig.legend(*lat_ax.get_legend_handles_labels(), loc="lower center", ncol=len(results), fontsize=9)
    else:
        lat_ax.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08 if bursts else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _capacity_panel(ax, bursts: Sequence[PhaseResult], colors: Sequence[str], names: list[str],
                    saturated: dict[str, float] | None) -> None:
    width = 0.8 / len(bursts)
    for i, (r, color) in enumerate(zip(bursts, colors)):
        xs = [j + (i - (len(bursts) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [r.pods[n].capacity_end or 0.0 for n in names], width, color=color)
    if saturated:
        gpus = [bursts[0].pods[n].gpu for n in names]
        ax.hlines([saturated[g] for g in gpus], [j - 0.45 for j in range(len(names))],
                  [j + 0.45 for j in range(len(names))], color="black", linewidth=1.2, label="saturated")
        ax.legend(loc="upper left", fontsize=9)
