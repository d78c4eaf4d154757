"""AIBrix's gen_profile selection rule: for each (output, input) cell, the request rate whose measurements
meet every SLO, and what the profile records there. Pure.

The rule of AIBrix's python/aibrix/aibrix/gpu_optimizer/optimizer/profiling/gen_profile.py, so profiles
agree across tools:
- TPAT = E2E / (input + output tokens) is derived from every E2E line, for every statistic.
- A rate passes when, for each of TPUT, TT, E2E, TTFT, TPAT, TPOT, its line exists and meets the SLO: time
  metrics at the chosen statistic (P50/P90/P99, or the mean for percentile 0) strictly below the target,
  throughput metrics by their mean at or above it. An unset SLO is +inf (time) or 0 (throughput), so a
  rate missing any metric's line, or with a null statistic, passes nothing.
- Of the passing rates, the highest whose mean TPUT ≥ 0.9 × rate (it kept up with its arrivals); when none
  kept up, the lowest passing rate.
- tputs = mean TPUT there, 0 when no rate passes; e2e = mean E2E there, or at the cell's first (lowest) rate
  with an E2E measurement when none passes; ttft likewise, recorded only when a TTFT SLO is set.
- Ours, beside AIBrix's keys: tpot = mean TPOT at the same rate (or the first rate with a TPOT line),
  always recorded; with a `benchmark --admitted` run, at the kept budget where that run's rate was kept
  (`admitted`): the TPOT of a pod the router holds at that budget. Under a TPOT SLO the router expects
  a request's TPOT from it; the e2e alone holds the prefill, so a long prompt with a short answer would
  read as breached before it ran.

Where AIBrix is undefined we choose: a line repeated for the same cell, rate and metric (an --append re-run)
replaces the earlier one; a cell with no E2E measurement at all gets e2e 0.0 and a warning, not a crash.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from extproc.gpu_profiles import BUDGET_MARGIN, little_budget
from extproc.profiling.records import METRICS, THROUGHPUT_METRICS, BenchmarkError, MetricLine

SLO_METRICS = ("TPUT", "TT", "E2E", "TTFT", "TPAT", "TPOT")  # AIBrix's order; options: lower-case
SLO_HELP = {
    "TPUT": "throughput SLO: mean completed requests/s at least this",
    "TT": "token throughput SLO: mean output tokens/s at least this",
    "E2E": "end-to-end latency SLO, seconds (strictly below)",
    "TTFT": "time-to-first-token SLO, seconds (strictly below)",
    "TPAT": "time per token of input + output (E2E / tokens) SLO, seconds (strictly below)",
    "TPOT": "time per output token SLO, seconds (strictly below)",
}
PERCENTILES = (0, 50, 90, 99)
TPUT_TOLERANCE = 0.9  # a rate "kept up" when it completed at least 90% of its arrival rate


@dataclass(frozen=True, slots=True)
class SLOs:
    percentile: int = 0  # 0: compare means
    targets: Mapping[str, float] | None = None  # lower-case metric name → target; only the SLOs set

    def __post_init__(self) -> None:
        if self.percentile not in PERCENTILES:
            raise ValueError(f"percentile must be one of {PERCENTILES}, not {self.percentile}")
        for name, value in (self.targets or {}).items():
            if name.upper() not in SLO_METRICS or name != name.lower():
                raise ValueError(f"unknown SLO {name!r}; known: {', '.join(m.lower() for m in SLO_METRICS)}")
            if math.isnan(value) or value < 0 or (value == 0 and name.upper() not in THROUGHPUT_METRICS):
                raise ValueError(f"SLO {name} must be a positive number, not {value}")

    def target(self, metric: str) -> float:
        """The bound a metric is checked against; unset: AIBrix's defaults (inf for time, 0 for rates)."""
        default = 0.0 if metric in THROUGHPUT_METRICS else math.inf
        return (self.targets or {}).get(metric.lower(), default)

    def is_set(self, metric: str) -> bool:
        default = 0.0 if metric in THROUGHPUT_METRICS else math.inf
        return self.target(metric) != default

    @classmethod
    def of_profile(cls, slos: Mapping[str, float]) -> SLOs:
        """From a profile's `slos` (`as_profile`'s shape)."""
        return cls(int(slos.get("percentile", 0)),
                   {k: float(v) for k, v in slos.items() if k != "percentile"})

    @property
    def stat_key(self) -> str:
        return f"P{self.percentile}" if self.percentile else "mean"

    def passes(self, metric: str, line: MetricLine | None) -> bool:
        if line is None:
            return False
        if metric in THROUGHPUT_METRICS:
            value = line.stat("mean")
            return value is not None and value >= self.target(metric)
        value = line.stat(self.stat_key)
        return value is not None and value < self.target(metric)

    def scaled(self, share: float) -> SLOs:
        """The same SLOs with each latency target `share` times as tight (throughput floors unchanged)."""
        return SLOs(self.percentile, {k: v if k.upper() in THROUGHPUT_METRICS else v * share
                                      for k, v in (self.targets or {}).items()})

    def as_profile(self) -> dict[str, float]:
        """The profile's `slos`: the percentile, then each SLO that is set, in AIBrix's order."""
        out: dict[str, float] = {"percentile": self.percentile}
        out.update((m.lower(), self.target(m)) for m in SLO_METRICS if self.is_set(m))
        return out


