"""What the fleet is asked to serve: request rates per (input, output) shape.

Two sources: a workload file for `extproc optimize`, and the gateway's request traces (AIBrix's Redis
layout, see extproc.tracing) for the service. Traces become rates over a sliding window: the average,
or max(average, latest window) when the latest windows are a burst, so the plan scales up within two
windows and down only slowly, and a steady load is read as itself. Given a judge of strain, a burst the
fleet absorbs unstrained is left to the router's margin instead (read_workload).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.optimizer.solver import Demand
from extproc.tracing.window import LATENCY_KEYS, REJECTED_KEY

DEFAULT_WINDOW_SECONDS = 240.0  # AIBrix's ModelMonitor window
_CELL = re.compile(r"^(\d+):(\d+)$")


class WorkloadError(ValueError):
    """A workload file or trace that cannot be read; the message says where."""


def _rate(value: Any, where: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise WorkloadError(f"{where}: expected a finite non-negative number, got {value!r}")
    return float(value)


def parse_workload(data: Any) -> list[Demand]:
    """`{"rates": [{"input_tokens": 128, "output_tokens": 64, "rps": 5.0}, ...]}` → demands."""
    if not isinstance(data, Mapping) or not isinstance(data.get("rates"), list):
        raise WorkloadError('workload: expected {"rates": [{"input_tokens", "output_tokens", "rps"}, ...]}')
    out = []
    for k, row in enumerate(data["rates"]):
        where = f"rates[{k}]"
        if not isinstance(row, Mapping):
            raise WorkloadError(f"{where}: expected an object")
        for key in ("input_tokens", "output_tokens", "rps"):
            if key not in row:
                raise WorkloadError(f"{where}.{key}: missing")
        out.append(
            Demand(
                _rate(row["input_tokens"], f"{where}.input_tokens"),
                _rate(row["output_tokens"], f"{where}.output_tokens"),
                _rate(row["rps"], f"{where}.rps"),
            )
        )
    return out


def load_workload(path: str | Path) -> list[Demand]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WorkloadError(f"{path}: {e}") from e
    try:
        return parse_workload(data)
    except WorkloadError as e:
        raise WorkloadError(f"{path}: {e}") from e


@dataclass(frozen=True, slots=True)
class TraceWindow:
    """One 10-second window of one model, as the gateway wrote it."""

    end: int  # unix seconds, from the key
    counts: dict[tuple[int, int], int]  # (input bucket, output bucket) → completed requests
    precision: int  # buckets per doubling: tokens = 2 ** (bucket / precision)
    interval: int  # seconds the window covers
    arrived: int  # meta_total_reqs (v3+); the completed count for older traces
    pending: int
    queueing: int
    tpot: dict[str, dict[int, int]] = field(default_factory=dict)  # meta_tpot (ours): deployment -> histogram
    rejected: dict[str, int] = field(default_factory=dict)  # meta_rejected (ours): deployment -> refused
    ttft: dict[str, dict[int, int]] = field(default_factory=dict)  # meta_ttft (ours), as tpot
    e2e: dict[str, dict[int, int]] = field(default_factory=dict)  # meta_e2e (ours), as tpot
    tpat: dict[str, dict[int, int]] = field(default_factory=dict)  # meta_tpat (ours): E2E / every token

    def latency(self, metric: str) -> dict[str, dict[int, int]]:
        """Per deployment, the histogram of "tpot", "ttft", "e2e" or "tpat" (tracing.window.LATENCY_KEYS:
        each is the field of that name)."""
        if metric not in LATENCY_KEYS:
            raise KeyError(metric)
        return getattr(self, metric)

    @property
    def completed(self) -> int:
        return sum(self.counts.values())


def parse_trace(end: int, data: Any) -> TraceWindow:
    """AIBrix's trace JSON. Versions 1–4 are read the way AIBrix's GatewayLoadReader reads them."""
    if not isinstance(data, Mapping):
        raise WorkloadError(f"trace {end}: expected a JSON object")

    def meta(key: str, default: int) -> int:
        v = data.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise WorkloadError(f"trace {end}: {key} must be a number, got {v!r}")
        return int(v)

    version = meta("meta_v", 1)
    precision = meta("meta_precision", 1)
    interval = meta("meta_interval_sec", 10) if version >= 2 else 10
    if precision <= 0 or interval <= 0:
        raise WorkloadError(f"trace {end}: meta_precision and meta_interval_sec must be positive")
    counts: dict[tuple[int, int], int] = {}
    for k, v in data.items():
        if k.startswith("meta_"):
            continue  # AIBrix skips every meta_ key it does not read; so do we
        m = _CELL.match(k)
        if m is None or isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise WorkloadError(f'trace {end}: unexpected entry {k!r}: {v!r} (expected "<int>:<int>": count)')
        cell = (int(m.group(1)), int(m.group(2)))
        counts[cell] = counts.get(cell, 0) + v
    completed = sum(counts.values())
    arrived = meta("meta_total_reqs", completed) if version >= 3 else completed
    hists = {m: _histograms(end, key, data.get(key)) for m, key in LATENCY_KEYS.items()}
    return TraceWindow(end, counts, precision, interval, arrived, meta("meta_pending_reqs", 0),
                       meta("meta_queueing_reqs", 0), hists["tpot"], _rejected(end, data.get(REJECTED_KEY)),
                       hists["ttft"], hists["e2e"], hists["tpat"])


def _rejected(end: int, raw: Any) -> dict[str, int]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(_count(n) for n in raw.values()):
        raise WorkloadError(f'trace {end}: {REJECTED_KEY} must be {{"<deployment>": count}}')
    return {str(d): n for d, n in raw.items()}


def _histograms(end: int, key: str, raw: Any) -> dict[str, dict[int, int]]:
    if raw is None:
        return {}
    bad = WorkloadError(f'trace {end}: {key} must be {{"<deployment>": {{"<bucket>": count}}}}')
    if not isinstance(raw, Mapping):
        raise bad
    out: dict[str, dict[int, int]] = {}
    for dep, hist in raw.items():
        if not isinstance(hist, Mapping):
            raise bad
        try:
            out[str(dep)] = {int(b): n for b, n in hist.items() if _count(n)}
        except ValueError:
            raise bad from None
        if len(out[str(dep)]) != len(hist):
            raise bad
    return out


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _tokens(b: int, precision: int) -> float:
    return 2.0 ** (b / precision) if b > 0 else 1.0


BURST_SIGMAS = 2.0  # the latest window counts as a change only this many Poisson sigmas above the average
# The windows the plan reads: this many window lengths back. Only the newest window length is averaged;
# the older one counts toward the level a burst stands above, and shows where a run of windows above it
# that starts the window began (_without_excursions).
READ_SPAN = 2
BURST_WINDOWS = 2  # ... and only when the window before it was above that line too (read_workload says why)


def _average(windows: Iterable[TraceWindow], span: float) -> dict[tuple[int, int, int], float]:
    """Requests/s per cell: the windows' completions over `span` seconds."""
    average: dict[tuple[int, int, int], float] = {}
    for w in windows:
        for (i, o), n in w.counts.items():
            key = (i, o, w.precision)
            average[key] = average.get(key, 0.0) + n / span
    return average


