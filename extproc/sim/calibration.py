"""Published vLLM measurements replayed against the engine model, in virtual time.

Each row of data/calibration/vllm_measurements.csv is one published figure (throughput, TTFT, TPOT, ...)
of one benchmark run (GPU, model, input/output lengths, concurrency or request rate, number of prompts).
`replay` runs that workload through the same `EngineDriver` the fleet simulation uses and `simulate`
computes the figure with the row's own definition (mean or median, per request or pooled), so
model and published numbers compare like for like.

The rows are split once, deterministically, into a fit part and a held-out part: a run's key (source,
GPU, model, workload) hashed with SHA-256, one run in three held out. Every figure of one run falls on
the same side, so a fit never sees the TTFT of the run whose TPOT it is judged on. `extproc engine-sim
calibrate --fit` fits on the fit part only; the held-out part shows how the model generalises.
"""

from __future__ import annotations

import csv
import hashlib
import heapq
import math
import random
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from extproc.sim.driver import EngineDriver
from extproc.sim.engine import Engine
from extproc.sim.gpus import get_gpu, override
from extproc.sim.models import get_model
from extproc.sim.perf import PerfModel, PerfParams
from extproc.sim.sequences import EngineConfig, SeqState, SimRequest

DEFAULT_CSV = Path(__file__).resolve().parents[2] / "data" / "calibration" / "vllm_measurements.csv"
HELDOUT_ONE_IN = 3  # one run in three is held out
PROMPTS_PER_SLOT = 10  # a row that does not state its number of prompts replays 10 per concurrent slot
FIGURES = ("output_throughput", "ttft", "tpot", "itl", "decode_rate", "throughput_speedup")
GIB = 1024**3

@dataclass(frozen=True, slots=True)
class Frontend:
    """vLLM's API server between a client's send and the engine's queue (HTTP, chat template, tokenising).
    It runs in its own process beside the engine, so it delays a request without holding the engine's
    steps. A fixed latency plus a share per stream it is already serving: the same event loop
    detokenises and sends every in-flight stream's tokens, so a new request waits longer when it is busy.
    Fitted with the engine's parameters by `extproc engine-sim calibrate --fit`."""

    latency_s: float = 0.0
    per_stream_s: float = 0.0

    def delay(self, in_flight: int) -> float:
        return self.latency_s + self.per_stream_s * in_flight


FRONTEND = Frontend(latency_s=0.0216, per_stream_s=0.00444)  # printed by `calibrate --fit`


@dataclass(frozen=True, slots=True)
class Workload:
    """One benchmark run: what `vllm bench serve` was asked to do (the replay's input)."""

    source_url: str
    gpu: str
    model: str
    input_tokens: int
    output_tokens: int  # mean generated per request
    max_output_tokens: int  # the cap (max_tokens); above the mean when requests stop at EOS
    concurrency: int  # --max-concurrency; a burst without one: the number of prompts
    request_rate: float | None  # requests per second (Poisson); None: infinite (send when a slot frees)
    num_prompts: int
    engine_args: tuple[tuple[str, str], ...] = ()

    def key(self) -> str:
        args = ";".join(f"{k}={v}" for k, v in self.engine_args)
        rate = "inf" if self.request_rate is None else f"{self.request_rate:g}"
        return "|".join((self.source_url, self.gpu, self.model, str(self.input_tokens),
                         str(self.output_tokens), str(self.max_output_tokens), str(self.concurrency), rate,
                         str(self.num_prompts), args))

    def output_lengths(self, seed: int = 0) -> list[int]:
        """Each request's output length. Fixed when every request ran to the cap (--ignore-eos). Below
        it, requests stopped at EOS: a share q runs to the cap and the rest stop uniformly in [1, cap],
        q chosen to keep the published mean (uniform in [1, 2 x mean - 1] when the mean is under half
        the cap). The spread matters: it desynchronises a closed loop's requests as in the benchmark."""
        cap, mean, n = self.max_output_tokens, self.output_tokens, self.num_prompts
        if mean >= cap:
            return [cap] * n
        rng = random.Random(seed)
        half = (cap + 1) / 2
        if mean < half:
            return [rng.randint(1, max(1, 2 * mean - 1)) for _ in range(n)]
        q = (mean - half) / (cap - half)
        return [cap if rng.random() < q else rng.randint(1, cap) for _ in range(n)]

    @property
    def split(self) -> str:
        digest = hashlib.sha256(self.key().encode()).digest()
        return "holdout" if int.from_bytes(digest[:8], "big") % HELDOUT_ONE_IN == 0 else "fit"


