"""Pod health from what the gateway observes: responses, metric scrapes, probes. Pure, clock-injected.

A pod leaves routing when its engine refuses connections (at once), or after `failures_to_eject`
consecutive 5xx answers or failed scrapes; it comes back when a probe (or a scrape) succeeds. Probes of
an ejected pod back off exponentially up to `probe_max`: 2 s, so a replica that answers again is back
in routing within about 2 s (a probe is one GET on a pod that is down: cheap at any fleet size;
measured in docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from extproc.pool.pod import PodKey


@dataclass(slots=True)
class _State:
    healthy: bool = True
    bad_responses: int = 0
    bad_scrapes: int = 0
    backoff: float = 0.0
    next_probe: float = 0.0
    gone: bool = False  # ejected because nothing answered at its address (refused): the process went away


class PodHealth:
    def __init__(self, failures_to_eject: int = 3, probe_initial: float = 0.5, probe_max: float = 2.0) -> None:
        self.failures_to_eject = failures_to_eject
        self.probe_initial = probe_initial
        self.probe_max = probe_max
        self._pods: dict[PodKey, _State] = {}
        # Told (key, healthy, restarted) when a pod leaves or rejoins routing: Accounting updates its
        # cached views. `restarted`: it rejoins after its address refused connections, so what answers
        # now is likely a new engine process (slow scrapes or 5xx answers are not that).
        self.on_change: Callable[[PodKey, bool, bool], None] | None = None

    def _state(self, key: PodKey) -> _State:
        s = self._pods.get(key)
        if s is None:
            s = self._pods[key] = _State()
        return s

    def healthy(self, key: PodKey) -> bool:
        s = self._pods.get(key)
        return s is None or s.healthy

    def _eject(self, key: PodKey, s: _State, now: float, refused: bool = False) -> None:
        s.gone = s.gone or refused
        if s.healthy:
            s.healthy = False
            s.backoff = self.probe_initial
            s.next_probe = now + s.backoff
            if self.on_change is not None:
                self.on_change(key, False, False)

    def _admit(self, key: PodKey, s: _State) -> None:
        was, gone = s.healthy, s.gone
        s.healthy, s.gone = True, False
        s.bad_responses = s.bad_scrapes = 0
        if not was and self.on_change is not None:
            self.on_change(key, True, gone)

    def observe_response(self, key: PodKey, status: int, connect_failure: bool, now: float) -> None:
        s = self._state(key)
        if connect_failure:
            self._eject(key, s, now, refused=True)
        elif status >= 500:
            s.bad_responses += 1
            if s.bad_responses >= self.failures_to_eject:
                self._eject(key, s, now)
        elif status > 0:
            s.bad_responses = 0
            if not s.healthy:  # it answered: it is back
                self._admit(key, s)

    def observe_scrape(self, key: PodKey, ok: bool, connect_refused: bool, now: float) -> None:
        s = self._state(key)
        if ok:
            s.bad_scrapes = 0
            if not s.healthy:
                self._admit(key, s)
        elif connect_refused:
            self._eject(key, s, now, refused=True)
        else:
            s.bad_scrapes += 1
            if s.bad_scrapes >= self.failures_to_eject:
                self._eject(key, s, now)

    def due_probes(self, now: float) -> list[PodKey]:
        return [k for k, s in self._pods.items() if not s.healthy and s.next_probe <= now]

    def probe_result(self, key: PodKey, ok: bool, now: float) -> None:
        s = self._state(key)
        if ok:
            self._admit(key, s)
        else:
            s.backoff = min(self.probe_max, max(self.probe_initial, s.backoff * 2))
            s.next_probe = now + s.backoff

    def forget(self, live: Iterable[PodKey]) -> None:
        live = set(live)
        for key in [k for k in self._pods if k not in live]:
            del self._pods[key]
