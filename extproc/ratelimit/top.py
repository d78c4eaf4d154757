"""The budgets closest to empty, for the dashboard: `extproc_rate_limit_remaining_ratio{model, limit,
rank}`, the lowest remaining fractions (rank 1 = the most used) among budgets seen in the last window.
Labelled by rank, never by subject: no client-chosen label values, a bounded series count."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily

from extproc.ratelimit.bucket import WINDOW_S, Verdict
from extproc.ratelimit.settings import Limits

TOP = 5
MAX_TRACKED = 10_000


class TopBudgets:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        # bucket_id -> (model, limits, requests left, tokens left, when); insertion order = oldest first
        self._seen: dict[str, tuple[str, Limits, float, float, float]] = {}

    def saw(self, model: str, bucket_id: str, limits: Limits, v: Verdict) -> None:
        self._seen.pop(bucket_id, None)
        self._seen[bucket_id] = (model, limits, v.requests, v.tokens, self._clock())
        while len(self._seen) > MAX_TRACKED:
            del self._seen[next(iter(self._seen))]

    def ratios(self) -> dict[tuple[str, str], list[float]]:
        """(model, limit) -> the lowest remaining fractions now (refilled since seen), ascending."""
        now = self._clock()
        out: dict[tuple[str, str], list[float]] = {}
        for bucket_id, (model, limits, requests, tokens, when) in list(self._seen.items()):
            elapsed = now - when
            if elapsed >= WINDOW_S:
                del self._seen[bucket_id]  # full again by now
                continue
            for name, limit, left in (("requests", limits.requests, requests),
                                      ("tokens", limits.tokens, tokens)):
                if limit:
                    ratio = min(1.0, max(0.0, left + elapsed * limit / WINDOW_S) / limit)
                    out.setdefault((model, name), []).append(ratio)
        return {k: sorted(v)[:TOP] for k, v in out.items()}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "extproc_rate_limit_remaining_ratio", "Remaining fraction of the most used rate-limit "
            "budgets seen in the last minute, by model, limit and rank (1 = the least left)",
            labels=["model", "limit", "rank"])
        for (model, limit), ratios in sorted(self.ratios().items()):
            for rank, ratio in enumerate(ratios, 1):
                family.add_metric([model, limit, str(rank)], ratio)
        yield family