@dataclass(frozen=True, slots=True)
class Measurement:
    id: str
    workload: Workload
    figure: str  # one of FIGURES
    statistic: str  # mean | median | pooled | ratio
    value: float
    unit: str
    engine_version: str
    notes: str
    # Non-empty: a figure the model cannot be held to (the reason says why); reported, never fitted or
    # counted in the acceptance summaries.
    exclude_reason: str = ""

    @property
    def split(self) -> str:
        return self.workload.split

    @property
    def in_shared_calibration(self) -> bool:
        """Also one of the points in the team's shared calibration.md (checked to stay within 10 %)."""
        return "calibration.md" in self.notes


class CalibrationDataError(ValueError):
    """A row of the calibration CSV is malformed; the message names the row and the column."""


def load(path: Path = DEFAULT_CSV) -> list[Measurement]:
    with path.open(newline="", encoding="utf-8") as f:
        return [_parse(i, row) for i, row in enumerate(csv.DictReader(f), start=2)]


def _parse(line: int, row: dict[str, str]) -> Measurement:
    def need(column: str) -> str:
        value = (row.get(column) or "").strip()
        if not value:
            raise CalibrationDataError(f"line {line}: column {column!r} is empty")
        return value

    def number(column: str, kind: Callable[[str], float] = float) -> float:
        text = need(column)
        try:
            return kind(text)
        except ValueError:
            raise CalibrationDataError(f"line {line}: column {column!r} is not a number: {text!r}") from None

    figure = need("figure")
    if figure not in FIGURES:
        raise CalibrationDataError(f"line {line}: figure {figure!r} is not one of {', '.join(FIGURES)}")
    try:
        gpu, model = get_gpu(need("gpu")).name, get_model(need("model")).name
    except KeyError as e:
        raise CalibrationDataError(f"line {line}: {e.args[0]}") from None
    concurrency = int(number("concurrency", int))
    rate_text = need("request_rate")
    rate = None if rate_text == "inf" else number("request_rate")
    prompts = (row.get("num_prompts") or "").strip()
    args = tuple(
        tuple(item.split("=", 1)) for item in (row.get("engine_args") or "").split(";") if "=" in item
    )
    workload = Workload(
        source_url=need("source_url"), gpu=gpu, model=model,
        input_tokens=int(number("input_tokens", int)), output_tokens=int(number("output_tokens", int)),
        max_output_tokens=int(number("max_output_tokens", int)), concurrency=concurrency, request_rate=rate,
        num_prompts=int(prompts) if prompts else PROMPTS_PER_SLOT * concurrency,
        engine_args=tuple((k.strip(), v.strip()) for k, v in args),
    )
    return Measurement(
        id=need("id"), workload=workload, figure=figure, statistic=need("statistic"),
        value=number("value"), unit=need("unit"), engine_version=row.get("engine_version", ""),
        notes=row.get("notes", ""), exclude_reason=(row.get("exclude_reason") or "").strip(),
    )


# --- replay ----------------------------------------------------------------------------------------------
def vllm_serve_defaults(gpu: str) -> EngineConfig:
    """`vllm serve`'s scheduler defaults on this GPU (vllm/engine/arg_utils.py, get_batch_defaults):
    8192 batched tokens and 1024 sequences on parts with >= 70 GiB that are not A100s, else 2048 / 256."""
    spec = get_gpu(gpu)
    if spec.memory_bytes >= 70 * GIB and not spec.name.startswith("A100"):
        return EngineConfig(max_num_batched_tokens=8192, max_num_seqs=1024)
    return EngineConfig(max_num_batched_tokens=2048, max_num_seqs=256)


def build(workload: Workload, params: PerfParams) -> Engine:
    perf = PerfModel(get_gpu(workload.gpu), get_model(workload.model), 1, params)
    config = override(vllm_serve_defaults(workload.gpu), dict(workload.engine_args))
    return Engine(perf, config)


