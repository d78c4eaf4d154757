"""PNG plots, one column per strategy, over time: utilization and QPS per GPU type (the spec's capacity
figure), P99 TPOT per GPU type against the SLO, and the gateway's SLO queue with its rejections (the
spec's SLO-routing comparison); with --optimizer, replicas per deployment and the GPU cost per hour."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from extproc.extras import pyplot

ROWS = (("utilization", "utilization % of\nsaturated tok/s"), ("qps", "QPS routed"),
        ("tpot_p99_s", "P99 TPOT (ms)\nby arrival"), ("queue", "SLO queue (peak)"),
        ("rejected_per_s", "rejected / s"))
AUTOSCALE_ROWS = (("replicas", "replicas (optimizer)\nserving + starting"), ("cost", "GPU cost / h"))


def plot(report: dict[str, Any], path: str | Path) -> None:
    plt = pyplot()

    strategies = list(report["strategies"])
    autoscaled = any(s.get("autoscale") for s in report["strategies"].values())
    rows = ROWS + (AUTOSCALE_ROWS if autoscaled else ())
    fig, axes = plt.subplots(len(rows), len(strategies), figsize=(4.2 * len(strategies), 2.2 * len(rows)),
                             squeeze=False, sharex=True, sharey="row")
    warmup = report["warmup_s"]
    deployments = [g["deployment"] for g in sorted(report["fleet"], key=lambda g: g["gpu"])]
    tpot_slo = (report.get("slo") or {}).get("tpot_s")
    for col, name in enumerate(strategies):
        series = report["strategies"][name]["series"]
        step = series["bucket_s"]

        def times(values: list[Any]) -> list[float]:
            return [step * (i + 0.5) for i in range(len(values))]

        for gpu, util in series["utilization"].items():
            axes[0][col].plot(times(util), [u * 100 for u in util], label=gpu, linewidth=1.2)
            axes[1][col].plot(times(util), series["qps"][gpu], label=gpu, linewidth=1.2)
            tpot = series.get("tpot_p99_s", {}).get(gpu, [])
            axes[2][col].plot(times(tpot), [v * 1000 if v is not None else float("nan") for v in tpot],
                              label=gpu, linewidth=1.2)
        for row, key in ((3, "queue"), (4, "rejected_per_s")):
            values = series.get(key, [])
            axes[row][col].plot(times(values), values, color="0.3", linewidth=1.2)
        auto = report["strategies"][name].get("autoscale")
        if auto:
            a = auto["series"]
            for dep, counts in a["replicas"].items():
                color = f"C{deployments.index(dep)}" if dep in deployments else None  # same as its GPU's
                axes[5][col].step(a["t"], counts, where="post", label=dep, color=color, linewidth=1.2)
            axes[6][col].step(a["t"], a["cost_per_hour"], where="post", color="0.3", linewidth=1.2)
            axes[5][col].legend(loc="upper left", fontsize=8)
        if tpot_slo:
            axes[2][col].axhline(tpot_slo * 1000, color="red", linestyle="--", linewidth=0.8, label="SLO")
        axes[0][col].set_title(name)
        for row in range(len(rows)):
            axes[row][col].axvspan(0, warmup, color="0.9", zorder=0)
            axes[row][col].grid(alpha=0.3)
        axes[-1][col].set_xlabel("time (s)")
    for row, (_, label) in enumerate(rows):
        axes[row][0].set_ylabel(label)
    axes[0][-1].legend(loc="upper right", fontsize=8)
    axes[2][-1].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"{report['scenario']}: {report['gateways']} gateway(s), shaded = warm-up (not measured)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
