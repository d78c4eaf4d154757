"""The SLO waiting room, pure: admit / dispatch / expire over the queues, each returning what became of
the requests (Routed | Queued | Rejected). No clock, no I/O, no asyncio: the live gateway's asyncio shell
(slo/live_room.py) and the fleet simulation's event loop (fleetsim/loop.py) wrap this one room, so a queued
request meets the same rule in both.

Dispatch: the most urgent head first; it is re-routed (its strategy, told the request is queued, places
it on the most relaxed deployment that fits); dispatch stops at the first head that still does not fit,
so nobody overtakes it (under `slo`, nobody of its lane: the requests that may use the same deployments).
Entries whose deadline has passed leave as breached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from extproc.routing.outcome import Queued, Rejected
from extproc.slo.queue import REJECT_BREACHED, REJECT_FULL, Entry, Full, Queues

P = TypeVar("P")  # what the room's owner keeps on each entry (extproc.slo.queue.Entry.payload)
R = TypeVar("R")  # what the owner's `route` returns: the outcome, or (live) the exception of a failed route


class Room(Generic[P]):
    """`Room[P]`: the owner's payloads are P (the live shell's waiters, the simulation's arrival indices)."""

    __slots__ = ("queues",)

    def __init__(self, queues: Queues) -> None:
        self.queues = queues

    def admit(self, queued: Queued) -> Queued | Rejected:
        """A request its strategy held back joins its model's queue, or is refused: the queue is full."""
        entry: Entry = queued.entry
        try:
            self.queues.push(entry)
        except Full:
            return Rejected(REJECT_FULL, entry.retry_after, entry.deployments)
        return queued

    def length(self, model: str) -> int:
        """How many requests of `model` wait."""
        return self.queues.length(model)

    def dispatch(self, model: str, now: float, route: Callable[[Entry[P]], R],
                 skip: Callable[[Entry[P]], bool] = lambda e: False) -> list[tuple[Entry[P], R]]:
        """Route queued requests of `model` while they fit: `route(entry)` re-routes the entry's request
        as queued; `skip(entry)` drops entries nobody waits for any more. Returns the entries that left
        the queue, in dispatch order, with what `route` returned for each (Routed, Rejected, None: no
        ready pod; or whatever the owner's `route` returns in place of an outcome)."""
        queue = self.queues.of(model)
        out: list[tuple[Entry[P], R]] = []
        stuck: set = set()  # lanes whose head did not fit (`slo`): their requests wait, others go on
        while queue.length:
            entry = queue.most_urgent(now, stuck)
            if entry is None:
                break
            if skip(entry):
                queue.remove(entry)
                continue
            result = route(entry)
            if type(result) is Queued:  # still no room
                if entry.blocks_all:
                    break
                stuck.add(entry.key)
                continue
            queue.remove(entry)
            out.append((entry, result))
        return out

    def breach(self, entry: Entry[P]) -> Rejected | None:
        """The entry's deadline passed while it waited: it leaves, refused (None: it had left already)."""
        if not self.queues.remove(entry):
            return None
        return Rejected(REJECT_BREACHED, entry.retry_after, entry.deployments)

    def expire(self, model: str, now: float) -> list[tuple[Entry[P], Rejected]]:
        """Every entry of `model` whose deadline has passed by `now`, removed and refused."""
        out = []
        for entry in self.queues.of(model).breached(now):
            rejected = self.breach(entry)
            if rejected is not None:  # always: each was queued
                out.append((entry, rejected))
        return out


__all__ = ["REJECT_BREACHED", "REJECT_FULL", "Room"]
