"""Admission: what becomes of a request once its strategy has spoken (after the Gateway API Inference
Extension's Director and AdmissionController). `answer` takes a route's outcome and the waiting room the
strategy supplied, and turns it into the caller's answer: the live ext_proc stream (server/processor.py:
a reply, or a wait) and the fleet simulation (fleetsim/loop.py: an engine, a queue, or a refusal) decide
through this one table, so a held-back request meets the same rule in both.

    Routed    -> routed          the pod, and the gateway's key for the request
    None      -> no_pod          no ready pod (a 503)
    Queued    -> the room admits it: waits, or refused when the room is full
    Rejected  -> refused         a 429 (the strategy says its SLO cannot be met)

A strategy that holds requests back names its rooms when it registers (routing.framework.Waiting).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from extproc.routing.outcome import Outcome, Queued, Rejected, Routed

A = TypeVar("A")  # the caller's answer (a reply, nothing)
C = TypeVar("C", contravariant=True)  # what the caller needs to answer (its request, body, arrival)


class Room(Protocol):
    """Where a held-back request waits: admit it, or refuse it (Rejected: the room is full)."""

    def admit(self, queued: Queued) -> Queued | Rejected: ...


class Answers(Protocol[C, A]):  # type: ignore[misc]
    """The caller's four answers; `ctx` is passed through untouched."""

    def routed(self, decision: Routed, ctx: C) -> A: ...
    def no_pod(self, ctx: C) -> A: ...
    def waits(self, queued: Queued, ctx: C) -> A: ...
    def refused(self, rejected: Rejected, ctx: C) -> A: ...


class NoRoom(RuntimeError):
    """A strategy held a request back where nobody built a waiting room for it (a bug, not the client's)."""


def answer(outcome: Outcome, room: Room | None, to: Answers[C, A], ctx: C, payload: object = None) -> A:
    """The outcome as `to`'s answer. `payload` (when given) rides on a queued request's entry, for the
    owner of the wait to find it again (the simulation's arrival index)."""
    kind = outcome.__class__
    if kind is Routed:
        return to.routed(outcome, ctx)  # type: ignore[arg-type]
    if outcome is None:
        return to.no_pod(ctx)
    if room is None:
        raise NoRoom(f"{kind.__name__} without a waiting room")
    if kind is Queued:
        if payload is not None:
            outcome.entry.payload = payload  # type: ignore[union-attr]
        admitted = room.admit(outcome)  # type: ignore[arg-type]
        if admitted.__class__ is Queued:
            return to.waits(admitted, ctx)  # type: ignore[arg-type]
        outcome = admitted
    return to.refused(outcome, ctx)  # type: ignore[arg-type]
