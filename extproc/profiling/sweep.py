"""A benchmark plan run against an endpoint, whatever carries the requests: each cell's load generator, its
measurement (profiling/measure.py) and the overload rule that skips higher rates.

Open-loop cells: Poisson arrivals (AIBrix's schedule), `num_prompts` of them. A cell that cannot keep up is
cut off — too many requests in flight (`max_backlog`), or requests still running `drain_timeout` seconds
after the last arrival — and recorded with `"overloaded": <why>`; the higher rates of the same (input,
output) are then skipped, since they can only be worse.

Admitted cells (a plan made from a profile): the replica held at a per-pod budget of k requests in flight,
the first ones staggered, the next sent as one ends. Their lines carry `"concurrency": k` and
`"request_rate": k` (what `gen-profile --admitted` reads into `tputs_admitted` and `concurrency_admitted`).

Time is the running event loop's clock: wall time over HTTP, virtual time against the engine model
(profiling/virtual.py). Nothing here sleeps on anything else.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from extproc.profiling.client import RequestResult
from extproc.profiling.measure import CellOutcome, cell_lines, served
from extproc.profiling.plan import LoadPlan
from extproc.profiling.records import MetricLine
from extproc.profiling.selection import ADMITTED_KEY, CLIMB_ROOM, SLOs, climb_to
from extproc.profiling.workload import Cell, arrival_times


class Endpoint(Protocol):
    """Where a sweep's requests go: HTTP to an OpenAI server, or the engine model in virtual time."""

    async def send(self, cell: Cell, rng: random.Random) -> RequestResult:
        """One streamed request of the cell's shape (its prompt drawn from `rng`), timed on the loop's
        clock; failures come back with `ok=False, error`, never raised."""
        ...

    def redact(self, text: str) -> str:
        """An error message as it may be printed (without secrets)."""
        ...


class Progress(Protocol):
    def start(self, cell: Cell) -> None: ...
    def advance(self, seconds: float) -> None: ...
    def note(self, text: str) -> None: ...


class Quiet:
    """No progress to show (a sweep in virtual time takes no wall time worth showing)."""

    def start(self, cell: Cell) -> None:
        pass

    def advance(self, seconds: float) -> None:
        pass

    def note(self, text: str) -> None:
        pass


@dataclass(slots=True)
class Report:
    cells_written: int = 0
    skipped: list[Cell] = field(default_factory=list)
    overloaded: list[Cell] = field(default_factory=list)
    failed_requests: int = 0
    interrupted: bool = False
    climbed: int = 0  # admitted budgets run past the plan's ladder


def prompt_rng(plan: LoadPlan, cell: Cell, run: str) -> random.Random:
    """The cell's own prompts: drawn from one seed, every cell would send the prompts of the one before,
    and an engine with prefix caching (vLLM's default) would skip their prefill, flattering every cell of
    a length but the first. A string seed is hashed the same in every process."""
    return random.Random(f"{plan.seed}/{run}/{cell.input_tokens}/{cell.output_tokens}/{cell.rate:g}")


async def run_cell(endpoint: Endpoint, plan: LoadPlan, cell: Cell,
                   on_sent: Callable[[], None] = lambda: None) -> CellOutcome:
    # A fresh generator per cell, like AIBrix's one process per cell: every cell sees the same seed.
    arrivals = arrival_times(plan.num_prompts, cell.rate, random.Random(plan.seed))
    rng = prompt_rng(plan, cell, "rate")
    loop = asyncio.get_running_loop()
    start = loop.time()
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
                       RequestResult(False, start, loop.time(), error=f"{type(exc).__name__}: {exc}"))

    try:
        for at in arrivals:
            delay = start + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if in_flight >= plan.max_backlog > 0:
                overloaded = f"{in_flight} requests in flight (max backlog {plan.max_backlog})"
                break
            task = asyncio.create_task(endpoint.send(cell, rng))
            in_flight += 1
            task.add_done_callback(finished)
            tasks.append(task)
            on_sent()
        if not overloaded and (pending := [t for t in tasks if not t.done()]):
            _, still = await asyncio.wait(pending, timeout=plan.drain_timeout)
            if still:
                overloaded = (f"{len(still)} requests unfinished "
                              f"{plan.drain_timeout:g}s after the last arrival")
    finally:  # on a cut-off or Ctrl-C, nothing outlives the cell
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    end = loop.time() if overloaded or not results else max(r.end for r in results)
    return _outcome(endpoint, plan, cell, results, end - start, overloaded)


async def run_admitted_cell(endpoint: Endpoint, plan: LoadPlan, cell: Cell,
                            on_sent: Callable[[], None] = lambda: None) -> CellOutcome:
    """`cell.rate` clients, the k-th starting k x stagger seconds in, each sending its next request when
    its last one ends, `plan.prompts(cell)` in all: the replica held at the router's per-pod budget.

    A closed loop cannot build a backlog, so the cell is cut off only when one request runs
    `drain_timeout` seconds: a budget of one request at a time for long answers may rightly take far
    longer than that in all (100 answers of 1,024 tokens at 30 ms a token: 50 minutes)."""
    rng = prompt_rng(plan, cell, "admitted")
    loop = asyncio.get_running_loop()
    start = loop.time()
    results: list[RequestResult] = []
    left = plan.prompts(cell)
    overloaded = ""

    async def client(delay: float) -> None:
        nonlocal left, overloaded
        await asyncio.sleep(delay)
        while left > 0 and not overloaded:
            left -= 1
            on_sent()
            try:
                results.append(await asyncio.wait_for(endpoint.send(cell, rng), plan.drain_timeout))
            except asyncio.TimeoutError:
                overloaded = f"a request still running {plan.drain_timeout:g}s after it was sent"

    limit = max(1, int(cell.rate))
    await asyncio.gather(*(client(k * plan.stagger(cell)) for k in range(limit)))
    end = max((r.end for r in results), default=loop.time())
    return _outcome(endpoint, plan, cell, results, end - start, overloaded, held=limit)


