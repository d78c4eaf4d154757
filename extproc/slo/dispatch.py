"""Dispatching the SLO queue, clock-free: the live waiting room (server.py) and a virtual-time loop (the
fleet simulation) run the same rule.

Most urgent head first; it is re-routed (the strategy, told it is dispatching, places it on the most
relaxed deployment that fits); dispatch stops at the first head that still does not fit, so nobody
overtakes it (under `slo`, nobody of its lane: the requests that may use the same deployments).
Entries whose deadline has passed leave as breached.
"""

from __future__ import annotations

from collections.abc import Callable

from extproc.routing.slo import SloReject, SloWait
from extproc.slo.queue import REJECT_BREACHED, Entry
from extproc.slo.state import SloState

# (entry, outcome): outcome is the route's result (a decision, or None: no ready pod), or an SloReject.
Outcome = tuple[Entry, object]


def dispatch(state: SloState, model: str, now: float, route: Callable[[Entry], object],
             skip: Callable[[Entry], bool] = lambda e: False) -> list[Outcome]:
    """Route queued requests of `model` while they fit. `route(entry)` routes the entry's request with
    its strategy (it may raise SloWait / SloReject); `skip(entry)` drops entries nobody waits for."""
    queue = state.queues.of(model)
    out: list[Outcome] = []
    stuck: set = set()  # lanes whose head did not fit (`slo`): their requests wait, others go on
    while queue.length:
        entry = queue.most_urgent(now, stuck)
        if entry is None:
            break
        if skip(entry):
            queue.remove(entry)
            continue
        state.dispatching = True
        try:
            result = route(entry)
        except SloWait:
            if entry.blocks_all:
                break
            stuck.add(entry.key)
            continue
        except SloReject as rej:
            result = rej
        finally:
            state.dispatching = False
        queue.remove(entry)
        out.append((entry, result))
    return out


def expire(state: SloState, model: str, now: float) -> list[Entry]:
    """Remove and return the entries whose SLO is breached (deadline passed) while they waited."""
    queue = state.queues.of(model)
    gone = queue.breached(now)
    for entry in gone:
        queue.remove(entry)
    return gone


__all__ = ["REJECT_BREACHED", "dispatch", "expire"]
