"""Admission: what becomes of a request once its strategy has spoken (after the Gateway API Inference
Extension's Director, whose AdmissionController's `Admit` returns a value, nil or an error, that the
Director acts on). `admit` takes a route's outcome and the waiting room the strategy supplied and returns
what to do with the request, a value the caller matches on: the live ext_proc stream
(server/processor.py: a reply, or a wait) and the fleet simulation (fleetsim/loop.py: an engine, a
queue, or a refusal) decide through this one rule, so a held-back request meets the same rule in both.

    route's outcome   admitted          the caller
    Routed            Routed            sends it to the pod (the gateway's key for the request)
    None              None              no ready pod: a 503
    Queued            Queued            the room took it: wait for its dispatch
                      Rejected          the room is full: a 429
    Rejected          Rejected          its strategy says its SLO cannot be met: a 429

No allocation of its own: the outcome is passed on, or the room's answer is. A strategy that holds
requests back names its rooms when it registers (routing.framework.Waiting, WaitingRoom).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from extproc.routing.outcome import Outcome, Queued, Routed

if TYPE_CHECKING:
    from extproc.routing.framework import WaitingRoom


class NoRoom(RuntimeError):
    """A strategy held a request back where nobody built a waiting room for it (a bug, not the client's)."""


def admit(outcome: Outcome, room: WaitingRoom | None) -> Outcome:
    """The outcome once admitted: Routed, Queued (admitted: it waits in `room`), Rejected or None."""
    if outcome is None or outcome.__class__ is Routed:
        return outcome
    if room is None:
        raise NoRoom(f"{outcome.__class__.__name__} without a waiting room")
    if isinstance(outcome, Queued):
        return room.admit(outcome)
    return outcome
