"""`round-robin`: exact alternation over a model's pods: equal request counts, the spec's "before".

Exclusive on purpose: blending or gating it would stop it being the equal-count baseline it exists to
be. Its position per model lives in RoutingState, so it survives config reloads.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

from extproc.routing.framework import BuildContext, PodView, Profile, register


class RoundRobinPicker:
    __slots__ = ("_next",)

    def __init__(self, positions: MutableMapping[str, int]) -> None:
        self._next = positions  # model -> position of the next pick

    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView:
        model = pods[0].pod.model
        i = self._next.get(model, 0)
        self._next[model] = i + 1
        return pods[i % len(pods)]


@register("round-robin")
def build(ctx: BuildContext) -> Profile:
    return Profile("round-robin", RoundRobinPicker(ctx.store.round_robin), exclusive=True)
