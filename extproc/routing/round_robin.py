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

    def following(self, pods: Sequence[PodView], chosen: PodView) -> list[PodView]:
        """The pods after `chosen` in the rotation (the endpoint-picker protocol's fallbacks), without
        moving it: picking them one by one would skip them in the rotation."""
        j = next((k for k, v in enumerate(pods) if v is chosen), -1)
        return [*pods[j + 1:], *pods[:j]] if j >= 0 else list(pods)


@register("round-robin")
def build(ctx: BuildContext) -> Profile:
    return Profile("round-robin", RoundRobinPicker(ctx.store.round_robin), exclusive=True)
