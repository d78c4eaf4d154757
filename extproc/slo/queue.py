"""The gateway queue of `slo-least-load-pulling`: requests predicted to miss their SLO wait here.

Per model, FIFO sub-queues per signature (the profile cell the request falls in). Only the head of each
sub-queue competes: the most urgent head is dispatched first. Urgency, as AIBrix ranks it, is
elapsed + expected − target in the SLO's metric (per-token metrics count the wait per output token), so
a request with less slack, or one that has waited longer, goes first. Beyond AIBrix's code and as its
documentation says: the queue is bounded, and a request whose SLO is breached while it waits (its
deadline passed) leaves it to be rejected. Pure: `now` comes in, the server owns the waiting.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

REJECT_FULL = "queue_full"
REJECT_BREACHED = "slo_breached"

P = TypeVar("P")  # what the owner of the wait keeps on the entry


@dataclass(slots=True, eq=False)
class Entry(Generic[P]):
    model: str
    key: Hashable        # the signature's cell: requests of one shape keep their arrival order
    arrival: float
    slack: float         # target − expected on the most relaxed deployment, in the metric's unit
    scale: float         # 1 for seconds metrics, output tokens for per-token ones
    deadline: float      # past this the SLO is breached: the request is rejected
    retry_after: float = 1.0  # seconds suggested to a rejected client (Retry-After)
    seq: int = 0
    # True (AIBrix's rule): a head that does not fit stops the dispatch, nobody overtakes it. False
    # (`slo`): the key is the set of deployments the request may use, and only its own lane waits.
    blocks_all: bool = True
    deployments: frozenset[str] = frozenset()  # those that could serve it in time (a refusal is theirs)
    # the owner's, set once the room admits it (the live stream's waiter, the simulation's arrival index)
    payload: P = field(init=False, repr=False)

    def urgency(self, now: float) -> float:
        return (now - self.arrival) / self.scale - self.slack


class Full(Exception):
    """The model's queue holds its bound already."""


@dataclass(slots=True)
class ModelQueue:
    bound: int
    subqueues: dict[Hashable, deque[Entry]] = field(default_factory=dict)
    length: int = 0

    def push(self, entry: Entry) -> None:
        if self.length >= self.bound:
            raise Full(entry.model)
        self.subqueues.setdefault(entry.key, deque()).append(entry)
        self.length += 1

    def heads(self) -> Iterator[Entry]:
        for q in self.subqueues.values():
            if q:
                yield q[0]

    def most_urgent(self, now: float, skip: frozenset | set = frozenset()) -> Entry | None:
        best: Entry | None = None
        best_u = 0.0
        for head in self.heads():
            if head.key in skip:
                continue
            u = head.urgency(now)
            if best is None or u > best_u or (u == best_u and head.seq < best.seq):
                best, best_u = head, u
        return best

    def waiting(self, key: Hashable) -> bool:
        return bool(self.subqueues.get(key))

    def remove(self, entry: Entry) -> bool:
        q = self.subqueues.get(entry.key)
        if q is None:
            return False
        try:
            q.remove(entry)
        except ValueError:
            return False
        if not q:
            del self.subqueues[entry.key]
        self.length -= 1
        return True

    def breached(self, now: float) -> list[Entry]:
        return [e for q in self.subqueues.values() for e in q if e.deadline <= now]


class Queues:
    """Every model's queue, with one bound (`max_length` per model)."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self._models: dict[str, ModelQueue] = {}
        self._seq = itertools.count()

    def of(self, model: str) -> ModelQueue:
        q = self._models.get(model)
        if q is None:
            q = self._models[model] = ModelQueue(self.max_length)
        q.bound = self.max_length  # a reload may change the bound
        return q

    def length(self, model: str) -> int:
        q = self._models.get(model)
        return q.length if q is not None else 0

    def lengths(self) -> dict[str, int]:
        return {m: q.length for m, q in self._models.items()}

    def push(self, entry: Entry) -> None:
        entry.seq = next(self._seq)
        self.of(entry.model).push(entry)

    def remove(self, entry: Entry) -> bool:
        q = self._models.get(entry.model)
        return q.remove(entry) if q is not None else False
