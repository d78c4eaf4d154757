"""`extproc benchmark` against the engine model in virtual time: the same sweep (profiling/sweep.py), its
requests handed to an `Engine` instead of an HTTP server, on an event loop whose clock jumps to the next
thing due instead of sleeping. Then gen-profile's own rule (profiling/gen_profile.py) makes the profile.

The fleet simulation's SLO profiles come from here, so what it measures is what `extproc benchmark` and
`extproc gen-profile` make on a GPU that behaves as the engine model: the same grid, schedule, statistics
(profiling/measure.py: TPOT per request, throughput as completions over the cell's whole run) and
budget ladder. `time_scale` mirrors `extproc engine-sim --time-scale` (simulated seconds per reported
second), so a run can be compared with one against a live simulator.
"""

from __future__ import annotations

import asyncio
import random
import selectors
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from extproc.gpu_profiles import BUDGET_MARGIN, GpuProfile
from extproc.profiling.client import RequestResult
from extproc.profiling.gen_profile import profile_from_lines
from extproc.profiling.plan import LoadPlan
from extproc.profiling.records import MetricLine
from extproc.profiling.selection import SLOs
from extproc.profiling.sweep import run_sweep
from extproc.profiling.workload import Cell
from extproc.sim.engine import Engine
from extproc.sim.sequences import CapacityError, SimRequest

T = TypeVar("T")


class _Clock(selectors.SelectSelector):
    """A selector that never waits: asked to wait `timeout` seconds for I/O, it moves the clock on by that
    much (nothing does I/O on this loop). Waiting forever means nothing is left to happen: a bug."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("virtual benchmark: tasks wait on nothing that will ever happen")
        self.now += max(0.0, timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time: sleeps and timeouts cost no wall time."""

    def __init__(self) -> None:
        self._clock = _Clock()
        super().__init__(self._clock)

    def time(self) -> float:
        return self._clock.now

    def quiet_until(self, when: float) -> bool:
        """Nothing ready to run and no timer due by `when`: the clock may jump there with nothing missed."""
        ready, timers = self._ready, self._scheduled  # type: ignore[attr-defined]  (BaseEventLoop's own)
        return not ready and (not timers or timers[0].when() > when)

    def jump(self, when: float) -> None:
        self._clock.now = max(self._clock.now, when)


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()


class _Stream:
    __slots__ = ("result", "last", "tokens", "done")

    def __init__(self, result: RequestResult, done: asyncio.Future[None]) -> None:
        self.result, self.last, self.tokens, self.done = result, result.start, 0, done

    def token(self, now: float) -> None:
        r = self.result
        if r.ttft is None:
            r.ttft = now - r.start
        else:
            r.gaps.append(now - self.last)
        self.last = now
        self.tokens += 1

    def end(self, now: float, error: str = "") -> None:
        r = self.result
        r.end, r.output_tokens, r.error, r.ok = now, self.tokens, error, not error
        if not self.done.done():
            self.done.set_result(None)


class EngineEndpoint:
    """A sweep's requests as `SimRequest`s to one engine, which a task steps as the live simulator's pacer
    does: a step starts when the last one ends (or when work arrives), its tokens show at its end."""

    def __init__(self, engine: Engine, time_scale: float = 1.0) -> None:
        self.engine, self.scale = engine, time_scale
        self._streams: dict[str, _Stream] = {}
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self._ids = 0

    def redact(self, text: str) -> str:
        return text

    async def send(self, cell: Cell, rng: random.Random) -> RequestResult:
        # The prompt's text is never drawn: the engine model sees only its length, and the sweep draws
        # arrivals before any prompt, so the schedule is the one `extproc benchmark` sends.
        loop = asyncio.get_running_loop()
        if self._driver is None:
            self._wake = asyncio.Event()
            self._driver = loop.create_task(self._drive())
        now = loop.time()
        result = RequestResult(False, now)
        rid = f"v{self._ids}"
        self._ids += 1
        try:
            self.engine.add(SimRequest(rid, cell.input_tokens, cell.output_tokens), now * self.scale)
        except CapacityError as exc:  # what the simulator's HTTP server answers with a 400
            result.end, result.error = now, f"HTTP 400: {exc}"
            return result
        stream = self._streams[rid] = _Stream(result, loop.create_future())
        self._wake.set()  # type: ignore[union-attr]
        try:
            await stream.done
        except asyncio.CancelledError:  # the client went away: the engine stops working on it
            self._streams.pop(rid, None)
            self.engine.abort(rid)
            raise
        return result

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        while True:
            res = self.engine.step(loop.time() * self.scale)
            if res is None:
                wake.clear()
                await wake.wait()
                continue
            end = res.end / self.scale
            if isinstance(loop, VirtualTimeLoop) and loop.quiet_until(end):
                loop.jump(end)  # no task to wake on the way: the next step at once, no trip round the loop
            elif end > loop.time():
                await asyncio.sleep(end - loop.time())
            now = loop.time()
            streams = self._streams
            for rid in res.emitted:
                if (stream := streams.get(rid)) is not None:
                    stream.token(now)
            for seq in res.finished:
                if (stream := streams.pop(seq.request_id, None)) is not None:
                    stream.end(now)
            for seq in res.failed:
                if (stream := streams.pop(seq.request_id, None)) is not None:
                    stream.end(now, "engine dropped the request (KV cache)")

    def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()


def benchmark(engine: Engine, plan: LoadPlan, model: str, time_scale: float = 1.0) -> list[MetricLine]:
    """`extproc benchmark` with `plan`'s options against `engine`: the benchmark JSONL's lines."""
    lines: list[MetricLine] = []

    async def main() -> None:
        endpoint = EngineEndpoint(engine, time_scale)
        try:
            await run_sweep(endpoint, plan, lines.extend, model)
        finally:
            endpoint.close()

    run_virtual(main())
    return lines


def measure_profile(new_engine: Callable[[], Engine], plan: LoadPlan, model: str, deployment: str,
                    cost: float, slos: SLOs, time_scale: float = 1.0,
                    budget_margin: float = BUDGET_MARGIN) -> GpuProfile:
    """The four steps of docs/optimizer.md's recipe on the engine model: `benchmark`, `gen-profile`,
    `benchmark --admitted PROFILE`, `gen-profile --admitted`. One fresh engine per run, as a replica
    restarted between runs."""
    rate_lines = benchmark(new_engine(), plan, model, time_scale)
    profile, _ = profile_from_lines(deployment, rate_lines, cost, slos, 0.0)
    admitted_lines = benchmark(new_engine(), replace(plan, admitted=profile), model, time_scale)
    return profile_from_lines(deployment, rate_lines, cost, slos, 0.0, admitted_lines,
                              budget_margin=budget_margin)[0]
