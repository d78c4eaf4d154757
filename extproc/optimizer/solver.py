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

SPREAD_FLOOR = 0.01  # the tangent's point is never below this (a type with next to no load)
HEADROOM_PASSES = 3  # solves with the headroom's tangent moved to the last solve's spread
# With `current`, of a replica's hourly cost, per replica the plan adds / removes. The service and the
# fleet simulation take theirs from the policy (optimizer/policy.py, where the rules are): adding defaults
# to provision_s / window_s, 60 s / 240 s here; removing is a tie-break, not a price (a removed replica
# stops billing once it drains), large enough that of two plans of equal cost the one closest to now wins.
ADD_COST = 0.25
REMOVE_COST = 0.05


class PlanError(ValueError):
    """The workload cannot be planned (no profiles, or cells that no GPU type can serve)."""


@dataclass(frozen=True, slots=True)
class Demand:
    """Requests/s of one (input, output) shape; token counts may be fractional (trace buckets are log2)."""

    input_tokens: float
    output_tokens: float
    rps: float
    width: float = 0.0  # log2 range of the token counts it stands for (a trace bucket: 1/precision); 0: exact


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
    skipped: int = 0  # how many cells those are

    def as_json(self) -> dict[str, object]:
        return {"replicas": dict(self.replicas), "cost": self.cost, "solve_seconds": self.solve_seconds}


@dataclass(slots=True)
class _Cell:
    rps: float = 0.0
    log_in: float = 0.0  # rate-weighted sums of log2 tokens, for the representative shape
    log_out: float = 0.0
    tputs: tuple[float, ...] = field(default_factory=tuple)
    slots: tuple[int, ...] = field(default_factory=tuple)  # per type: requests a replica holds at once


def _merge(profiles: Sequence[GpuProfile], demands: Iterable[Demand]) -> list[_Cell]:
    cells: dict[tuple[tuple[int, int], ...], _Cell] = {}
    for d in demands:
        if not (d.rps > 0 and math.isfinite(d.rps)):
            continue
        sig = tuple(p.cell(d.input_tokens, d.output_tokens) for p in profiles)
        c = cells.get(sig)
        if c is None:
            c = cells[sig] = _Cell(tputs=tuple(p.served[o][i] for p, (o, i) in zip(profiles, sig)),
                                   slots=tuple(p.budget(o, i) for p, (o, i) in zip(profiles, sig)))
        c.rps += d.rps
        c.log_in += d.rps * math.log2(max(d.input_tokens, 1.0))
        c.log_out += d.rps * math.log2(max(d.output_tokens, 1.0))
    return list(cells.values())


def as_routed(profiles: Sequence[GpuProfile], demands: Iterable[Demand]) -> list[Demand]:
    """The demands as the router classifies them: each that stands for a range of token counts (a trace
    bucket, `width`) split where any profile's cell changes inside that range, each piece at its share of
    the range (token counts taken as spread evenly in log2 across it). Mapped whole by its centre, a
    bucket centred on the line between two cells of a power-of-two grid goes to the larger
    (`nearest_index`'s tie rule): at precision 10, one bucket in five counts heavier than its requests."""
    in_lines = _cell_lines(p.inputs for p in profiles)
    out_lines = _cell_lines(p.outputs for p in profiles)
    out: list[Demand] = []
    for d in demands:
        if d.width <= 0:
            out.append(d)
            continue
        for x_in, f_in in _pieces(math.log2(max(d.input_tokens, 1.0)), d.width, in_lines):
            for x_out, f_out in _pieces(math.log2(max(d.output_tokens, 1.0)), d.width, out_lines):
                out.append(Demand(2.0 ** x_in, 2.0 ** x_out, d.rps * f_in * f_out))
    return out


def _cell_lines(grids: Iterable[Sequence[int]]) -> list[float]:
    """log2 of where one cell of a grid ends and the next begins (halfway between ticks), every grid's."""
    return sorted({(math.log2(a) + math.log2(b)) / 2 for g in grids for a, b in zip(g, g[1:])})


def _pieces(x: float, width: float, lines: Sequence[float]) -> list[tuple[float, float]]:
    """(centre, share) of each part of [x - width/2, x + width/2] between the lines that cross it."""
    lo, hi = x - width / 2, x + width / 2
    cuts = [lo, *(v for v in lines if lo < v < hi), hi]
    return [((a + b) / 2, (b - a) / width) for a, b in zip(cuts, cuts[1:])]


def _shape(c: _Cell) -> tuple[float, float]:
    return 2 ** (c.log_in / c.rps), 2 ** (c.log_out / c.rps)


