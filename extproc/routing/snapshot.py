"""A Snapshot: one model's PodViews as the gateway's view cache holds them between rebuilds.

Routing runs its strategies over the same PodView objects for many requests in a row: the gateway
rebuilds them a few times a second (extproc/state/accounting.py) and, in between, changes only
`running` (every choice and record) and `healthy` (rare) in place. Everything else a view carries —
capacity, speed, KV, queue — is fixed for the snapshot's life, so what a strategy derives from those
alone (columns of capacities, KV penalties, speeds filled for new pods) is computed once per snapshot
instead of once per request. A plain list of views still works everywhere: it is simply derived anew
on each call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from extproc.vocabulary import PodView

T = TypeVar("T")


def derived(pods: Sequence[PodView], owner: object, build: Callable[[Sequence[PodView]], T]) -> T:
    """`build(pods)`, kept on a Snapshot per `owner` (the plugin whose settings it depends on).
    `build` may read any field of the views except `running` and `healthy`."""
    memo = getattr(pods, "memo", None)
    if memo is None:
        return build(pods)
    try:
        return memo[owner]
    except KeyError:
        value = memo[owner] = build(pods)
        return value
