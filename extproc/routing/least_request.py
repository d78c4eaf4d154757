"""`least-request`: fewest in-flight requests wins. Blind to GPU speed, which is why load-balance exists."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.openai import Request
from extproc.routing.framework import BuildContext, MaxScorePicker, PodView, Profile, register


class LeastRequestScorer:
    """Higher is better: 1 − running / the most running of any pod."""

    lower_is_better = False

    def score(self, request: Request, pods: Sequence[PodView], now: float) -> list[float]:
        most = max(p.running for p in pods)
        if most == 0:
            return [1.0] * len(pods)
        return [1.0 - p.running / most for p in pods]


@register("least-request")
def build(ctx: BuildContext) -> Profile:
    return Profile("least-request", MaxScorePicker(ctx.rng),
                   scorers=[(LeastRequestScorer(), 1.0)])
