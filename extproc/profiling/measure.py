"""A finished cell's requests → its five AIBrix metric lines. Pure."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from extproc.profiling.client import RequestResult
from extproc.profiling.records import MetricLine
from extproc.profiling.stats import Summary
from extproc.profiling.workload import Cell

MIN_STEADY = 10  # completions an admitted cell's held interval needs to be read alone (`_steady`)


@dataclass(slots=True)
class CellOutcome:
    cell: Cell
    planned: int  # requests the cell was to send
    results: list[RequestResult]  # finished requests, successful or not
    duration: float  # seconds from the first send to the last completion (or to the cut-off)
    unfinished: int = 0  # cancelled or never sent because the cell was cut off
    overloaded: str = ""  # why the cell was cut off: it could not keep up with its rate
    errors: Counter[str] = field(default_factory=Counter)
    held: int | None = None  # admitted: the requests the closed loop keeps in flight (its budget)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def failed(self) -> int:
        return len(self.results) - len(self.ok)


def cell_lines(outcome: CellOutcome, model: str, seed: int, temperature: float = 0.0) -> list[MetricLine]:
    """TPUT and TT over the cell's wall time (as AIBrix: completions / duration); latencies over successes.

    TPOT is per request, (last token - first token) / (tokens - 1), and its statistics are over requests:
    vLLM's benchmark's TPOT, and the statistic the SLO is held to everywhere else (the gateways' traces,
    the SLO router, the fleet simulation's attainment). AIBrix's benchmark pools every gap between tokens
    instead (vLLM's ITL): a P99 of that counts the one gap in a hundred where another request's prefill
    stalled the batch, which a request's TPOT averages out, so a profile held to "P99 TPOT" in AIBrix's
    sense plans about twice the fleet the same SLO needs (docs/profiling.md). A request that streamed one
    token has no TPOT; with none at all TPOT is 0.0, as AIBrix. With no successful request the latency
    lines have null statistics: nothing was measured, and gen-profile lets such a rate pass nothing.

    An admitted cell (a closed loop holding `held` requests in flight) reads its throughput while the
    replica held the budget (`_steady`), not over the whole run: the run's ramp up and its drain are the
    benchmark's, not the replica's, and over N requests at a budget of k they cut the rate by about
    N / (N + k) (a quarter at 100 and 32) below what a replica the router keeps at that budget serves.
    """
    c, ok = outcome.cell, outcome.ok
    extra: dict[str, object] = {"seed": seed, "model": model, "temperature": temperature,
                                "samples": outcome.planned, "failed": outcome.failed,
                                "unfinished": outcome.unfinished}
    if outcome.overloaded:
        extra["overloaded"] = outcome.overloaded

    def line(metric: str, stats: dict[str, float | None]) -> MetricLine:
        return MetricLine(c.input_tokens, c.output_tokens, c.rate, metric, stats, extra)

    def summary(values: Sequence[float]) -> dict[str, float | None]:
        if not ok:
            return dict.fromkeys(("mean", "P50", "P90", "P99"))
        return Summary.of(values or [0.0]).as_fields()

    done, tokens, seconds = served(outcome)
    return [
        line("TPUT", {"mean": done / seconds}),
        line("TT", {"mean": tokens / seconds}),
        line("E2E", summary([r.e2e for r in ok])),
        line("TTFT", summary([r.ttft for r in ok if r.ttft is not None])),
        line("TPOT", summary([math.fsum(r.gaps) / len(r.gaps) for r in ok if r.gaps])),
    ]


def served(outcome: CellOutcome) -> tuple[int, int, float]:
    """(completions, output tokens, seconds) the cell's TPUT and TT divide: an admitted cell's while its
    budget was held (`_steady`), else the whole run's (AIBrix's: first send to last completion)."""
    ok = outcome.ok
    return _steady(outcome) or (len(ok), sum(r.output_tokens for r in ok), max(outcome.duration, 1e-9))


def _steady(outcome: CellOutcome) -> tuple[int, int, float] | None:
    """(completions, output tokens, seconds) between the send that filled the budget (the held-th) and the
    last send: every client busy, so requests end at the rate a replica held at the budget serves. None
    (read the whole run) when not a closed loop, or the budget was never held long enough to count
    MIN_STEADY completions (a budget near the sample count is all ramp and drain)."""
    k = outcome.held
    if not k:
        return None
    starts = sorted(r.start for r in outcome.results)
    if len(starts) <= k:
        return None
    begin, end = starts[k - 1], starts[-1]
    inside = [r for r in outcome.ok if begin < r.end <= end]
    if len(inside) < MIN_STEADY:  # (none can end inside an empty interval)
        return None
    return len(inside), sum(r.output_tokens for r in inside), end - begin
