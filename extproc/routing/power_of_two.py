"""`power-of-two`: two pods drawn at random, the one with the lower capacity-normalised load (the
load-balance score) wins. Nearly as even as scoring every pod, at a constant cost, and never herds:
gateways with stale counts do not all pick the same "best" pod. Blended, it votes as load-balance."""

from __future__ import annotations

import random
from collections.abc import Sequence

from extproc.routing.framework import PodView, Profile, RoutingSettings, register
from extproc.routing.load_balance import LoadBalanceScorer


class TwoChoicesPicker:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView:
        i, j = self._rng.sample(range(len(pods)), 2)
        if scores[i] == scores[j]:
            return pods[self._rng.choice((i, j))]
        return pods[i] if scores[i] < scores[j] else pods[j]


@register("power-of-two")
def build(settings: RoutingSettings) -> Profile:
    return Profile("power-of-two", TwoChoicesPicker(settings.rng()),
                   scorers=[(LoadBalanceScorer(settings.load_balance), 1.0)])
