"""`least-kv-cache`: the pod with the most free KV cache (engine metrics) wins. A pod that does not
report KV usage counts as the average of those that do (all equal when none does)."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.openai import Request
from extproc.routing.framework import BuildContext, MaxScorePicker, PodView, Profile, register
from extproc.routing.load_math import mean_fill


class KvFreeScorer:
    """Higher is better: the free fraction of the GPU KV cache."""

    lower_is_better = False

    def score(self, request: Request, pods: Sequence[PodView], now: float) -> list[float]:
        return mean_fill([p.kv_free if p.kv_free is not None and p.kv_free == p.kv_free else None
                          for p in pods], 1.0)


@register("least-kv-cache")
def build(ctx: BuildContext) -> Profile:
    return Profile("least-kv-cache", MaxScorePicker(ctx.rng), scorers=[(KvFreeScorer(), 1.0)])