@dataclass(frozen=True, slots=True)
class Grid:
    """Per (output index, input index), as the profile stores them."""

    outputs: tuple[int, ...]
    inputs: tuple[int, ...]
    tputs: tuple[tuple[float, ...], ...]
    e2e: tuple[tuple[float, ...], ...]
    ttft: tuple[tuple[float, ...], ...] | None
    tpot: tuple[tuple[float, ...], ...]
    rates: tuple[tuple[float | None, ...], ...]  # the chosen request rate; None when no rate passed
    warnings: tuple[str, ...] = ()


Key = tuple[int, int, float, str]  # input, output, rate, metric


def index_lines(lines: Iterable[MetricLine]) -> dict[Key, MetricLine]:
    """Lines by (input, output, rate, metric), later lines replacing earlier ones, plus the derived TPAT."""
    table: dict[Key, MetricLine] = {}
    for line in lines:
        table[(line.input_tokens, line.output_tokens, line.request_rate, line.metric)] = line
    for (i, o, r, metric), line in list(table.items()):
        if metric == "E2E" and i + o > 0:
            stats = {k: (None if v is None else v / (i + o)) for k, v in line.stats.items()}
            table[(i, o, r, "TPAT")] = MetricLine(i, o, r, "TPAT", stats, line.extra)
    return table


def check_metrics(lines: Sequence[MetricLine], source: str) -> None:
    """Every rate needs all five measured metrics to pass; a file lacking one cannot yield a profile."""
    present = {line.metric for line in lines}
    missing = [m for m in METRICS if m not in present]
    if missing:
        raise BenchmarkError(f"{source}: no {', '.join(missing)} lines; every rate needs "
                             f"{', '.join(METRICS)} (as AIBrix's benchmark writes them)")


