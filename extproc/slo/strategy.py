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

Each variant's rule is its own module (slo/pack_load.py, slo/least_load.py, slo/pulling.py, slo/lanes.py)
over the rows slo/policy.py computes. Load model and signature: extproc.slo (docs/slo-routing.md). Pods
whose deployment has no usable profile are not judged; with no profiles for the model at all, or no
suitable pod, load-balance routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from extproc.openai import Request
from extproc.routing.framework import BuildContext, PodView, Profile, build, register
from extproc.routing.outcome import Queued, Rejected
from extproc.slo.lanes import Lanes
from extproc.slo.least_load import LeastLoad
from extproc.slo.pack_load import PackLoad
from extproc.slo.policy import SloPolicy
from extproc.slo.pulling import Pulling
from extproc.slo.settings import PARAMS
from extproc.slo.state import STORE_KEY, SloState
from extproc.slo.waiting import SLO_WAITING

# one policy module per variant, in registration order
POLICIES: dict[str, type[SloPolicy]] = {p.name: p for p in (PackLoad, LeastLoad, Pulling, Lanes)}
VARIANTS = ("slo-pack-load", "slo-least-load", "slo-least-load-pulling")


def slo_state(ctx: BuildContext) -> SloState:
    """The gateway's one SloState (every slo* strategy of every model shares it), on this config."""
    state = ctx.store.slot(STORE_KEY, lambda: SloState(ctx.params))
    if state.settings != ctx.params:
        state.configure(ctx.params)
    return state


@dataclass(slots=True)
class SloProfile(Profile):
    policy: SloPolicy | None = None  # the variant's rule (one module each)

    def pick(self, request: Request, pods: Sequence[PodView], now: float,
             queued: bool = False) -> PodView | Queued | Rejected | None:
        pods = self.candidates(request, pods, now)
        if not pods:
            return None
        return self.policy.pick(request, pods, now, queued)

    def ranked(self, request: Request, pods: Sequence[PodView], now: float, n: int | None = None) -> None:
        """The policy's admission decides each pick, so its fallbacks are asked for one by one."""
        return None


def _factory(variant: str):
    def make(ctx: BuildContext) -> Profile:
        state = slo_state(ctx)
        fallback = build("load-balance", ctx.settings, ctx.store, ctx.model)
        policy = POLICIES[variant](state, fallback, ctx.rng)
        return SloProfile(variant, fallback.picker, exclusive=True, hooks_of=[state, *fallback.plugins()],
                          policy=policy)
    return make


for _variant in POLICIES:
    register(_variant, params=PARAMS, waiting=SLO_WAITING)(_factory(_variant))

__all__ = ["SloProfile", "VARIANTS"]