def solve(profiles: Sequence[GpuProfile], demands: Iterable[Demand], time_limit: float = 30.0,
          skip_unservable: bool = False, current: Mapping[str, int] | None = None,
          headroom: float = 0.0, limits: Mapping[str, int] | None = None, add_cost: float = ADD_COST,
          remove_cost: float = REMOVE_COST) -> Plan:
    """The cost-minimal plan. Raises PlanError when there are no profiles or a cell nobody can serve;
    with `skip_unservable` (the service: one odd request shape must not stop every re-plan) such cells
    are left out of the plan and named in `Plan.unserved`. With `current` (the replicas running now),
    each replica added costs `add_cost` of its hourly cost and each removed `remove_cost`: of plans within
    that of each other the one closest to now wins, so near-ties between GPU types do not flip the mix
    every re-plan (a count the demand needs is added whatever it costs: the constraints come first).

    `headroom` (β): a type's replicas keep β standard deviations of its load spare (square-root
    staffing). Each cell's requests arrive at random and hold one of the k slots a replica admits of
    that shape (`GpuProfile.budget`), so its load in replicas, L_c, varies by sqrt(L_c / k): a shape that
    takes a whole replica (k = 1: long prompts served one at a time) needs sqrt(L) spare, chat that a replica
    batches by the dozen almost none. The constraint L + β·sqrt(Σ_c L_c / k_c) ≤ n is concave in the
    shares, so it is solved at its tangent (an upper bound of sqrt: the plan stays on the safe side),
    HEADROOM_PASSES times with the tangent moved to the last solution; the counts are then cut to the
    exact bound and the cheapest pass wins. `limits`: the most replicas each deployment may run (its
    autoscaler's maximum)."""
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
                    solve_seconds=time.perf_counter() - started, unserved=unserved, skipped=len(unservable))

    G = len(profiles)
    # The headroom's sqrt is concave: the tangent starts where each type would serve alone everything
    # it can, moves to each solve's outcome, and the cheapest of the passes (at its exact count) wins.
    best: tuple[float, dict[str, int], dict[str, float], list[dict[str, float]], bool] | None = None
    spread: list[float] | None = _spread(cells, [(c, g) for c in range(len(cells)) for g in range(G)
                                                 if cells[c].tputs[g] > 0], None, G) if headroom > 0 else None
    for _ in range(HEADROOM_PASSES if headroom > 0 else 1):
        x, pairs, ok = _milp(profiles, cells, current, time_limit, headroom, spread, limits,
                             (add_cost, remove_cost))
        spread = _spread(cells, pairs, x, G)
        load = dict.fromkeys(names, 0.0)
        served: list[dict[str, float]] = [{} for _ in cells]
        for k, (c, g) in enumerate(pairs):
            share = min(max(float(x[G + k]), 0.0), 1.0)
            if share > 1e-9:
                load[names[g]] += cells[c].rps * share / cells[c].tputs[g]
                served[c][names[g]] = cells[c].rps * share
        # A replica beyond the work sent to it (and its headroom) costs something, or (cost 0) nothing:
        # drop it either way
        replicas = {n: min(int(round(x[g])), math.ceil(load[n] + headroom * math.sqrt(spread[g]) - 1e-6))
                    for g, n in enumerate(names)}
        total = round(math.fsum(p.cost * replicas[p.gpu] for p in profiles), 9)
        if best is None or total < best[0] - 1e-9:
            best = (total, replicas, load, served, ok)
    assert best is not None
    total, replicas, load, served, ok = best
    splits = tuple(CellSplit(*_shape(cell), cell.rps, served[c]) for c, cell in enumerate(cells))
    return Plan(replicas, total, load, splits, time.perf_counter() - started,
                rps=sum(c.rps for c in cells), optimal=ok, unserved=unserved, skipped=len(unservable))


def _spread(cells: list[_Cell], pairs: list[tuple[int, int]], x: np.ndarray | None, G: int) -> list[float]:
    """Per type, Σ_c L_c / k_c: its load's variance in replicas² (x None: every pair served whole)."""
    out = [0.0] * G
    for k, (c, g) in enumerate(pairs):
        share = 1.0 if x is None else max(float(x[G + k]), 0.0)
        out[g] += cells[c].rps * share / cells[c].tputs[g] / cells[c].slots[g]
    return out


