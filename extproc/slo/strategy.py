"""The SLO family: route each request to a GPU type likely to meet its SLO, from per-GPU profiles.

    slo-pack-load           the pod with the largest utilization + consumption still ≤ 1 (consolidate);
                            none fits: the least loaded after placement
    slo-least-load          the lowest current utilization among pods of suitable types (tput > 0 for the
                            request's cell), ignoring the SLO prediction
    slo-least-load-pulling  AIBrix's rule: the lowest utilization + consumption ≤ 1; none fits: the request
                            waits in the gateway queue (the pick returns Queued), or is rejected when its SLO
                            cannot be met (Rejected)
    slo                     ours: as pulling, among the GPU types comparative advantage gives the shape
                            (slo.assignment); a full lane spills packed onto another type; a whole-pod
                            shape shares a pod; a pod measurement says has room takes a request before it
                            waits; one queue per lane (docs/slo-routing.md, "Why slo departs")

Load model and signature: extproc.slo (docs/slo-routing.md). Pods whose deployment has no usable profile
are not judged; with no profiles for the model at all, or no suitable pod, load-balance routes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.openai import Request
from extproc.pool.pod import deployment_of
from extproc.routing.framework import BuildContext, PodView, Profile, build, register
from extproc.routing.outcome import Queued, Rejected
from extproc.slo.model import PER_TOKEN
from extproc.slo.queue import REJECT_BREACHED, Entry
from extproc.slo.settings import PARAMS
from extproc.slo.state import STORE_KEY, SloState
from extproc.slo.waiting import SLO_WAITING

EPS = 1e-9
VARIANTS = ("slo-pack-load", "slo-least-load", "slo-least-load-pulling")


def slo_state(ctx: BuildContext) -> SloState:
    """The gateway's one SloState (every slo* strategy of every model shares it), on this config."""
    state = ctx.store.slot(STORE_KEY, lambda: SloState(ctx.params))
    if state.settings != ctx.params:
        state.configure(ctx.params)
    return state


@dataclass(slots=True)
class _Row:
    view: PodView
    consumption: float
    utilization: float
    slack: float
    tpot_target: float | None  # the profile's TPOT SLO (seconds), when TPOT is its metric