def select(lines: Sequence[MetricLine], slos: SLOs, source: str = "benchmark") -> Grid:
    check_metrics(lines, source)
    table = index_lines(lines)
    inputs = tuple(sorted({line.input_tokens for line in lines}))
    outputs = tuple(sorted({line.output_tokens for line in lines}))
    rates_of: dict[tuple[int, int], set[float]] = {}
    for i, o, r, _ in table:
        rates_of.setdefault((i, o), set()).add(r)
    warnings: list[str] = []

    def mean(i: int, o: int, r: float, metric: str) -> float | None:
        line = table.get((i, o, r, metric))
        return None if line is None else line.stat("mean")

    def first_measured(i: int, o: int, metric: str, warn: bool = True) -> float:
        for r in sorted(rates_of.get((i, o), ())):
            if (value := mean(i, o, r, metric)) is not None:
                return value
        if warn:
            warnings.append(f"input {i}, output {o}: no {metric} measurement; {metric.lower()} recorded as 0")
        return 0.0

    tputs, e2es, ttfts, tpots, chosen = [], [], [], [], []
    for o in outputs:
        row_t, row_e, row_f, row_p, row_r = [], [], [], [], []
        for i in inputs:
            rates = sorted(rates_of.get((i, o), ()))
            passing = [r for r in rates if all(slos.passes(m, table.get((i, o, r, m))) for m in SLO_METRICS)]
            if passing:
                kept_up = [r for r in passing if (mean(i, o, r, "TPUT") or 0.0) >= r * TPUT_TOLERANCE]
                rate = max(kept_up) if kept_up else min(passing)
                row_t.append(mean(i, o, rate, "TPUT") or 0.0)
                row_e.append(mean(i, o, rate, "E2E") or 0.0)
                row_f.append(mean(i, o, rate, "TTFT") or 0.0)
                row_p.append(mean(i, o, rate, "TPOT") or 0.0)
                row_r.append(rate)
            else:
                row_t.append(0.0)
                row_e.append(first_measured(i, o, "E2E"))
                row_f.append(first_measured(i, o, "TTFT") if slos.is_set("TTFT") else 0.0)
                row_p.append(first_measured(i, o, "TPOT", warn=False))  # not served: never read
                row_r.append(None)
        tputs.append(tuple(row_t))
        e2es.append(tuple(row_e))
        ttfts.append(tuple(row_f))
        tpots.append(tuple(row_p))
        chosen.append(tuple(row_r))
    return Grid(outputs, inputs, tuple(tputs), tuple(e2es), tuple(ttfts) if slos.is_set("TTFT") else None,
                tuple(tpots), tuple(chosen), tuple(warnings))



ADMITTED_KEY = "concurrency"  # our benchmark lines of a replica held at its per-pod budget carry this
BUDGET_FACTORS = (1, 2, 4, 8)  # the budgets a --admitted run tries per cell: Little's budget times these


# Past the factors a budget that met the SLO and still served more than the one before is doubled again
# (`climb_to`): a replica that batches well meets a TPOT SLO at budgets far above 8x Little's budget, and
# a ladder cut there leaves the largest passing budget unknown (and the kept one, half of it, low). With a
# largest budget (`--max-budget`) every cell climbs; without it a cell whose rate run met the SLO climbs
# only from a rung whose latency is at most CLIMB_ROOM of each target (LoadPlan.climb_needs_room).
CLIMB_GAIN = 1.1  # ... when it served at least 10 % more requests/s than the budget half its size
# A rung at most this share of each latency target: at twice the budget, a replica whose time per token
# grows no faster than its batch still meets it, so the ladder stopped there, not the replica.
CLIMB_ROOM = 0.5


def climb_to(lines: Iterable[MetricLine], below: Iterable[MetricLine] | None, slos: SLOs,
             budget: int, max_budget: int, room: float = 1.0) -> int | None:
    """The next budget of a cell's ladder after `budget` ran (its `lines`; `below`: the rung before's),
    or None: it missed an SLO, served under CLIMB_GAIN x the rung before, or 2 x budget passes the cap;
    `room` < 1: also when a latency is over `room` x its target."""
    lines = list(lines)
    if 2 * budget > max_budget or not rung_passes(lines, slos, room):
        return None

    def tput(rung: Iterable[MetricLine]) -> float:
        return next((x.stat("mean") or 0.0 for x in rung if x.metric == "TPUT"), 0.0)
    if below is not None and tput(lines) < CLIMB_GAIN * tput(below):
        return None
    return 2 * budget


