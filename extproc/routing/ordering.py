"""Pods best first for the endpoint-picker protocol's fallback list: one C-level sort of a pick's keys.
Pure."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from extproc.vocabulary import PodView


def best_first(pods: Sequence[PodView], keys: Sequence[float], n: int | None, rng: random.Random,
               tiebreak: Callable[[PodView], float] | None = None) -> list[PodView]:
    """The first `n` pods (all: None) by ascending key. A group of equal keys comes in a random
    rotation, then stably by `tiebreak` when given, so who of a tie comes first is random, as a
    picker's `rng.choice` makes it; only tied groups pay for the tiebreak."""
    ranked = sorted(range(len(keys)), key=keys.__getitem__)
    want = len(ranked) if n is None else min(n, len(ranked))
    out: list[PodView] = []
    i = 0
    while len(out) < want:
        j, key = i + 1, keys[ranked[i]]
        while j < len(ranked) and keys[ranked[j]] == key:
            j += 1
        if j - i == 1:
            out.append(pods[ranked[i]])
        else:
            start = i + rng.randrange(j - i)
            tied = [pods[k] for k in (*ranked[start:j], *ranked[i:start])]
            if tiebreak is not None:
                tied.sort(key=tiebreak)
            out.extend(tied[:want - len(out)])
        i = j
    return out
