"""Fit the step-time model's efficiencies and overheads to the fit split of the calibration set.

Two stages, each a bounded Powell search (scipy) on the mean weighted |log(model / published)| of the
rows it covers (|log| rather than squares: one odd published figure must not drag the fit; TTFT rows
weigh half, they also carry the API server's latency the model only approximates):

1. the per-step and per-sequence overheads, the frontend latency and each GPU class's three
   efficiencies, on every fit row at once (the class values are what a GPU without measurements gets);
2. each GPU with fit rows: its own three efficiencies, overheads fixed, pulled gently toward its
   class's values (a prior of 0.1 x |log ratio|) so a GPU with three rows cannot wander off.

Only rows whose run is on the fit side of the split are read (`calibration.Workload.split`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.sim.calibration import Frontend, Measurement, Result, simulate
from extproc.sim.efficiency import BOUNDS, Efficiency, gpu_class
from extproc.sim.perf import PerfParams

OVERHEAD_BOUNDS = {
    "step_overhead_s": (0.0001, 0.005),
    # The L4 sweep's time per token grows 2 ms from 1 to 32 sequences of a 0.5B model (sampling and
    # bookkeeping do not depend on model size): at most ~60 µs per sequence.
    "per_seq_overhead_s": (0.0, 0.00005),
    "frontend_latency_s": (0.0, 0.05),
    "frontend_per_stream_s": (0.0, 0.01),
}
FIGURE_WEIGHT = {"ttft": 0.5}
PRIOR = 0.1
# Where the search starts: fixed here, not read from the committed values, so the command prints the
# same numbers every time it runs (Powell finds a local optimum near its start).
START_OVERHEADS = {"step_overhead_s": 0.0008, "per_seq_overhead_s": 0.00005, "frontend_latency_s": 0.010,
                   "frontend_per_stream_s": 0.0}
START_CLASS = {"hbm": Efficiency(0.85, 0.60, 0.60), "gddr": Efficiency(0.80, 0.60, 0.55)}


@dataclass(slots=True)
class Fitted:
    step_overhead_s: float
    per_seq_overhead_s: float
    frontend: Frontend
    classes: dict[str, Efficiency]
    gpus: dict[str, Efficiency] = field(default_factory=dict)

    def params_for(self, gpu: str) -> PerfParams:
        eff = self.gpus.get(gpu) or self.classes[gpu_class(gpu)]
        return PerfParams(mem_efficiency=eff.weights, kv_efficiency=eff.kv, compute_efficiency=eff.compute,
                          step_overhead_s=self.step_overhead_s, per_seq_overhead_s=self.per_seq_overhead_s)

    def simulate(self, rows: Sequence[Measurement]) -> list[Result]:
        return simulate(rows, self.params_for, self.frontend)


def loss(results: Sequence[Result]) -> float:
    total = weight = 0.0
    for r in results:
        w = FIGURE_WEIGHT.get(r.measurement.figure, 1.0)
        ratio = r.simulated / r.measurement.value
        total += w * (abs(math.log(ratio)) if ratio > 0 and math.isfinite(ratio) else 10.0)
        weight += w
    return total / weight if weight else 0.0


def _minimize(objective: Callable[[list[float]], float], start: list[float],
              bounds: list[tuple[float, float]], max_evals: int) -> list[float]:
    from scipy.optimize import minimize

    result = minimize(lambda x: objective(list(x)), start, method="Powell", bounds=bounds,
                      options={"maxfev": max_evals, "xtol": 1e-3, "ftol": 1e-4})
    return [min(max(v, lo), hi) for v, (lo, hi) in zip(result.x, bounds, strict=True)]


_EFF = ("weights", "kv", "compute")


def fit(rows: Sequence[Measurement], max_evals: int = 600) -> Fitted:
    rows = [m for m in rows if m.split == "fit" and not m.exclude_reason]
    classes = sorted({gpu_class(m.workload.gpu) for m in rows})
    names = list(OVERHEAD_BOUNDS) + [f"{c}.{e}" for c in classes for e in _EFF]
    bounds = list(OVERHEAD_BOUNDS.values()) + [BOUNDS[e] for _ in classes for e in _EFF]
    start = list(START_OVERHEADS.values()) + [getattr(START_CLASS[c], e) for c in classes for e in _EFF]

    def unpack(x: list[float]) -> Fitted:
        values = dict(zip(names, x, strict=True))
        cls = {c: Efficiency(*(values[f"{c}.{e}"] for e in _EFF)) for c in classes}
        for c, eff in START_CLASS.items():
            cls.setdefault(c, eff)
        frontend = Frontend(values["frontend_latency_s"], values["frontend_per_stream_s"])
        return Fitted(values["step_overhead_s"], values["per_seq_overhead_s"], frontend, cls)

    best = unpack(_minimize(lambda x: loss(unpack(x).simulate(rows)), start, bounds, max_evals))

    for gpu in sorted({m.workload.gpu for m in rows}):
        own = [m for m in rows if m.workload.gpu == gpu]
        prior = best.classes[gpu_class(gpu)]

        def objective(x: list[float], gpu: str = gpu, own: list[Measurement] = own,
                      prior: Efficiency = prior) -> float:
            trial = Fitted(best.step_overhead_s, best.per_seq_overhead_s, best.frontend, best.classes,
                           {gpu: Efficiency(*x)})
            pull = sum(abs(math.log(v / getattr(prior, e))) for v, e in zip(x, _EFF, strict=True))
            return loss(trial.simulate(own)) + PRIOR * pull

        x = _minimize(objective, [getattr(prior, e) for e in _EFF], [BOUNDS[e] for e in _EFF], max_evals // 3)
        best.gpus[gpu] = Efficiency(*x)
    return best


def render(f: Fitted) -> str:
    """The fitted values as the lines to commit (efficiency.py, perf.PerfParams, calibration.py)."""
    def eff(e: Efficiency) -> str:
        return f"Efficiency(weights={e.weights:.3f}, kv={e.kv:.3f}, compute={e.compute:.3f})"

    lines = ["# extproc/sim/efficiency.py", "CLASS_EFFICIENCY = {"]
    lines += [f'    "{c}": {eff(e)},' for c, e in sorted(f.classes.items())]
    lines += ["}", "FITTED = {"]
    lines += [f'    "{g}": {eff(e)},' for g, e in sorted(f.gpus.items())]
    lines += ["}", "# extproc/sim/perf.py PerfParams", f"step_overhead_s = {f.step_overhead_s:.6f}",
              f"per_seq_overhead_s = {f.per_seq_overhead_s:.7f}",
              "# extproc/sim/calibration.py",
              f"FRONTEND = Frontend(latency_s={f.frontend.latency_s:.4f}, "
              f"per_stream_s={f.frontend.per_stream_s:.5f})"]
    return "\n".join(lines)