def _milp(profiles: Sequence[GpuProfile], cells: list[_Cell], current: Mapping[str, int] | None,
          time_limit: float, headroom: float, spread: list[float] | None,
          limits: Mapping[str, int] | None,
          change: tuple[float, float]) -> tuple[np.ndarray, list[tuple[int, int]], bool]:
    """One solve: (x, the (cell, type) pairs of the share variables, optimal). With `spread` (Σ_c L_c/k_c
    per type at the previous solve), each type's capacity row carries the headroom's tangent there."""
    names = [p.gpu for p in profiles]
    G = len(profiles)
    pairs = [(c, g) for c, cell in enumerate(cells) for g in range(G) if cell.tputs[g] > 0]
    P = len(pairs)  # variables: n_0..n_{G-1}, one share per (cell, type) pair, then G additions, G removals
    D = 2 * G if current is not None else 0
    cost = np.zeros(G + P + D)
    cost[:G] = [p.cost for p in profiles]
    if D:
        unit = math.fsum(p.cost for p in profiles) / G or 1.0  # zero-cost types still resist churn
        cost[G + P:G + P + G] = [change[0] * (p.cost or unit) for p in profiles]
        cost[G + P + G:] = [change[1] * (p.cost or unit) for p in profiles]

    # headroom: β·sqrt(S_g) ≤ β·(sqrt(S0)/2 + S_g/(2·sqrt(S0))), the tangent at the previous S0. Its
    # constant applies only to a type in use: a binary u_g per type, s_cg ≤ u_g.
    root = [math.sqrt(max(v, SPREAD_FLOOR)) for v in spread] if headroom > 0 and spread else [0.0] * G
    U = G if headroom > 0 else 0
    u0 = G + P + D
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []

    def add(entries: Iterable[tuple[int, float]], lo: float, hi: float) -> None:
        for col, v in entries:
            rows.append(len(lower))
            cols.append(col)
            vals.append(v)
        lower.append(lo)
        upper.append(hi)

    for c in range(len(cells)):  # Σ_g s_cg = 1
        add(((G + k, 1.0) for k, (cc, _) in enumerate(pairs) if cc == c), 1.0, 1.0)
    for g in range(G):  # Σ_c r_c s_cg / t_cg (+ the headroom's tangent) − n_g ≤ 0
        spare = headroom / (2 * root[g]) if root[g] else 0.0
        load = [(G + k, cells[c].rps / cells[c].tputs[g] * (1.0 + spare / cells[c].slots[g]))
                for k, (c, gg) in enumerate(pairs) if gg == g]
        add([*load, (g, -1.0), *([(u0 + g, headroom * root[g] / 2)] if U else [])], -np.inf, 0.0)
    if U:
        for k, (_, g) in enumerate(pairs):  # s_cg ≤ u_g
            add([(G + k, 1.0), (u0 + g, -1.0)], -np.inf, 0.0)
    now = [float((current or {}).get(n, 0)) for n in names]
    for g in range(D // 2):  # added a_g >= n_g - now_g, removed r_g >= now_g - n_g
        add([(g, 1.0), (G + P + g, -1.0)], -np.inf, now[g])
        add([(g, -1.0), (G + P + G + g, -1.0)], -np.inf, -now[g])
    A = coo_array((vals, (rows, cols)), shape=(len(lower), G + P + D + U)).tocsr()

    # n_g never needs to exceed the replicas g would need to serve alone everything it can serve
    work = np.zeros(G)
    alone = np.zeros(G)
    for c, g in pairs:
        work[g] += cells[c].rps / cells[c].tputs[g]
        alone[g] += cells[c].rps / cells[c].tputs[g] / cells[c].slots[g]
    tangent = headroom * (np.asarray(root) / 2 + alone / (2 * np.maximum(np.asarray(root), 1e-9)))
    n_max = np.ceil(work + np.where(np.asarray(root) > 0, tangent, 0.0) + 1e-9)
    for g, name in enumerate(names):
        if limits is not None and name in limits:
            n_max[g] = min(n_max[g], max(0, limits[name]))
    ub = np.concatenate([n_max, np.ones(P), np.full(D, np.inf), np.ones(U)])
    integrality = np.concatenate([np.ones(G), np.zeros(P + D), np.ones(U)])
    res = milp(np.concatenate([cost, np.zeros(U)]), constraints=LinearConstraint(A, lower, upper),
               integrality=integrality, bounds=Bounds(np.zeros(G + P + D + U), ub),
               options={"mip_rel_gap": 0.0, "time_limit": time_limit, "presolve": True})
    if res.x is None:
        raise PlanError(f"the solver found no plan: {res.message}")
    return res.x, pairs, res.status == 0