def rung_passes(lines: Iterable[MetricLine], slos: SLOs, room: float = 1.0) -> bool:
    """Every SLO met by one cell's lines (gen-profile's test, TPAT derived as it derives it), each latency
    within `room` x its target."""
    table = index_lines(lines)
    if not table:
        return False
    i, o, r, _ = next(iter(table))
    within = slos.scaled(room)
    return all(within.passes(m, table.get((i, o, r, m))) for m in SLO_METRICS)


def budget_ladder(tput: float, e2e: float, factors: Sequence[float] = BUDGET_FACTORS) -> list[int]:
    """The per-pod budgets to measure a cell at, ascending: Little's law on the benchmark's rate at the
    SLO (max(1, floor(tput x e2e))) times each factor. Beyond Little's budget because that rate is
    gen-profile's, which refuses rates whose runs drain past 0.9 x the rate: a replica that batches well
    meets the SLO at several times the requests in flight that rate implies."""
    k = little_budget(tput, e2e)
    return sorted({max(1, round(k * f)) for f in factors})


@dataclass(frozen=True, slots=True)
class Admitted:
    """A profile's admitted fields: per cell, the requests/s (`tputs_admitted`) and the budget it was
    measured at (`concurrency_admitted`)."""

    tputs: tuple[tuple[float, ...], ...]
    budgets: tuple[tuple[float, ...], ...]
    most: tuple[tuple[float, ...], ...]  # per cell, the best requests/s of any budget that passed
    tpot: tuple[tuple[float, ...], ...]  # per cell, the mean TPOT where the rate was read (`admitted`)


def admitted(lines: Iterable[MetricLine], slos: SLOs, outputs: Sequence[int], inputs: Sequence[int],
             tputs: Sequence[Sequence[float]], e2e: Sequence[Sequence[float]] | None,
             margin: float = BUDGET_MARGIN, tpot: Sequence[Sequence[float]] | None = None) -> Admitted:
    """Per cell, of the runs of the replica held at a budget (lines carrying ADMITTED_KEY) where every SLO
    passes, those at no more than 1/margin of the largest passing budget (the smallest passing one
    when none is), the one with the highest requests/s, and its budget. Where none passes, or the best is
    below `tputs`: `tputs` at Little's budget. Beside them, per cell, the best requests/s of any passing
    budget (at least the kept one's): what the SLO router may reach admitting past the kept budget; and
    the mean TPOT at the kept budget, what a request sees on a pod the router holds there (`tpot`, the
    rate run's, where that run's rate is kept; NaN, unknown, without it)."""
    table = index_lines(line for line in lines if ADMITTED_KEY in line.extra)
    rates, budgets, most, tpots = [], [], [], []
    for o_idx, o in enumerate(outputs):
        row_t, row_k, row_m, row_p = [], [], [], []
        for i_idx, i in enumerate(inputs):
            base = tputs[o_idx][i_idx]
            best = (base, little_budget(base, e2e[o_idx][i_idx] if e2e is not None else math.nan))
            passing = [(table[(i, o, r, "TPUT")].stat("mean") or 0.0, int(r))
                       for r in sorted({r for (ii, oo, r, _) in table if (ii, oo) == (i, o)})
                       if all(slos.passes(m, table.get((i, o, r, m))) for m in SLO_METRICS)]
            per_token = tpot[o_idx][i_idx] if tpot is not None else math.nan
            if passing:
                top = passing[-1][1]
                kept = [p for p in passing if p[1] * margin <= top] or passing[:1]
                best = max([best, *kept])
                if best in kept:  # passing: its TPOT line exists
                    per_token = table[(i, o, float(best[1]), "TPOT")].stat("mean") or per_token
            row_t.append(best[0])
            row_k.append(float(best[1]))
            row_m.append(max([best[0], *(t for t, _ in passing)]))
            row_p.append(per_token)
        rates.append(tuple(row_t))
        budgets.append(tuple(row_k))
        most.append(tuple(row_m))
        tpots.append(tuple(row_p))
    return Admitted(tuple(rates), tuple(budgets), tuple(most), tuple(tpots))
