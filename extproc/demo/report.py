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

from extproc.demo.load import Outcome


@dataclass(slots=True)
class PodResult:
    gpu: str
    qps: float
    output_tokens_per_s: float
    utilization: float
    p99_latency_s: float | None
    p99_is_lower_bound: bool = False  # some requests were cut off before they finished


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

    def as_json(self) -> dict:
        return {"header": self.header, "requests": self.requests, "failed": self.failed,
                "unfinished": self.unfinished, "p99_latency_s": self.p99_latency_s,
                "p99_is_lower_bound": self.p99_is_lower_bound,
                "pods": {name: {"gpu": p.gpu, "qps": p.qps, "output_tokens_per_s": p.output_tokens_per_s,
                                "utilization": p.utilization, "p99_latency_s": p.p99_latency_s,
                                "p99_is_lower_bound": p.p99_is_lower_bound}
                         for name, p in self.pods.items()}}


def p99(values: Sequence[float]) -> float | None:
    """Nearest-rank 99th percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


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


def table(results: Sequence[PhaseResult]) -> str:
    """One block per strategy, then utilization and p99 side by side (the spec's before/after)."""
    lines = []
    for r in results:
        lines.append(f"{r.strategy}  (routing-strategy: {r.header}; {r.requests} requests measured, "
                     f"{r.failed} failed, {r.unfinished} cut off, p99 "
                     f"{_seconds(r.p99_latency_s, r.p99_is_lower_bound)} s)")
        lines.append(f"  {'pod':8} {'GPU':10} {'QPS':>6} {'out tok/s':>10} {'util':>6} {'p99 s':>7}")
        for name, p in r.pods.items():
            lines.append(f"  {name:8} {p.gpu:10} {p.qps:6.1f} {p.output_tokens_per_s:10.0f} "
                         f"{p.utilization:6.0%} {_seconds(p.p99_latency_s, p.p99_is_lower_bound):>7}")
        lines.append("")
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
    return "\n".join(lines)


def write_json(results: Sequence[PhaseResult], path: Path, extra: dict) -> None:
    path.write_text(json.dumps({**extra, "strategies": {r.strategy: r.as_json() for r in results}}, indent=2))


def write_png(results: Sequence[PhaseResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results[0].pods)
    fig, (util_ax, lat_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(names))]
        util_ax.bar(xs, [100 * r.pods[n].utilization for n in names], width, label=r.strategy)
        lat_ax.bar(xs, [r.pods[n].p99_latency_s or 0.0 for n in names], width, label=r.strategy)
    labels = [f"{n}\n{results[0].pods[n].gpu}" for n in names]
    for ax, what in ((util_ax, "utilization %"), (lat_ax, "p99 latency (s)")):
        ax.set_xticks(range(len(names)), labels)
        ax.set_ylabel(what)
        ax.grid(axis="y", alpha=0.3)
    util_ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
    lat_ax.legend(loc="upper right")  # the fast pod's latency bars are short: room there
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
