"""In-flight counts held against the engines' own: what a lost access-log record leaves behind.

The gateway releases a request when Envoy's access-log record for it arrives. When the Envoy that
routed it dies (SIGKILL, OOM, a rollout), those records never come and the request would stay
counted until `gateway.request_timeout_seconds`. The engines know better: vLLM's
`num_requests_running + num_requests_waiting` is every request it holds.

Each scrape is held against this gateway's requests on the pod that were routed before the scrape
was *sent* and had not ended when it was read (still open, or ended after it was sent by Envoy's
duration): unless lost, every one of those is in the engine's count, whatever the load. The gateway
judges a scrape at the next one, once the records of requests that ended just before it have come
in (server/gateway.py). (Counting only requests older than a grace of seconds, as before, let the
requests routed during the grace hide as many phantoms: under continuing load the counts stayed
double after an Envoy restart for as long as the load went on.)

A release needs the excess on several scrapes in a row: `scrapes` (3) above a tolerance, or
`patience` (5) of at least one; the smallest excess of the run is released, oldest first (phantoms
predate the fault), from this gateway's own requests; with other gateways on a busy pod only this
gateway's share (its part of the pod's count), so two gateways never both release one excess.
Pure and clock-free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from extproc.pool.pod import PodKey
from extproc.telemetry.engine_metrics import EngineSample

# An excess under this part of the pod's count (at least 2) needs `patience` scrapes, not `scrapes`:
# other gateways' counts a Redis sync behind, or a record on its way, are rarely larger.
TOLERANCE = 0.05


@dataclass(slots=True)
class _Streak:
    at: float = -1.0  # time of the last scrape counted
    excess: list[int] = field(default_factory=list)


class Reconciler:
    def __init__(self, scrapes: int = 3, grace_s: float = 3.0, patience: int = 5) -> None:
        if scrapes < 1 or patience < scrapes or grace_s < 0:
            raise ValueError("scrapes must be >= 1, patience >= scrapes and grace_s >= 0")
        self.scrapes, self.grace_s, self.patience = scrapes, grace_s, patience
        self._streaks: dict[PodKey, _Streak] = {}

    def suspect(self, key: PodKey, counted: int, sample: EngineSample | None) -> bool:
        """Does the engine hold fewer requests than the gateways count on the pod (worth looking at
        which)? When it does not, or reports nothing, the pod's run of scrapes starts again."""
        if sample is not None and sample.running is not None and counted > _held(sample):
            return True
        self._streaks.pop(key, None)
        return False

    def excess(self, key: PodKey, ours: int, others: int, sample: EngineSample,
               counted: int | None = None) -> int:
        """How many of this gateway's requests on a suspect pod to release now: `ours` is how many
        it routed there before `cutoff(sample)` and still holds open, `counted` all it holds there
        (`ours` when not given), `others` what other gateways hold there. Returns 0 unless, on each
        of the last `scrapes` scrapes, the engine held fewer than that by at least a tolerance (1
        when the engine was idle, else the larger of 2 and a twentieth of the count: a request
        whose record is still on its way, or another gateway's whose count in Redis is a sync
        behind, is not a phantom), or on each of the last `patience` by at least one. Then the
        smallest excess of those scrapes, or with other gateways' requests on a busy pod this
        gateway's share of it (`counted` of the count)."""
        streak = self._streaks.setdefault(key, _Streak())
        if sample.at <= streak.at:
            return 0  # the same scrape as last time: no new evidence
        streak.at = sample.at
        held = _held(sample)
        over = int(ours - max(0.0, held - others))
        tolerance = 1 if held <= 0 else max(2, math.ceil(TOLERANCE * (ours + others)))
        if over < 1:
            streak.excess.clear()
            return 0
        streak.excess.append(over)
        recent = streak.excess[-self.scrapes:]
        if len(recent) == self.scrapes and min(recent) >= tolerance:
            n = min(recent)
        elif len(streak.excess) >= self.patience:  # a small excess that never goes: phantoms too
            n = min(streak.excess[-self.patience:])
        else:
            return 0
        streak.excess.clear()  # the next release needs a fresh run of scrapes
        if held > 0 and others > 0:  # the excess may be other gateways' phantoms too: our share
            mine = ours if counted is None else max(ours, counted)
            n = min(n, math.floor(n * mine / (mine + others) + 0.5))
        return n

    def cutoff(self, sample: EngineSample) -> float:
        """Requests routed before this are in the engine's count unless lost: the scrape's send
        time, or (a sample that does not know it) its arrival less the grace."""
        return sample.sent if sample.sent is not None else sample.at - self.grace_s

    def forget(self, live: Iterable[PodKey]) -> None:
        live = set(live)
        for key in [k for k in self._streaks if k not in live]:
            del self._streaks[key]


def _held(sample: EngineSample) -> float:
    """Every request the engine holds: running and queued."""
    return (sample.running or 0.0) + (sample.waiting or 0.0)