def _without_excursions(windows: Sequence[TraceWindow], earlier: Sequence[TraceWindow], interval: int,
                        covered: float) -> dict[tuple[int, int, int], float] | None:
    """The average without the windows above the level by over BURST_SIGMAS Poisson sigmas, when they
    are an excursion: a window at the level comes before them. The level is the median of every window
    read, `earlier` (the windows before the window) included, so a run above it is the new level only
    once it fills half of what is read (a whole window length), and a burst as long as half the window
    stays an excursion while it lasts and after. `earlier` also shows where a run above the level that
    starts the window began. None otherwise: no window above the level, or a run that goes back as far
    as the trace is read (or to a window not read), a level that moved down: averaged as is."""
    totals = {w.end: _total(w) for w in windows}
    before = {w.end: _total(w) for w in earlier}
    read = sorted([*totals.values(), *before.values()])
    level = read[len(read) // 2]  # so fewer than half the windows read can be above it
    line = level + BURST_SIGMAS * math.sqrt(level)
    high = {end for end, n in totals.items() if n > line}
    if not high:
        return None
    if min(totals) in high:  # walk back to where that run began
        end = min(totals) - interval
        while before.get(end, -1.0) > line:
            end -= interval
        if end not in before:
            return None
    return _average([w for w in windows if w.end not in high], covered - len(high) * interval)


def _total(w: TraceWindow) -> float:
    """The requests one window read (_reading's scale included)."""
    return math.fsum(_reading(w).values()) * w.interval


def _reading(w: TraceWindow) -> dict[tuple[int, int, int], float]:
    """One window's requests/s per cell, scaled up by arrivals/completions when requests arrive faster
    than they finish (completions are capped by the fleet's capacity; arrivals are not)."""
    scale = max(1.0, w.arrived / w.completed) if w.completed else 1.0
    return {(i, o, w.precision): n * scale / w.interval for (i, o), n in w.counts.items()}


@dataclass(frozen=True, slots=True)
class Burst:
    """The newest windows above the window's average by BURST_SIGMAS, back to back (read_workload)."""

    rps: float  # the newest window's requests/s
    level: float  # the window's average, the burst's own windows included
    planned: bool  # False: the fleet absorbs it unstrained, so it is left to the router's margin


@dataclass(frozen=True, slots=True)
class Workload:
    demands: list[Demand]
    burst: Burst | None = None  # what the plan made of a burst in the newest windows, for the operator


def trace_rates(
    windows: Iterable[TraceWindow], now: float, window_seconds: float = DEFAULT_WINDOW_SECONDS,
    strained: Callable[[Sequence[TraceWindow]], bool] | None = None,
) -> list[Demand]:
    """The demands of `read_workload`."""
    return read_workload(windows, now, window_seconds, strained).demands


def read_workload(
    windows: Iterable[TraceWindow], now: float, window_seconds: float = DEFAULT_WINDOW_SECONDS,
    strained: Callable[[Sequence[TraceWindow]], bool] | None = None,
) -> Workload:
    """Per-cell requests/s at `now`: the average over the window (over the part of it the trace covers,
    when the trace is younger), or, when the latest windows show a burst, max(average, latest) per cell
    with the total held to the latest total.

    The latest window counts only if it ended within two intervals of `now` (the newest one may not be
    written yet). Its rate is scaled up by arrivals/completions when requests arrive faster than they
    finish, so an overloaded fleet (completions capped by capacity) still scales up at once. It is a
    burst when its requests exceed what the average predicts for one window by more than BURST_SIGMAS
    Poisson standard deviations: a steady load read as max(average, latest) (AIBrix's rule) over-reads
    itself by about a tenth, every re-plan, and the plan buys that tenth. The window before it must
    exceed that too (BURST_WINDOWS): one window above 2 sigma is a false alarm in about 1 of 40
    re-plans of a steady load, and the autoscaler holds every count it is asked for through its
    scale-down stabilization (300 s, 30 re-plans), so single-window alarms would have the fleet run the
    maximum of its own noise; two in a row come about once in 2,000 re-plans, and a real burst is read
    one interval (10 s) later, well within the minute a replica takes to start.

    `strained(newest)`: whether the newest windows show the fleet falling short (requests refused, the
    SLO missed; planning.replan judges it). Given, a burst the fleet absorbs unstrained is left to the
    router, which admits past each pod's budget while its speed shows room: the burst is not read as
    the latest rate, and a full trace's windows above the level (the same 2 sigmas over the median of
    every window read: `windows` may reach back further than `window_seconds`, READ_SPAN windows), with
    a window at the level before them, are left out of the average, so the burst neither scales the
    fleet up nor, once over, keeps it up while it is still in the window. A replica added for a burst
    serves a minute later and the autoscaler keeps it 300 s after its last ask: for a burst the fleet
    holds, that buys nothing. A burst that strains the fleet is read at once, as without the judge; a
    rise that fills half the windows read (a window length, when READ_SPAN are read) is the new level
    (the median has moved) and is averaged in."""
    windows = list(windows)
    recent = [w for w in windows if now - window_seconds < w.end <= now + 1e-9]
    if not recent:
        return Workload([])
    newest = sorted(recent, key=lambda w: w.end, reverse=True)[:BURST_WINDOWS]
    latest = newest[0]
    fresh = latest.end >= now - 2 * latest.interval  # else the trace has been silent since
    # Over the time the windows cover: a trace younger than the window (the model's first minutes, or
    # its first requests after a silence longer than the window) is not diluted by time it never saw.
    # It ends at the newest window while that one is current (the window in progress is not written yet).
    first = min(recent, key=lambda w: w.end)
    covered = min(window_seconds, (latest.end if fresh else now) - (first.end - first.interval))
    average = _average(recent, covered)
    current: dict[tuple[int, int, int], float] = {}
    if fresh and latest.completed:
        current = _reading(latest)
    mean_total = math.fsum(average.values())
    expected = mean_total * latest.interval  # requests one window holds at the average rate
    above = expected + BURST_SIGMAS * math.sqrt(expected)
    # every one of the newest windows, back to back, above the line
    burst = bool(current) and len(newest) == BURST_WINDOWS and all(
        w.end == latest.end - k * latest.interval and _total(w) > above
        for k, w in enumerate(newest))
    absorbing = strained is not None and not strained(newest)
    if absorbing and covered >= window_seconds - 1e-9:
        earlier = [w for w in windows if w.end <= now - window_seconds]
        average = _without_excursions(recent, earlier, latest.interval, covered) or average
    if not burst or absorbing:
        rates = average
    else:
        rates = {key: max(average.get(key, 0.0), current.get(key, 0.0))
                 for key in set(average) | set(current)}
        # Per cell, the larger of two noisy figures: summed over hundreds of sparse cells that alone
        # would ask for several times the load. The total is held to the latest window's.
        total = math.fsum(rates.values())
        held = math.fsum(current.values())
        scale = held / total if total > held > 0 else 1.0
        rates = {key: r * scale for key, r in rates.items()}
    out = []
    for key in sorted(rates):
        i, o, precision = key
        if rates[key] > 0:
            out.append(Demand(_tokens(i, precision), _tokens(o, precision), rates[key], width=1 / precision))
    seen = Burst(math.fsum(current.values()), mean_total, planned=not absorbing) if burst else None
    return Workload(out, seen)
