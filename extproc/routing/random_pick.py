"""`random`: uniform choice among ready pods; the baseline every other strategy is measured against."""

from __future__ import annotations

from extproc.routing.framework import Profile, RandomPicker, RoutingSettings, register


@register("random")
def build(settings: RoutingSettings) -> Profile:
    return Profile("random", RandomPicker(settings.rng()))
