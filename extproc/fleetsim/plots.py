"""PNG plots: utilization over time per GPU type (the spec's figure), one panel per strategy, and the
QPS each type received beneath it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display; safe in CI and worker processes
    import matplotlib.pyplot as plt

    strategies = list(report["strategies"])
    fig, axes = plt.subplots(2, len(strategies), figsize=(4.2 * len(strategies), 6.0), squeeze=False,
                             sharex=True, sharey="row")
    warmup = report["warmup_s"]
    for col, name in enumerate(strategies):
        series = report["strategies"][name]["series"]
        step = series["bucket_s"]
        for gpu, util in series["utilization"].items():
            t = [step * (i + 0.5) for i in range(len(util))]
            axes[0][col].plot(t, [u * 100 for u in util], label=gpu, linewidth=1.2)
            axes[1][col].plot(t, series["qps"][gpu], label=gpu, linewidth=1.2)
        axes[0][col].set_title(name)
        for row in (0, 1):
            axes[row][col].axvspan(0, warmup, color="0.9", zorder=0)
            axes[row][col].grid(alpha=0.3)
        axes[1][col].set_xlabel("time (s)")
    axes[0][0].set_ylabel("utilization % of saturated tok/s")
    axes[1][0].set_ylabel("QPS routed")
    axes[0][-1].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"{report['scenario']}: {report['gateways']} gateway(s), shaded = warm-up (not measured)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
