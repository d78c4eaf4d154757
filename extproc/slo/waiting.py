"""Where the slo* strategies' held-back requests wait, as they register it (routing.framework.Waiting):
the live room on a gateway (slo/live_room.py), the pure room over the gateway's SLO queues for virtual
time (slo/room.py), the background refresh of profiles and splits (slo/refresh.py), and the queue's
length the request traces report. The gateway's shells build these from the registry, so none of them
imports this package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from extproc.routing.framework import Waiting
from extproc.slo.room import Room
from extproc.slo.state import SloState, learned

if TYPE_CHECKING:
    from extproc.routing import RoutingState
    from extproc.slo.live_room import SloRoom


def _live(gateway: Any) -> SloRoom:
    from extproc.slo.live_room import SloRoom  # prometheus and asyncio: only where a gateway runs

    return SloRoom(gateway)


def _virtual(store: RoutingState) -> Room[Any]:
    state: SloState = learned(store.store)  # type: ignore[assignment]  (built with the strategy)
    return Room(state.queues)


def _length(store: RoutingState, model: str) -> int:
    state = learned(store.store)
    return state.queues.length(model) if state is not None else 0  # (no slo* strategy built yet)


def _refresh(gateway: Any, redis: Any) -> Any:
    from extproc.slo.refresh import SloRefresh

    return SloRefresh(gateway).run_profiles(redis)


SLO_WAITING = Waiting("slo", live=_live, virtual=_virtual, refresh=_refresh, length=_length)
