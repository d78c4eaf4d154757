"""`throughput`: the pod that produced the fewest output tokens per second lately wins (the tally's
tokens of requests finished in the last 10 s). Blind to GPU speed, like least-request; useful to
spread token load across equal replicas."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from extproc.openai import Request
from extproc.pool.pod import PodKey
from extproc.routing.framework import BuildContext, PodView, Profile, register
from extproc.routing.load_math import LowestScorePicker
from extproc.vocabulary import RequestRecord

WINDOW_SECONDS = 10.0


class RecentTokens:
    """Output tokens per pod over the last WINDOW_SECONDS (kept in RoutingState: survives reloads)."""

    def __init__(self) -> None:
        self._events: dict[PodKey, deque[tuple[float, int]]] = {}
        self._sums: dict[PodKey, int] = {}

    def post_response(self, record: RequestRecord, now: float) -> None:
        if record.output_tokens:
            key = record.pod.key
            self._events.setdefault(key, deque()).append((now, record.output_tokens))
            self._sums[key] = self._sums.get(key, 0) + record.output_tokens
            # Trimmed here too: every built strategy's hooks see every response (the gateway builds all
            # of them to validate a config), so a pool that never routes by throughput must not grow.
            self._expire(key, now)

    def rate(self, key: PodKey, now: float) -> float:
        if not self._events.get(key):
            return 0.0
        self._expire(key, now)
        return self._sums[key] / WINDOW_SECONDS

    def __len__(self) -> int:
        """Events held, over every pod (bounded by the window)."""
        return sum(map(len, self._events.values()))

    def _expire(self, key: PodKey, now: float) -> None:
        events, horizon = self._events[key], now - WINDOW_SECONDS
        while events and events[0][0] <= horizon:
            self._sums[key] -= events.popleft()[1]


class ThroughputScorer:
    lower_is_better = True

    def __init__(self, recent: RecentTokens) -> None:
        self.recent = recent

    def score(self, request: Request, pods: Sequence[PodView], now: float) -> list[float]:
        return [self.recent.rate(p.pod.key, now) for p in pods]


@register("throughput")
def build(ctx: BuildContext) -> Profile:
    recent = ctx.store.slot("throughput", RecentTokens)
    return Profile("throughput", LowestScorePicker(ctx.rng),
                   scorers=[(ThroughputScorer(recent), 1.0)], hooks_of=[recent])