class SloPolicy:
    def __init__(self, variant: str, state: SloState, fallback: Profile, rng) -> None:
        self.variant = variant
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
            rows.append(_Row(v, c, self.state.utilization(v.pod, v.running, c), dm.slack(sig),
                             dm.target if dm.metric == "tpot" else None))
        return sig, rows

    def _best(self, rows: list[_Row], key) -> PodView:
        best = min(key(r) for r in rows)
        tied = [r for r in rows if key(r) <= best + EPS]
        return (tied[0] if len(tied) == 1 else self.rng.choice(tied)).view

    def _assigned(self, request: Request, sig, rows: list[_Row], now: float, queued: bool) -> list[_Row]:
        """`slo`: the rows of the deployments the split by comparative advantage gives this shape."""
        state = self.state
        if not queued:  # a queued request was counted in the mix when it arrived
            state.observe_arrival(request.model, sig, now)
        pods: dict[str, int] = {}
        for r in rows:
            dep = deployment_of(r.view.pod)
            pods[dep] = pods.get(dep, 0) + 1
        chosen = state.assigned(request.model, sig, pods, now)
        return [r for r in rows if deployment_of(r.view.pod) in chosen] or rows

    def pick(self, request: Request, pods: Sequence[PodView], now: float,
             queued: bool = False) -> PodView | Queued | Rejected | None:
        """`queued`: the request is leaving the queue (the room dispatches it), not arriving."""
        sig, rows = self._rows(request, pods, now)
        if not rows:
            return self.fallback.pick(request, pods, now)
        lane = None
        spill: list[_Row] = []
        if self.variant == "slo":
            everywhere = rows
            rows = self._assigned(request, sig, rows, now, queued)
            lane = frozenset(deployment_of(r.view.pod) for r in rows)
            spill = [r for r in everywhere if deployment_of(r.view.pod) not in lane
                     and 0.0 < r.utilization and r.utilization + r.consumption <= 1.0 + EPS]
        if self.variant == "slo-least-load":
            return self._best(rows, lambda r: r.utilization)
        fits = [r for r in rows if r.utilization + r.consumption <= 1.0 + EPS]
        if self.variant == "slo-pack-load":
            if fits:
                return self._best(fits, lambda r: -(r.utilization + r.consumption))
            return self._best(rows, lambda r: r.utilization + r.consumption)
        # slo-least-load-pulling and slo: the least loaded that fits, else wait
        state = self.state
        queue_open = state.settings.max_queue > 0
        if queue_open and not queued:
            queue = state.queues.of(request.model)
            if queue.waiting(lane) if lane is not None else queue.length > 0:
                return self._hold(request, sig, lane, now)  # no overtaking
        if fits:
            if queued and lane is None:
                # a queued request: the most relaxed deployment, then the least load (AIBrix)
                most = max(r.slack for r in fits)
                fits = [r for r in fits if r.slack >= most - EPS]
            return self._best(fits, lambda r: r.utilization + r.consumption)
        if spill:  # the lane is full: another type's pod, packed, so its idle pods stay whole
            return self._best(spill, lambda r: -(r.utilization + r.consumption))
        if lane is not None:
            # A whole-pod shape (tput x e2e < 1) would wait for a pod to empty completely: it shares the
            # least loaded pod of its lane while that pod holds at most a pod's worth.
            whole = [r for r in rows if r.consumption >= 1.0 - EPS and r.utilization <= 1.0 + EPS]
            if whole:
                return self._best(whole, lambda r: r.utilization)
            # Full by the profiles, which measure one replica alone under Poisson arrivals at P99 and
            # undercount what a routed pod sustains: wait only when the pods show it too.
            room = [r for r in rows if _measured_room(r)]
            if room:
                return self._best(room, lambda r: r.utilization + r.consumption)
        if not queue_open:
            return self._best(rows, lambda r: r.utilization + r.consumption)
        return self._hold(request, sig, lane, now)

    def _hold(self, request: Request, sig, lane: frozenset | None, now: float) -> Queued | Rejected:
        """The request waits, with its queue entry: slack on the most relaxed deployment that can serve
        this shape at all (under `slo`, of its lane: the deployments it may use). Rejected when waiting
        cannot help: its SLO is breached already."""
        table = self.state.table(request.model)
        usable = [dm for name, dm in table.items()
                  if dm.consumption(sig) is not None and (lane is None or name in lane)]
        best = max(usable, key=lambda dm: dm.slack(sig))
        slack = best.slack(sig)
        scale = float(sig.output_tokens) if best.metric in PER_TOKEN else 1.0
        max_wait = self.state.settings.max_wait_seconds
        wait = max_wait if math.isinf(slack) else min(max_wait, slack * scale)
        retry = max(1.0, min(dm.expected(sig) if dm.metric not in PER_TOKEN else
                             dm.expected(sig) * sig.output_tokens for dm in usable))
        if wait <= 0:
            return Rejected(REJECT_BREACHED, retry)
        entry = Entry(request.model, best.cell(sig) if lane is None else lane, now,
                      slack if not math.isinf(slack) else max_wait, scale, now + wait,
                      blocks_all=lane is None)
        entry.retry_after = retry
        return Queued(entry)


MEASURED_MARGIN = 0.8  # the learned TPOT line is a mean; the SLO is a P99


def _measured_room(r: _Row) -> bool:
    """The pod's learned speed says one more request keeps its TPOT well inside the target, and its
    engine queues nothing."""
    v = r.view
    return (r.tpot_target is not None and v.speed is not None and v.queued <= 0
            and v.speed.tpot(v.running + 1) <= MEASURED_MARGIN * r.tpot_target)


@dataclass(slots=True)
class SloProfile(Profile):
    policy: SloPolicy | None = None

    def pick(self, request: Request, pods: Sequence[PodView], now: float,
             queued: bool = False) -> PodView | Queued | Rejected | None:
        pods = self.candidates(request, pods, now)
        if not pods:
            return None
        return self.policy.pick(request, pods, now, queued)


def _factory(variant: str):
    def make(ctx: BuildContext) -> Profile:
        state = slo_state(ctx)
        fallback = build("load-balance", ctx.settings, ctx.store, ctx.model)
        policy = SloPolicy(variant, state, fallback, ctx.rng)
        return SloProfile(variant, fallback.picker, exclusive=True, hooks_of=[state, *fallback.plugins()],
                          policy=policy)
    return make


for _variant in (*VARIANTS, "slo"):
    register(_variant, params=PARAMS, waiting=SLO_WAITING)(_factory(_variant))

__all__ = ["SloProfile", "VARIANTS"]
