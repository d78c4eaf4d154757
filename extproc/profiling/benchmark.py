"""`extproc benchmark`: open-loop Poisson load per (input, output, rate) cell against an OpenAI endpoint,
written as AIBrix's benchmark JSONL, one finished cell at a time.

With `admitted` (a profile made from such a run), each of the profile's cells is run instead with the
replica held at a per-pod budget of k requests in flight, the first ones staggered, the next sent as one
ends, for k = Little's budget max(1, floor(tput x e2e)) times each of `budget_factors` (1, 2, 4, 8),
ascending; a budget that overloads the replica skips the larger ones. Its lines carry `"concurrency": k`
and `"request_rate": k` (what `gen-profile --admitted` reads into the profile's `tputs_admitted` and
`concurrency_admitted`: the budget that served most within the SLO); they go to a file of their own,
since AIBrix's gen_profile would read them as rates.

A cell that cannot keep up is cut off — too many requests in flight (`max_backlog`), or requests still
running `drain_timeout` seconds after the last arrival — and recorded with `"overloaded": <why>`; the higher
rates of the same (input, output) are then skipped, since they can only be worse.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from extproc.gpu_profiles import GpuProfile
from extproc.profiling.client import RequestResult, send
from extproc.profiling.measure import CellOutcome, cell_lines
from extproc.profiling.records import write_lines
from extproc.profiling.selection import ADMITTED_KEY, BUDGET_FACTORS, budget_ladder
from extproc.profiling.workload import Cell, arrival_times, request_body

API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class EndpointError(RuntimeError):
    """The endpoint cannot be benchmarked at all (unreachable, wrong model, refused key)."""


@dataclass(frozen=True, slots=True)
class BenchmarkOptions:
    model: str
    endpoint: str
    output: Path
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    rates: tuple[float, ...]
    append: bool = False
    num_prompts: int = 100
    seed: int = 0
    api: str = "completions"
    api_key: str | None = field(default=None, repr=False)  # never printed, never logged
    exact_length: bool = True
    temperature: float = 0.0
    max_backlog: int = 1000
    drain_timeout: float = 600.0
    admitted: GpuProfile | None = None  # run each of its cells at the router's budget instead
    budget_factors: tuple[float, ...] = BUDGET_FACTORS  # admitted: the budgets tried, x Little's budget

    def cells(self) -> list[Cell]:
        """AIBrix's order: input lengths, then output lengths, then rates, each ascending. Admitted: the
        profile's cells, `rate` the requests in flight."""
        p = self.admitted
        if p is not None:
            return [Cell(i, o, float(k)) for ii, i in enumerate(p.inputs) for oi, o in enumerate(p.outputs)
                    for k in budget_ladder(p.tputs[oi][ii], p.e2e[oi][ii] if p.e2e else 0.0,
                                           self.budget_factors)]
        return [Cell(i, o, r) for i in sorted(set(self.input_lens)) for o in sorted(set(self.output_lens))
                for r in sorted(set(self.rates))]

    def stagger(self, cell: Cell) -> float:
        """Admitted: seconds between the first requests, the profile's e2e over the budget."""
        p = self.admitted
        if p is None or p.e2e is None:
            return 0.0
        o, i = p.cell(cell.input_tokens, cell.output_tokens)
        return p.e2e[o][i] / cell.rate

    def url(self) -> str:
        base = self.endpoint.rstrip("/")
        return base if base.endswith("/completions") else base + API_PATHS[self.api]

    def headers(self) -> dict[str, str]:
        headers = {"User-Agent": "extproc-benchmark"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def redact(self, text: str) -> str:
        return text.replace(self.api_key, "***") if self.api_key else text


def public_url(url: str) -> str:
    """The URL without user:password, for printing."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


@dataclass(slots=True)
class Report:
    cells_written: int = 0
    skipped: list[Cell] = field(default_factory=list)
    overloaded: list[Cell] = field(default_factory=list)
    failed_requests: int = 0
    interrupted: bool = False


def new_session() -> aiohttp.ClientSession:
    # limit=0: an open loop must not queue requests in the client's connection pool.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))


async def preflight(session: aiohttp.ClientSession, opts: BenchmarkOptions) -> None:
    """One short request before hours of cells: a wrong URL, model or key fails here, clearly."""
    body = request_body(opts.api, opts.model, 8, 1, random.Random(opts.seed), opts.exact_length,
                        opts.temperature)
    result = await send(session, opts.url(), body, opts.headers())
    # Only what can never work stops the run: no connection, or a 4xx (wrong path, model or key). A 5xx or a
    # broken stream may be transient, and the cells count such failures anyway.
    if not result.ok and (not result.error.startswith("HTTP ") or result.error.startswith("HTTP 4")):
        raise EndpointError(f"cannot benchmark {public_url(opts.url())}: {opts.redact(result.error)}")


async def run_cell(session: aiohttp.ClientSession, opts: BenchmarkOptions, cell: Cell,
                   on_sent: Callable[[], None] = lambda: None) -> CellOutcome:
    # A fresh generator per cell, like AIBrix's one process per cell: every cell sees the same seed.
    rng = random.Random(opts.seed)
    arrivals = arrival_times(opts.num_prompts, cell.rate, rng)
    loop = asyncio.get_running_loop()
    t0, start = loop.time(), time.perf_counter()
    tasks: list[asyncio.Task[RequestResult]] = []
    results: list[RequestResult] = []
    in_flight = 0
    overloaded = ""

    def finished(task: asyncio.Task[RequestResult]) -> None:
        nonlocal in_flight
        in_flight -= 1
        if task.cancelled():
            return  # counted as unfinished
        exc = task.exception()
        results.append(task.result() if exc is None else
                       RequestResult(False, start, time.perf_counter(), error=f"{type(exc).__name__}: {exc}"))

    try:
        for at in arrivals:
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if in_flight >= opts.max_backlog > 0:
                overloaded = f"{in_flight} requests in flight (max backlog {opts.max_backlog})"
                break
            body = request_body(opts.api, opts.model, cell.input_tokens, cell.output_tokens, rng,
                                opts.exact_length, opts.temperature)
            task = asyncio.create_task(send(session, opts.url(), body, opts.headers()))
            in_flight += 1
            task.add_done_callback(finished)
            tasks.append(task)
            on_sent()
        if not overloaded and (pending := [t for t in tasks if not t.done()]):
            _, still = await asyncio.wait(pending, timeout=opts.drain_timeout)
            if still:
                overloaded = (f"{len(still)} requests unfinished "
                              f"{opts.drain_timeout:g}s after the last arrival")
    finally:  # on a cut-off or Ctrl-C, nothing outlives the cell
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    end = time.perf_counter() if overloaded or not results else max(r.end for r in results)
    errors = Counter(opts.redact(r.error) for r in results if not r.ok)
    return CellOutcome(cell, opts.num_prompts, results, end - start, opts.num_prompts - len(results),
                       overloaded, errors)


async def run_admitted_cell(session: aiohttp.ClientSession, opts: BenchmarkOptions, cell: Cell,
                            on_sent: Callable[[], None] = lambda: None) -> CellOutcome:
    """`cell.rate` clients, the k-th starting k x stagger seconds in, each sending its next request when
    its last one ends, `num_prompts` in all: the replica held at the router's per-pod budget."""
    rng = random.Random(opts.seed)
    start = time.perf_counter()
    results: list[RequestResult] = []
    left = opts.num_prompts

    async def client(delay: float) -> None:
        nonlocal left
        await asyncio.sleep(delay)
        while left > 0:
            left -= 1
            on_sent()
            body = request_body(opts.api, opts.model, cell.input_tokens, cell.output_tokens, rng,
                                opts.exact_length, opts.temperature)
            results.append(await send(session, opts.url(), body, opts.headers()))

    limit = max(1, int(cell.rate))
    overloaded = ""
    try:
        await asyncio.wait_for(asyncio.gather(*(client(k * opts.stagger(cell)) for k in range(limit))),
                               opts.drain_timeout)
    except asyncio.TimeoutError:
        overloaded = f"not done {opts.drain_timeout:g}s in"
    end = max((r.end for r in results), default=time.perf_counter())
    errors = Counter(opts.redact(r.error) for r in results if not r.ok)
    return CellOutcome(cell, opts.num_prompts, results, end - start, opts.num_prompts - len(results),
                       overloaded, errors)


def describe(outcome: CellOutcome) -> str:
    ok = outcome.ok
    text = f"{outcome.cell.label()}: {len(ok)} ok, {outcome.failed} failed"
    if outcome.unfinished:
        text += f", {outcome.unfinished} unfinished"
    if ok:
        e2e = sorted(r.e2e for r in ok)
        text += f"; TPUT {len(ok) / max(outcome.duration, 1e-9):.2f}/s, E2E mean {sum(e2e) / len(e2e):.3f}s"
    if outcome.overloaded:
        text += f"; OVERLOADED: {outcome.overloaded}"
    if outcome.errors:
        text += "; errors: " + ", ".join(f"{msg} ×{n}" for msg, n in outcome.errors.most_common(3))
    return text


class Progress:
    """A tqdm bar measured in scheduled seconds (num_prompts / rate per cell), so its ETA is in time."""

    def __init__(self, opts: BenchmarkOptions, cells: list[Cell], stream: TextIO) -> None:
        from tqdm import tqdm

        self._stream = stream
        self._bar = tqdm(total=sum(opts.num_prompts / c.rate for c in cells), unit="s", file=stream,
                         smoothing=0, dynamic_ncols=True, disable=None,  # no bar when not a terminal
                         bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}")

    def start(self, cell: Cell) -> None:
        self._bar.set_description(cell.label(), refresh=False)

    def advance(self, seconds: float) -> None:
        self._bar.update(seconds)

    def note(self, text: str) -> None:
        self._bar.write(text, file=self._stream)

    def close(self) -> None:
        self._bar.close()


async def run_benchmark(opts: BenchmarkOptions, stop: asyncio.Event, stream: TextIO = sys.stderr) -> Report:
    """Runs every cell until done or `stop` is set; a cell stopped half-way is dropped, finished ones kept."""
    cells = opts.cells()
    report = Report()
    async with new_session() as session:
        await preflight(session, opts)
        progress = Progress(opts, cells, stream)
        skip_after: dict[tuple[int, int], float] = {}  # (input, output) → the rate that overloaded
        try:
            with open(opts.output, "a" if opts.append else "w", encoding="utf-8") as out:
                for cell in cells:
                    if (cell.input_tokens, cell.output_tokens) in skip_after:
                        report.skipped.append(cell)
                        progress.advance(opts.num_prompts / cell.rate)
                        continue
                    progress.start(cell)
                    sent = 0

                    def on_sent(cell: Cell = cell) -> None:
                        nonlocal sent
                        sent += 1
                        progress.advance(1 / cell.rate)

                    run = run_cell if opts.admitted is None else run_admitted_cell
                    outcome = await _unless_stopped(run(session, opts, cell, on_sent), stop)
                    if outcome is None:
                        report.interrupted = True
                        break
                    progress.advance((opts.num_prompts - sent) / cell.rate)
                    lines = cell_lines(outcome, opts.model, opts.seed, opts.temperature)
                    if opts.admitted is not None:
                        lines = [replace(x, extra={**x.extra, ADMITTED_KEY: int(cell.rate)}) for x in lines]
                    write_lines(out, lines)
                    report.cells_written += 1
                    report.failed_requests += outcome.failed
                    if outcome.overloaded:
                        report.overloaded.append(cell)
                        skip_after[(cell.input_tokens, cell.output_tokens)] = cell.rate
                    progress.note(describe(outcome))
        finally:
            progress.close()
    return report


async def _unless_stopped(work, stop: asyncio.Event) -> CellOutcome | None:  # type: ignore[no-untyped-def]
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # cancelled from outside: the cell's requests go too
        raise
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None
