"""`python -m extproc.sim.validate`: simulated figures next to reference ones that are not measurements
of one row each, in virtual time: a published GPU-to-GPU ratio (Lambda's "H100 ~2x A100") and AIBrix's
simulator output (a consistency check, not truth), plus the per-GPU preset table.

Published measurements with a workload to replay live in data/calibration/ and are checked by
`extproc engine-sim calibrate` (calibration.py), which also holds the fit/held-out split.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from extproc.sim.replica import build_engine
from extproc.sim.virtual import LoadResult, run_closed_loop, run_open_loop

SRC_LAMBDA = "[2]"
SRC_AIBRIX = "[4]"
SOURCES = {
    "[2]": "LambdaLabsML/vllm-benchmark, benchmark_v0.md: vLLM 0.6, H100 SXM ~2x A100 SXM 80GB throughput, "
    "Llama/Mistral 7B-405B (measured)",
    "[4]": "AIBrix simulator benchmark lines, llama2-7b on A100 and A40 (shared/data/aibrix/*.jsonl): "
    "another simulator's output, not a measurement; same workload replayed here (Poisson, 100 requests)",
}


@dataclass(frozen=True, slots=True)
class Row:
    source: str
    setup: str
    metric: str
    published: float
    simulated: float

    @property
    def error(self) -> float:
        return (self.simulated - self.published) / self.published


def closed(gpu: str, model: str, c: int, inp: int, out: int, n: int | None = None) -> LoadResult:
    return run_closed_loop(build_engine(gpu, model), c, inp, out, n or max(4 * c, 16))


def lambda_rows() -> list[Row]:
    rows = []
    for c in (1, 64):
        h = closed("H100", "llama3-8b", c, 1024, 128, 8 * c)
        a = closed("A100-80GB", "llama3-8b", c, 1024, 128, 8 * c)
        rows.append(
            Row(
                SRC_LAMBDA,
                f"llama3-8b 1024/128, C={c}",
                "H100 / A100-80GB throughput",
                2.0,
                h.output_throughput / a.output_throughput,
            )
        )
    return rows


# The few reference figures used here, from AIBrix's simulator benchmark files for llama2-7b
# (vllm-project/aibrix, python/aibrix/aibrix/gpu_optimizer/optimizer/profiling/result/
# simulator-llama2-7b-{a100,a40}.jsonl, Apache-2.0): mean of each metric at (input, output, rate).
AIBRIX_REFERENCE: dict[str, dict[tuple[int, int, float, str], float]] = {
    "a100": {(128, 128, 1.0, "E2E"): 1.3211867283086758, (128, 512, 64.0, "TT"): 3616.1957579469636,
             (1024, 128, 64.0, "TT"): 946.6127889763542},
    "a40": {(128, 128, 1.0, "E2E"): 3.3508307762310143, (128, 512, 64.0, "TT"): 1375.4651748677388,
            (1024, 128, 64.0, "TT"): 393.27055549815645},
}


def aibrix_rows() -> list[Row]:
    rows: list[Row] = []
    for gpu, tag in (("A100-80GB", "a100"), ("A40", "a40")):
        ref = AIBRIX_REFERENCE[tag]
        for inp, out, rate, metric in (
            (128, 128, 1.0, "E2E"),
            (128, 512, 64.0, "TT"),
            (1024, 128, 64.0, "TT"),
        ):
            r = run_open_loop(build_engine(gpu, "llama2-7b"), rate, inp, out, 100, seed=0)
            sim = r.mean_e2e if metric == "E2E" else r.output_throughput
            label = "mean E2E s" if metric == "E2E" else "output tok/s"
            rows.append(
                Row(
                    SRC_AIBRIX,
                    f"{gpu} {inp}/{out}, {rate:g} req/s x100",
                    label,
                    ref[(inp, out, rate, metric)],
                    sim,
                )
            )
    return rows


SUITES: dict[str, Callable[[], list[Row]]] = {
    "lambda": lambda_rows,
    "aibrix": aibrix_rows,
}


def single_stream_table(gpus: list[str], model: str) -> list[tuple[str, float, float]]:
    """Per-GPU single-request decode tok/s and saturated throughput (C=256, 512/256) for a model."""
    out = []
    for gpu in gpus:
        try:
            one = closed(gpu, model, 1, 512, 256, 4)
            sat = closed(gpu, model, 256, 512, 256, 768)
        except ValueError:
            continue  # the model does not fit on this GPU
        out.append((gpu, one.mean_decode_rate, sat.output_throughput))
    return out


def _num(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def render(rows: list[Row]) -> str:
    lines = ["| ref | setup | metric | published | simulated | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.source} | {r.setup} | {r.metric} | {_num(r.published)} | {_num(r.simulated)} | "
            f"{r.error * 100:+.0f} % |"
        )
    lines.append("")
    lines.extend(f"{key} {text}" for key, text in SOURCES.items() if any(r.source == key for r in rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--suite", action="append", choices=sorted(SUITES), help="default: all")
    parser.add_argument("--presets", action="store_true", help="also print per-GPU decode/saturation figures")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    for name in args.suite or SUITES:
        rows.extend(SUITES[name]())
    print(render(rows))
    if args.presets:
        from extproc.sim.gpus import GPUS

        print("\n| GPU | llama3-8b single-request decode tok/s | saturated output tok/s (C=256, 512/256) |")
        print("|---|---|---|")
        for gpu, single, sat in single_stream_table(list(GPUS), "llama3-8b"):
            print(f"| {gpu} | {single:.1f} | {sat:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