def _outcome(endpoint: Endpoint, plan: LoadPlan, cell: Cell, results: list[RequestResult], duration: float,
             overloaded: str, held: int | None = None) -> CellOutcome:
    errors = Counter(endpoint.redact(r.error) for r in results if not r.ok)
    planned = plan.prompts(cell)
    return CellOutcome(cell, planned, results, duration, planned - len(results),
                       overloaded, errors, held)


def describe(outcome: CellOutcome) -> str:
    ok = outcome.ok
    text = f"{outcome.cell.label()}: {len(ok)} ok, {outcome.failed} failed"
    if outcome.unfinished:
        text += f", {outcome.unfinished} unfinished"
    if ok:
        e2e = sorted(r.e2e for r in ok)
        done, _, seconds = served(outcome)
        text += f"; TPUT {done / seconds:.2f}/s, E2E mean {sum(e2e) / len(e2e):.3f}s"
    if outcome.overloaded:
        text += f"; OVERLOADED: {outcome.overloaded}"
    if outcome.errors:
        text += "; errors: " + ", ".join(f"{msg} ×{n}" for msg, n in outcome.errors.most_common(3))
    return text


async def run_sweep(endpoint: Endpoint, plan: LoadPlan, write: Callable[[list[MetricLine]], None],
                    model: str, temperature: float = 0.0, progress: Progress = Quiet(),
                    stop: asyncio.Event | None = None) -> Report:
    """Every cell of the plan until done or `stop` is set; each finished cell's lines go to `write` at
    once; a cell stopped half-way is dropped."""
    report = Report()
    skip_after: dict[tuple[int, int], float] = {}  # (input, output) → the rate that overloaded
    run = run_cell if plan.admitted is None else run_admitted_cell
    cells = deque(plan.cells())
    climb = _Climb(plan) if plan.admitted is not None else None
    while cells:
        cell = cells.popleft()
        if (cell.input_tokens, cell.output_tokens) in skip_after:
            report.skipped.append(cell)
            progress.advance(plan.scheduled_seconds(cell))
            continue
        progress.start(cell)
        sent = 0

        def on_sent(cell: Cell = cell) -> None:
            nonlocal sent
            sent += 1
            progress.advance(1 / cell.rate)

        work = run(endpoint, plan, cell, on_sent)
        outcome = await (work if stop is None else _unless_stopped(work, stop))
        if outcome is None:
            report.interrupted = True
            break
        progress.advance((plan.prompts(cell) - sent) / cell.rate)
        lines = cell_lines(outcome, model, plan.seed, temperature)
        if plan.admitted is not None:
            lines = [replace(x, extra={**x.extra, ADMITTED_KEY: int(cell.rate)}) for x in lines]
        write(lines)
        report.cells_written += 1
        report.failed_requests += outcome.failed
        if outcome.overloaded:
            report.overloaded.append(cell)
            skip_after[(cell.input_tokens, cell.output_tokens)] = cell.rate
        elif climb is not None and (higher := climb.after(cell, lines, cells)) is not None:
            cells.appendleft(higher)
            report.climbed += 1
        progress.note(describe(outcome))
    return report


class _Climb:
    """An admitted cell's ladder past its top rung: once the plan's last budget of an (input, output) ran,
    each budget that met the SLO and served more is followed by twice it (`selection.climb_to`), up to
    the plan's `climb_cap` for the cell."""

    def __init__(self, plan: LoadPlan) -> None:
        assert plan.admitted is not None
        self.plan = plan
        try:  # `benchmark --max-budget` refuses such a profile up front; without it there is nothing to climb
            self.slos: SLOs | None = SLOs.of_profile(plan.admitted.slos)
        except ValueError:
            self.slos = None
        self.last: dict[tuple[int, int], list[MetricLine]] = {}

    def after(self, cell: Cell, lines: list[MetricLine], queued: deque[Cell]) -> Cell | None:
        shape = (cell.input_tokens, cell.output_tokens)
        below, self.last[shape] = self.last.get(shape), lines
        if any((c.input_tokens, c.output_tokens) == shape for c in queued):
            return None  # the plan's own ladder is not done
        cap = self.plan.climb_cap(cell)
        if cap is None or self.slos is None or not self.slos.targets:
            return None
        room = CLIMB_ROOM if self.plan.climb_needs_room(cell) else 1.0
        k = climb_to(lines, below, self.slos, int(cell.rate), cap, room)
        return None if k is None else Cell(cell.input_tokens, cell.output_tokens, float(k))


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