@dataclass(slots=True)
class Run:
    """What a replay produced: finished requests, the pooled inter-token gaps, the span."""

    finished: list[SeqState] = field(default_factory=list)
    gaps: list[tuple[float, int]] = field(default_factory=list)  # (gap, how many tokens had it)
    duration: float = 0.0

    @property
    def output_throughput(self) -> float:
        return sum(s.num_output for s in self.finished) / self.duration if self.duration > 0 else 0.0


def replay(workload: Workload, params: PerfParams, frontend: Frontend = Frontend(), seed: int = 0) -> Run:
    """`vllm bench serve` against the model: requests arrive at the rate (all at once when infinite), at
    most `concurrency` in flight; a request whose slot frees is sent at once, as the benchmark does.

    `frontend`: the API server's delay from the client's send to the engine's queue (`Frontend`). TTFT
    and the span are measured from the send, as the benchmark measures them."""
    driver = EngineDriver(build(workload, params))
    rng = random.Random(seed)
    lengths = workload.output_lengths(seed)
    arrivals: list[float] = []
    t = 0.0
    for _ in range(workload.num_prompts):
        arrivals.append(t)
        if workload.request_rate is not None:
            t += rng.expovariate(workload.request_rate)
    arrivals.reverse()  # pop() from the end: the earliest first
    ready: list[tuple[float, int, SimRequest]] = []  # heap of sent requests still in the frontend
    sent_at: dict[str, float] = {}
    run = Run()
    in_flight = 0

    def send(now: float) -> None:
        nonlocal in_flight
        while arrivals and arrivals[-1] <= now and in_flight < workload.concurrency:
            at = max(arrivals.pop(), now if workload.request_rate is None else 0.0)
            i = len(sent_at)
            req = SimRequest(f"r{i}", workload.input_tokens, lengths[i])
            sent_at[req.request_id] = at
            heapq.heappush(ready, (at + frontend.delay(in_flight), i, req))
            in_flight += 1

    def admit(now: float) -> None:
        while ready and ready[0][0] <= now:
            driver.add(heapq.heappop(ready)[2], now)

    send(0.0)
    while True:
        candidates = [driver.next_event_time()]
        if ready:
            candidates.append(ready[0][0])
        if arrivals and in_flight < workload.concurrency:
            candidates.append(arrivals[-1])
        pending = [c for c in candidates if c is not None]
        if not pending:
            break
        now = max(min(pending), driver.clock)
        for res in driver.advance_to(now):
            run.gaps.extend(res.inter_token)
            if res.failed:
                raise RuntimeError(f"{workload.key()}: {len(res.failed)} requests do not fit the KV cache")
            if res.finished:
                run.finished.extend(res.finished)
                in_flight -= len(res.finished)
                send(res.end)
        send(now)
        admit(now)
    for seq in run.finished:  # the benchmark's clock starts at the send, not at the engine's queue
        seq.arrival = sent_at[seq.request_id]
    run.duration = max((s.finish_time or 0.0) for s in run.finished) if run.finished else 0.0
    return run


# --- figures -------------------------------------------------------------------------------------------
def _pick(values: list[float], statistic: str) -> float:
    if not values:
        return math.nan
    return statistics.median(values) if statistic == "median" else statistics.fmean(values)


def _weighted_median(pairs: Iterable[tuple[float, int]]) -> float:
    ordered = sorted(pairs)
    total = sum(n for _, n in ordered)
    if not total:
        return math.nan
    seen = 0
    for gap, n in ordered:
        seen += n
        if 2 * seen >= total:
            return gap
    return ordered[-1][0]


def figure_of(m: Measurement, run: Run, baseline: Run | None = None) -> float:
    """The row's figure computed from a replay, with the row's definition, in the row's unit."""
    done = run.finished
    if m.figure == "output_throughput":
        return run.output_throughput
    if m.figure == "ttft":
        return 1000 * _pick([s.first_token_time - s.arrival for s in done if s.first_token_time is not None],
                            m.statistic)
    tpots = [
        (s.finish_time - s.first_token_time) / (s.num_output - 1)
        for s in done if s.num_output > 1 and s.finish_time is not None and s.first_token_time is not None
    ]
    if m.figure == "tpot":
        return 1000 * _pick(tpots, m.statistic)
    if m.figure == "decode_rate":
        return 1 / statistics.fmean(tpots) if tpots else math.nan
    if m.figure == "itl":
        return 1000 * _weighted_median(run.gaps)
    if m.figure == "throughput_speedup":
        assert baseline is not None
        return run.output_throughput / baseline.output_throughput
    raise ValueError(m.figure)


