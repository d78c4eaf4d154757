"""`random`: uniform choice among ready pods; the baseline every other strategy is measured against."""

from __future__ import annotations

from extproc.routing.framework import BuildContext, Profile, RandomPicker, register


@register("random")
def build(ctx: BuildContext) -> Profile:
    return Profile("random", RandomPicker(ctx.rng))
