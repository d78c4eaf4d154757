"""Summary statistics as AIBrix's benchmark computes them (numpy's default, linear percentile)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """numpy.percentile(values, p) with the default "linear" method, without numpy on the benchmark path."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Summary:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        return cls(sum(values) / len(values), *(percentile(values, p) for p in PERCENTILES))

    def as_fields(self) -> dict[str, float]:
        return {"mean": self.mean, "P50": self.p50, "P90": self.p90, "P99": self.p99}