def baseline_of(workload: Workload) -> Workload:
    """The concurrency-1 run a speedup is relative to: the same workload, num_prompts / concurrency."""
    return Workload(workload.source_url, workload.gpu, workload.model, workload.input_tokens,
                    workload.output_tokens, workload.max_output_tokens, 1, workload.request_rate,
                    max(1, workload.num_prompts // workload.concurrency), workload.engine_args)


@dataclass(frozen=True, slots=True)
class Result:
    measurement: Measurement
    simulated: float

    @property
    def error(self) -> float:
        return (self.simulated - self.measurement.value) / self.measurement.value


def simulate(
    rows: Iterable[Measurement],
    params_for: Callable[[str], PerfParams] = lambda gpu: PerfParams(),
    frontend: Frontend = FRONTEND,
) -> list[Result]:
    """Model figure of every row; runs shared by several rows (and speedup baselines) replay once."""
    cache: dict[str, Run] = {}

    def run_of(w: Workload) -> Run:
        key = w.key()
        if key not in cache:
            cache[key] = replay(w, params_for(w.gpu), frontend)
        return cache[key]

    out = []
    for m in rows:
        base = run_of(baseline_of(m.workload)) if m.figure == "throughput_speedup" else None
        out.append(Result(m, figure_of(m, run_of(m.workload), base)))
    return out


# --- summaries -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Summary:
    group: str
    count: int
    median_abs_error: float
    max_abs_error: float


def summarise(results: list[Result], key: Callable[[Result], str]) -> list[Summary]:
    groups: dict[str, list[float]] = {}
    for r in results:
        groups.setdefault(key(r), []).append(abs(r.error))
    return [Summary(g, len(e), statistics.median(e), max(e)) for g, e in sorted(groups.items())]


def by_gpu(r: Result) -> str:
    return r.measurement.workload.gpu


def by_figure(r: Result) -> str:
    m = r.measurement
    return f"{m.figure} ({m.statistic})"


# --- acceptance ------------------------------------------------------------------------------------------
# Issue 43's bar, on the held-out rows: time per output token and output throughput within a median 10 %
# and a maximum 20 % at every concurrency, TTFT within a median 20 %; the team's shared points within 10 %.
PER_TOKEN = ("tpot", "itl", "decode_rate")  # time (or its inverse, speed) per output token
THROUGHPUT = ("output_throughput", "throughput_speedup")


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    count: int
    value: float  # the |error| statistic checked
    limit: float

    @property
    def ok(self) -> bool:
        return self.value <= self.limit


def counted(results: Iterable[Result], split: str) -> list[Result]:
    """The rows a summary counts: this split, not excluded."""
    return [r for r in results if r.measurement.split == split and not r.measurement.exclude_reason]


def acceptance(results: list[Result]) -> list[Check]:
    held = counted(results, "holdout")
    checks: list[Check] = []
    for label, figures in (("time per output token", PER_TOKEN), ("output throughput", THROUGHPUT)):
        levels = {r.measurement.workload.concurrency for r in held if r.measurement.figure in figures}
        for c in sorted(levels):
            errors = [abs(r.error) for r in held
                      if r.measurement.figure in figures and r.measurement.workload.concurrency == c]
            checks.append(Check(f"held-out {label}, concurrency {c}: median", len(errors),
                                statistics.median(errors), 0.10))
            checks.append(Check(f"held-out {label}, concurrency {c}: max", len(errors), max(errors), 0.20))
    ttft = [abs(r.error) for r in held if r.measurement.figure == "ttft"]
    if ttft:
        checks.append(Check("held-out TTFT: median", len(ttft), statistics.median(ttft), 0.20))
    for r in results:
        if r.measurement.in_shared_calibration:
            checks.append(Check(f"shared point {r.measurement.id}", 1, abs(r.error), 0.10))
    return checks
