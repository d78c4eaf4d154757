"""Which GPU types should serve which request shapes: comparative advantage, from the profiles.

`slo` (our default SLO strategy) routes a shape only to the types this split gives it. The split is the
one that leaves the busiest type least busy when the recent mix of shapes is spread over the live fleet:

    minimise   λ + ε · Σ_g load_g / N
    subject to Σ_g s_cg = 1                   for every recent shape c
               load_g = Σ_c r_c · s_cg / tput_cg ≤ λ · n_g      for every type g with n_g pods

(tput_cg: the profile's requests/s one pod of g serves within the SLO for shape c, at the GPU optimizer's
cut where it made one (slo/fleet_factors.py), as the plan counts it; s_cg its share; the ε
term breaks ties toward the type that serves a shape with the least work.) On A10 + L20 with chat and
long-prompt code generation it sends chat to the A10s and keeps the L20s, the only type that can serve
the code shape, for it: each type does what it is relatively best at, where "least load over every
suitable pod" spreads chat everywhere and leaves a whole-pod code request no pod (docs/slo-routing.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from extproc.slo.model import DeploymentModel, Signature
from extproc.slo.predictor import bucket

Shape = tuple[int, int]  # (round(log2 prompt tokens), round(log2 output tokens))
TIE_BREAK = 1e-3


def shape_of(sig: Signature) -> Shape:
    return bucket(sig.input_tokens), bucket(sig.output_tokens)


class Mix:
    """Recent arrivals per shape: counts decayed with time constant `tau_s`, so count / tau_s is a rate;
    and the longest prompt each shape has held while it stayed in the mix (`longest`)."""

    def __init__(self, tau_s: float = 60.0) -> None:
        self.tau_s = tau_s
        self.counts: dict[Shape, float] = {}
        self.longest: dict[Shape, int] = {}
        self.at = 0.0

    def _decay(self, now: float) -> None:
        if now > self.at:
            factor = math.exp(-(now - self.at) / self.tau_s)
            before = len(self.counts)
            self.counts = {k: c * factor for k, c in self.counts.items() if c * factor > 1e-3}
            if len(self.counts) < before:  # a shape gone from the mix forgets its longest prompt
                self.longest = {k: n for k, n in self.longest.items() if k in self.counts}
            self.at = now

    def observe(self, shape: Shape, now: float, prompt_tokens: int = 0) -> None:
        self._decay(now)
        self.counts[shape] = self.counts.get(shape, 0.0) + 1.0
        if prompt_tokens > self.longest.get(shape, 0):
            self.longest[shape] = prompt_tokens

    def rates(self, now: float) -> dict[Shape, float]:
        self._decay(now)
        return {k: c / self.tau_s for k, c in self.counts.items()}


def assign(table: Mapping[str, DeploymentModel], pods: Mapping[str, int],
           rates: Mapping[Shape, float]) -> dict[Shape, frozenset[str]]:
    """Shape -> the deployments that should serve it. Shapes no live deployment can serve are left out
    (the caller then considers every suitable deployment)."""
    import numpy as np  # here, not at import: scipy adds ~1 s to a gateway's start
    from scipy.optimize import linprog

    deps = [d for d in sorted(pods) if pods[d] > 0 and d in table]
    pairs: list[tuple[int, int, float]] = []  # (shape index, deployment index, tput)
    shapes = [s for s in sorted(rates) if rates[s] > 0]
    for c, shape in enumerate(shapes):
        sig = Signature(2 ** shape[0], 2 ** shape[1])
        for g, dep in enumerate(deps):
            o, i = table[dep].cell(sig)
            tput = table[dep].served(o, i)
            if tput > 0:
                pairs.append((c, g, tput))
    served = sorted({c for c, _, _ in pairs})
    if not served:
        return {}
    total_pods = sum(pods[d] for d in deps)
    n = len(pairs)  # variables: one share per pair, then λ
    cost = np.zeros(n + 1)
    cost[n] = 1.0
    row_of = {c: k for k, c in enumerate(served)}
    a_eq = np.zeros((len(served), n + 1))
    a_ub = np.zeros((len(deps), n + 1))
    for k, (c, g, tput) in enumerate(pairs):
        work = rates[shapes[c]] / tput  # pods' worth of work if all of shape c went to g
        a_eq[row_of[c], k] = 1.0
        a_ub[g, k] = work
        cost[k] = TIE_BREAK * work / total_pods
    for g, dep in enumerate(deps):
        a_ub[g, n] = -pods[dep]
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(len(deps)), A_eq=a_eq, b_eq=np.ones(len(served)),
                  bounds=[(0.0, 1.0)] * n + [(0.0, None)], method="highs")
    if res.x is None:
        return {}
    out: dict[Shape, set[str]] = {}
    for k, (c, g, _) in enumerate(pairs):
        if res.x[k] > 1e-6:
            out.setdefault(shapes[c], set()).add(deps[g])
    return {shape: frozenset(d) for shape, d in out.items()}
