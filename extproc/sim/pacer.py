"""Clock pacing: one `Engine` stepped on the wall clock, scaled, with the step results handed on.

The pacer steps the model, sleeps until the step's end on the wall clock, then hands the step to
`deliver` (the server wakes each responder once per step), so the cost is one timer per step, not
one per token per request. Timer lateness is learned and aimed early; lateness the loop cannot absorb
is counted as lag, never hidden.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from extproc.sim.engine import Engine
from extproc.sim.sequences import StepResult
from extproc.sim.streams import Lateness

# Timer lateness (wall seconds) that the loop absorbs by starting the next step at the previous step's
# model end time, so jitter does not accumulate into drift. Larger lateness is time really lost.
LATE_TOLERANCE_S = 0.02
MAX_STEPS_WITHOUT_YIELD = 16
MAX_WAKE_BIAS_S = 0.003
SPIN_MIN_STEP_S = 0.004  # below this a step is too short for sub-ms precision to matter: don't spin


class Pacer:
    def __init__(self, engine: Engine, time_scale: float, deliver: Callable[[StepResult], None],
                 slowdown: Callable[[], float]) -> None:
        self.engine = engine
        self.time_scale = time_scale
        self._deliver = deliver
        self._slowdown = slowdown  # the engine's step-time factor now (slow-start fault), read per step
        self.lag_seconds = 0.0  # model time lost to an overloaded event loop (should stay ~0)
        self.lateness = Lateness()  # wall time between a step's planned end and its tokens' delivery
        self._wake_bias = 0.001  # how early to set the timer (learned)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._wake: asyncio.Event | None = None

    def start(self) -> None:
        """Model time 0 is now; call from the event loop that will `run` the pacer."""
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._wake = asyncio.Event()

    @property
    def started(self) -> bool:
        return self._loop is not None

    def now(self) -> float:
        """Model time: wall seconds since start, scaled."""
        if self._loop is None:
            return 0.0
        return (self._loop.time() - self._t0) * self.time_scale

    def since_start(self) -> float:
        return self._loop.time() - self._t0 if self._loop else 0.0

    def wake(self) -> None:
        """New work arrived: an idle loop steps again at once."""
        assert self._wake is not None
        self._wake.set()

    async def run(self) -> None:
        assert self._loop is not None and self._wake is not None
        loop, engine, scale = self._loop, self.engine, self.time_scale
        tolerance = LATE_TOLERANCE_S * scale
        prev_end: float | None = None
        behind = 0
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                prev_end = None
                continue
            now = self.now()
            start = now
            if prev_end is not None:
                if now - prev_end <= tolerance:
                    start = prev_end
                else:
                    self.lag_seconds += (now - prev_end) / scale
            engine.slowdown = self._slowdown()
            res = engine.step(start)
            if res is None:  # nothing schedulable; wait for an arrival or an abort to change that
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.05)
                except TimeoutError:
                    pass
                prev_end = None
                continue
            target = self._t0 + res.end / scale
            delay = target - loop.time() - self._wake_bias
            if delay > 0:
                await asyncio.sleep(delay)
                # asyncio timers fire late (epoll rounds up to whole ms, plus wake-up latency): learn by
                # how much, aim that much early, and finish the wait by yielding rather than by a timer.
                late = loop.time() - (target - self._wake_bias)
                self._wake_bias = min(
                    MAX_WAKE_BIAS_S, max(0.0, self._wake_bias + 0.1 * (late - self._wake_bias))
                )
                if res.duration / scale >= SPIN_MIN_STEP_S:
                    while loop.time() < target:
                        await asyncio.sleep(0)
                behind = 0
            elif target > loop.time() and res.duration / scale >= SPIN_MIN_STEP_S:
                while loop.time() < target:
                    await asyncio.sleep(0)
                behind = 0
            else:
                # The step already ended on the wall clock (high time scale: steps shorter than a timer
                # tick). Deliver at once and run the next step from its model start: no time is lost. Yield
                # now and then so arrivals and responders get the loop.
                behind += 1
                if behind >= MAX_STEPS_WITHOUT_YIELD:
                    behind = 0
                    await asyncio.sleep(0)
            self.lateness.add(loop.time() - (self._t0 + res.end / scale))
            self._deliver(res)
            prev_end = res.end
