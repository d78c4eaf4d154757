"""`power-of-two`: two pods drawn at random, the one with the lower capacity-normalised load (the
load-balance score) wins. Nearly as even as scoring every pod, at a constant cost, and never herds:
gateways with stale counts do not all pick the same "best" pod.

The draw is a Filter, so it survives blending: a bare `power-of-two` is auto-blended with load-balance
and least-request, and the blend then chooses between the two drawn pods. Were the draw in the picker,
a blend (which has its own picker) would silently turn it into "the least loaded of all".
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from extproc.openai import Request
from extproc.routing.framework import BuildContext, PodView, Profile, register
from extproc.routing.load_balance import LoadBalanceScorer
from extproc.routing.load_math import LowestScorePicker


class TwoChoices:
    """Keeps two pods drawn uniformly at random (all of them when there are two or fewer). Pods under
    load-balance's critical free-KV level are drawn only when too few others remain, as load-balance
    passes over them: otherwise a pair of two such pods would route into KV exhaustion."""

    __slots__ = ("_rng", "_kv_critical")

    def __init__(self, rng: random.Random, kv_critical: float) -> None:
        self._rng = rng
        self._kv_critical = kv_critical

    def filter(self, request: Request, pods: Sequence[PodView], now: float) -> Sequence[PodView]:
        critical = self._kv_critical
        usable = [p for p in pods if p.kv_free is None or not p.kv_free < critical]  # NaN: not reported
        if len(usable) >= 2:
            pods = usable
        elif usable:
            return usable
        if len(pods) <= 2:
            return pods
        i, j = self._rng.sample(range(len(pods)), 2)
        return [pods[i], pods[j]]


@register("power-of-two")
def build(ctx: BuildContext) -> Profile:
    # Ties between the two (equal scores) go to the least KV usage, then at random: LowestScorePicker.
    return Profile("power-of-two", LowestScorePicker(ctx.rng),
                   scorers=[(LoadBalanceScorer(ctx.settings.load_balance), 1.0)],
                   filters=[TwoChoices(ctx.rng, ctx.settings.load_balance.kv_critical_free)])
