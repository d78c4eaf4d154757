"""`gen-profile --plot`: heatmaps of throughput at SLO and of E2E per (output, input) cell."""

from __future__ import annotations

from pathlib import Path

from extproc.extras import pyplot
from extproc.profiling.selection import Grid


def plot_grid(grid: Grid, path: str | Path, title: str) -> None:
    plt = pyplot()

    panels = [("throughput at SLO, requests/s (hatched: no rate meets it)", grid.tputs, "viridis"),
              ("E2E mean at the chosen rate, s", grid.e2e, "magma_r")]
    width = max(8.0, 1.1 * len(grid.inputs) * len(panels) + 3)
    height = max(4.0, 0.55 * len(grid.outputs) + 2)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, height), squeeze=False)
    for ax, (name, values, cmap) in zip(axes[0], panels):
        image = ax.imshow(values, cmap=cmap, aspect="auto", origin="lower")
        ax.set_title(name)
        ax.set_xlabel("input tokens")
        ax.set_ylabel("output tokens")
        ax.set_xticks(range(len(grid.inputs)), [str(i) for i in grid.inputs])
        ax.set_yticks(range(len(grid.outputs)), [str(o) for o in grid.outputs])
        top = max((v for row in values for v in row), default=0.0) or 1.0
        for y, row in enumerate(values):
            for x, value in enumerate(row):
                dark = (value / top > 0.5) == (cmap == "magma_r")
                ax.text(x, y, f"{value:.3g}", ha="center", va="center", fontsize=8,
                        color="white" if dark else "black")
        fig.colorbar(image, ax=ax, shrink=0.85)
    # Cells where no rate met the SLO: marked, so a 0 is read as "never meets it", not as missing data.
    for y, row in enumerate(grid.rates):
        for x, rate in enumerate(row):
            if rate is None:
                axes[0][0].add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch="//",
                                                   edgecolor="red", linewidth=0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
