"""slo-least-load-pulling, AIBrix's rule: the lowest utilization + consumption <= 1; none fits: the
request waits in the gateway queue (the pick returns Queued), or is rejected when its SLO cannot be met
(Rejected). `slo` (slo/lanes.py) pulls the same way within its lane."""

from __future__ import annotations

import math

from extproc.openai import Request
from extproc.routing.framework import PodView
from extproc.routing.outcome import Queued, Rejected
from extproc.slo.model import Signature
from extproc.slo.policy import EPS, Row, SloPolicy, fitting
from extproc.slo.queue import REJECT_BREACHED, Entry

MEASURED_MARGIN = 0.8  # the learned TPOT line is a mean; the SLO is a P99


class Pulling(SloPolicy):
    name = "slo-least-load-pulling"

    def choose(self, request, sig, rows, now, queued):  # noqa: ANN001, ANN201  (SloPolicy.choose)
        return self.pull(request, sig, rows, now, queued)

    def pull(self, request: Request, sig: Signature, rows: list[Row], now: float, queued: bool,
             lane: frozenset | None = None, spill: list[Row] | None = None,
             pack: bool = False) -> PodView | Queued | Rejected:
        """The least loaded that fits, else wait. `lane` (`slo`): the deployments the request may use,
        `rows` narrowed to them; `pack`: the fullest that fits instead; `spill`: other types' pods with
        room, packed when the lane is full."""
        fits = fitting(rows)
        state = self.state
        queue_open = state.settings.max_queue > 0
        if queue_open and not queued:
            queue = state.queues.of(request.model)
            if queue.waiting(lane) if lane is not None else queue.length > 0:
                return self._hold(request, sig, lane, now)  # no overtaking
        if fits:
            if pack:
                # `slo`, where its lane also serves a whole-pod shape: least load spread the short
                # requests over every pod, so a long prompt never found an empty one and its prefill
                # stalled the decodes it joined (slo-a10-l20 on issue 43's engine model: P99 TPOT 56 ms,
                # packed 49 ms; docs/slo-routing.md, "Why slo departs").
                return self.best(fits, lambda r: -(r.utilization + r.consumption))
            if queued and lane is None:
                # a queued request: the most relaxed deployment, then the least load (AIBrix)
                most = max(r.slack for r in fits)
                fits = [r for r in fits if r.slack >= most - EPS]
            return self.best(fits, lambda r: r.utilization + r.consumption)
        if spill:  # the lane is full: another type's pod, packed, so its idle pods stay whole
            return self.best(spill, lambda r: -(r.utilization + r.consumption))
        if lane is not None:
            # A whole-pod shape (tput x e2e < 1) would wait for a pod to empty completely: it shares the
            # least loaded pod of its lane while that pod holds at most a pod's worth.
            whole = [r for r in rows if r.consumption >= 1.0 - EPS and r.utilization <= 1.0 + EPS]
            if whole:
                return self.best(whole, lambda r: r.utilization)
            # Full by the profiles, which measure one replica alone under Poisson arrivals at P99 and
            # undercount what a routed pod sustains: wait only when the pods show it too.
            room = [r for r in rows if _measured_room(r)]
            if room:
                return self.best(room, lambda r: r.utilization + r.consumption)
        if not queue_open:
            return self.best(rows, lambda r: r.utilization + r.consumption)
        return self._hold(request, sig, lane, now)

    def _hold(self, request: Request, sig: Signature, lane: frozenset | None,
              now: float) -> Queued | Rejected:
        """The request waits, with its queue entry: slack on the most relaxed deployment that can serve
        this shape at all (under `slo`, of its lane: the deployments it may use). Rejected when waiting
        cannot help: its SLO is breached already."""
        table = self.state.table(request.model)
        named = {name: dm for name, dm in table.items()
                 if dm.consumption(sig) is not None and (lane is None or name in lane)}
        usable = list(named.values())
        could = frozenset(named)
        best = max(usable, key=lambda dm: dm.slack(sig))
        slack = best.slack(sig)
        scale = float(best.tokens(sig))
        max_wait = self.state.settings.max_wait_seconds
        wait = max_wait if math.isinf(slack) else min(max_wait, slack * scale)
        retry = max(1.0, min(dm.expected(sig) * dm.tokens(sig) for dm in usable))
        if wait <= 0:
            return Rejected(REJECT_BREACHED, retry, could)
        entry = Entry(request.model, best.cell(sig) if lane is None else lane, now,
                      slack if not math.isinf(slack) else max_wait, scale, now + wait,
                      blocks_all=lane is None)
        entry.retry_after = retry
        entry.deployments = could
        return Queued(entry)


def _measured_room(r: Row) -> bool:
    """The pod's learned speed says one more request keeps its TPOT well inside the target, its engine
    queues nothing, and it holds at most the profile's budget_margin times its budget: the profile kept
    a budget at most 1/budget_margin of the largest that met the SLO, so up to there a run measured it,
    and beyond it only the line speaks, fitted at the loads the pod has seen. A line that has seen no
    slope yet (shape 0, the prior) calls any batch as fast as one request; trusted past the margin it
    admitted 21x a budget and a P99 TPOT of 0.5 s against a 50 ms SLO (issue 43's engine model)."""
    v = r.view
    return (r.tpot_target is not None and v.speed is not None and v.queued <= 0
            and r.utilization + r.consumption <= r.margin + EPS
            and v.speed.tpot(v.running + 1) <= MEASURED_MARGIN * r.tpot_target)


__all__ = ["MEASURED_MARGIN", "Pulling"]
