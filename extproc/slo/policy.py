"""What every slo* policy shares: each candidate pod's row in the load model (the request's consumption
on the pod's deployment, the pod's utilization, the deployment's slack) and the tie-broken best of a
key. One module per policy picks from the rows: slo/pack_load.py, slo/least_load.py, slo/pulling.py,
slo/lanes.py (`slo`). Pods whose deployment has no usable profile are not judged; with no rows at all,
the fallback (load-balance) routes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.gpu_profiles import BUDGET_MARGIN
from extproc.openai import Request
from extproc.pool.pod import deployment_of
from extproc.routing.framework import PodView, Profile
from extproc.routing.outcome import Queued, Rejected
from extproc.slo.model import Signature
from extproc.slo.state import SloState

EPS = 1e-9


@dataclass(slots=True)
class Row:
    view: PodView
    consumption: float
    utilization: float
    slack: float
    tpot_target: float | None  # the profile's TPOT SLO (seconds), when TPOT is its metric
    margin: float = BUDGET_MARGIN  # the profile's budget_margin: how far past its budget a pod may admit


class SloPolicy:
    """The rows, then `choose` (the variant's rule)."""

    name = ""

    def __init__(self, state: SloState, fallback: Profile, rng) -> None:  # noqa: ANN001  (random.Random)
        self.state = state
        self.fallback = fallback
        self.rng = rng

    def _rows(self, request: Request, pods: Sequence[PodView], now: float):
        table = self.state.table(request.model)
        if not table:
            return None, None
        sig = self.state.signature(request, now)
        rows = []
        for v in pods:
            dm = table.get(deployment_of(v.pod))
            if dm is None:
                continue
            c = dm.consumption(sig)
            if c is None:
                continue
            rows.append(Row(v, c, self.state.utilization(v.pod, v.running, c), dm.slack(sig),
                            dm.target if dm.metric == "tpot" else None, dm.profile.budget_margin))
        return sig, rows

    def best(self, rows: list[Row], key: Callable[[Row], float]) -> PodView:
        best = min(key(r) for r in rows)
        tied = [r for r in rows if key(r) <= best + EPS]
        return (tied[0] if len(tied) == 1 else self.rng.choice(tied)).view

    def pick(self, request: Request, pods: Sequence[PodView], now: float,
             queued: bool = False) -> PodView | Queued | Rejected | None:
        """`queued`: the request is leaving the queue (the room dispatches it), not arriving."""
        sig, rows = self._rows(request, pods, now)
        if not rows:
            return self.fallback.pick(request, pods, now)
        return self.choose(request, sig, rows, now, queued)

    def choose(self, request: Request, sig: Signature, rows: list[Row], now: float,
               queued: bool) -> PodView | Queued | Rejected | None:
        raise NotImplementedError


def fitting(rows: list[Row]) -> list[Row]:
    """The rows whose pod still has room for the request: utilization + consumption <= 1."""
    return [r for r in rows if r.utilization + r.consumption <= 1.0 + EPS]
