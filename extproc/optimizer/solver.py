"""The plan: the cheapest integer replica count per GPU type that serves every cell's rate within its SLO.

    minimise   Σ_g cost_g · n_g
    subject to Σ_g s_cg = 1                       for every cell c   (each cell's rate is fully served)
               Σ_c r_c · s_cg / tput_cg ≤ n_g      for every type g   (a replica's load is at most 1)
               n_g ∈ ℤ≥0,  s_cg ∈ [0, 1],  s_cg = 0 where tput_cg = 0

s_cg is the share of cell c's rate sent to type g: a continuous split, so this is the exact optimum rather
than the four-slice approximation of AIBrix's Mélange solver. One MILP, solved by HiGHS through
`scipy.optimize.milp` with a zero optimality gap.

Each workload cell is mapped onto each profile's own grid (nearest in log2 space, clamped), so profiles on
different grids work together; cells that land on the same cell of every profile are merged first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from extproc.gpu_profiles import GpuProfile


CHANGE_COST = 0.05  # of a replica's hourly cost, per replica the plan adds or removes (with `current`)


class PlanError(ValueError):
    """The workload cannot be planned (no profiles, or cells that no GPU type can serve)."""


@dataclass(frozen=True, slots=True)
class Demand:
    """Requests/s of one (input, output) shape; token counts may be fractional (trace buckets are log2)."""

    input_tokens: float
    output_tokens: float
    rps: float


@dataclass(frozen=True, slots=True)
class CellSplit:
    """One merged cell of the plan: its rate and how much of it each GPU type serves (requests/s)."""

    input_tokens: float  # the cell's representative shape (rate-weighted geometric mean of its demands)
    output_tokens: float
    rps: float
    served: dict[str, float]


@dataclass(frozen=True, slots=True)
class Plan:
    replicas: dict[str, int]  # every profiled type, including those at 0
    cost: float
    load: dict[str, float]  # replicas' worth of work sent to each type (≤ replicas)
    cells: tuple[CellSplit, ...] = ()
    solve_seconds: float = 0.0
    rps: float = 0.0
    optimal: bool = True  # False only when the solver hit its time limit with a feasible plan
    unserved: str = ""  # with skip_unservable: the cells no GPU type serves within its SLO (not planned)

    def as_json(self) -> dict[str, object]:
        return {"replicas": dict(self.replicas), "cost": self.cost, "solve_seconds": self.solve_seconds}


@dataclass(slots=True)
class _Cell:
    rps: float = 0.0
    log_in: float = 0.0  # rate-weighted sums of log2 tokens, for the representative shape
    log_out: float = 0.0
    tputs: tuple[float, ...] = field(default_factory=tuple)


def _merge(profiles: Sequence[GpuProfile], demands: Iterable[Demand]) -> list[_Cell]:
    cells: dict[tuple[tuple[int, int], ...], _Cell] = {}
    for d in demands:
        if not (d.rps > 0 and math.isfinite(d.rps)):
            continue
        sig = tuple(p.cell(d.input_tokens, d.output_tokens) for p in profiles)
        c = cells.get(sig)
        if c is None:
            c = cells[sig] = _Cell(tputs=tuple(p.served[o][i] for p, (o, i) in zip(profiles, sig)))
        c.rps += d.rps
        c.log_in += d.rps * math.log2(max(d.input_tokens, 1.0))
        c.log_out += d.rps * math.log2(max(d.output_tokens, 1.0))
    return list(cells.values())


def _shape(c: _Cell) -> tuple[float, float]:
    return 2 ** (c.log_in / c.rps), 2 ** (c.log_out / c.rps)


def solve(profiles: Sequence[GpuProfile], demands: Iterable[Demand], time_limit: float = 30.0,
          skip_unservable: bool = False, current: Mapping[str, int] | None = None) -> Plan:
    """The cost-minimal plan. Raises PlanError when there are no profiles or a cell nobody can serve;
    with `skip_unservable` (the service: one odd request shape must not stop every re-plan) such cells
    are left out of the plan and named in `Plan.unserved`. With `current` (the replicas running now),
    each replica added or removed costs CHANGE_COST of its hourly cost: of plans within that of each
    other the one closest to now wins, so near-ties between GPU types do not flip the mix every re-plan."""
    if not profiles:
        raise PlanError("no GPU profiles: nothing to plan with")
    names = [p.gpu for p in profiles]
    if len(set(names)) != len(names):
        raise PlanError(f"two profiles for the same deployment: {sorted(names)}")
    started = time.perf_counter()
    cells = _merge(profiles, demands)
    unservable = [c for c in cells if not any(t > 0 for t in c.tputs)]
    unserved = ""
    if unservable:
        shown = ", ".join(f"input≈{i:.0f} output≈{o:.0f} tokens at {c.rps:.3g} req/s"
                          for c in unservable for i, o in [_shape(c)])
        if not skip_unservable or len(unservable) == len(cells):  # nothing to plan is no plan, not 0
            raise PlanError(f"no GPU type can serve these cells within its SLO: {shown}")
        unserved = f"not planned, no GPU type serves them within its SLO: {shown}"
        cells = [c for c in cells if any(t > 0 for t in c.tputs)]
    if not cells:
        return Plan({n: 0 for n in names}, 0.0, {n: 0.0 for n in names},
                    solve_seconds=time.perf_counter() - started, unserved=unserved)

    G = len(profiles)
    pairs = [(c, g) for c, cell in enumerate(cells) for g in range(G) if cell.tputs[g] > 0]
    P = len(pairs)  # variables: n_0..n_{G-1}, one share per servable (cell, type) pair, then G changes
    D = G if current is not None else 0
    cost = np.zeros(G + P + D)
    cost[:G] = [p.cost for p in profiles]
    if D:
        unit = math.fsum(p.cost for p in profiles) / G or 1.0  # zero-cost types still resist churn
        cost[G + P:] = [CHANGE_COST * (p.cost or unit) for p in profiles]

    rows, cols, vals = [], [], []
    for k, (c, g) in enumerate(pairs):
        rows.append(c)  # Σ_g s_cg = 1
        cols.append(G + k)
        vals.append(1.0)
        rows.append(len(cells) + g)  # Σ_c r_c s_cg / t_cg − n_g ≤ 0
        cols.append(G + k)
        vals.append(cells[c].rps / cells[c].tputs[g])
    for g in range(G):
        rows.append(len(cells) + g)
        cols.append(g)
        vals.append(-1.0)
    now = [float((current or {}).get(n, 0)) for n in names]
    base = len(cells) + G
    for g in range(D):  # |n_g - now_g| <= d_g as two rows: n_g - d_g <= now_g, -n_g - d_g <= -now_g
        rows += [base + 2 * g, base + 2 * g, base + 2 * g + 1, base + 2 * g + 1]
        cols += [g, G + P + g, g, G + P + g]
        vals += [1.0, -1.0, -1.0, -1.0]
    A = coo_array((vals, (rows, cols)), shape=(base + 2 * D, G + P + D)).tocsr()
    lower = np.concatenate([np.ones(len(cells)), np.full(G + 2 * D, -np.inf)])
    upper = np.concatenate([np.ones(len(cells)), np.zeros(G),
                            np.ravel([[now[g], -now[g]] for g in range(D)]) if D else np.zeros(0)])

    # n_g never needs to exceed the replicas g would need to serve alone everything it can serve
    n_max = np.zeros(G)
    for c, g in pairs:
        n_max[g] += cells[c].rps / cells[c].tputs[g]
    ub = np.concatenate([np.ceil(n_max + 1e-9), np.ones(P), np.full(D, np.inf)])
    integrality = np.concatenate([np.ones(G), np.zeros(P + D)])
    res = milp(cost, constraints=LinearConstraint(A, lower, upper), integrality=integrality,
               bounds=Bounds(np.zeros(G + P + D), ub),
               options={"mip_rel_gap": 0.0, "time_limit": time_limit, "presolve": True})
    if res.x is None:
        raise PlanError(f"the solver found no plan: {res.message}")

    x = res.x
    load = dict.fromkeys(names, 0.0)
    served: list[dict[str, float]] = [{} for _ in cells]
    for k, (c, g) in enumerate(pairs):
        share = min(max(float(x[G + k]), 0.0), 1.0)
        if share > 1e-9:
            load[names[g]] += cells[c].rps * share / cells[c].tputs[g]
            served[c][names[g]] = cells[c].rps * share
    # A replica beyond the work sent to it costs something, or (cost 0) nothing: drop it either way
    replicas = {n: min(int(round(x[g])), math.ceil(load[n] - 1e-6)) for g, n in enumerate(names)}
    splits = tuple(CellSplit(*_shape(cell), cell.rps, served[c]) for c, cell in enumerate(cells))
    total = round(math.fsum(p.cost * replicas[p.gpu] for p in profiles), 9)
    return Plan(replicas, total, load, splits, time.perf_counter() - started,
                rps=sum(c.rps for c in cells), optimal=res.status == 0, unserved=unserved)
