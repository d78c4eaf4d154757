"""`EngineDriver`: advance an `Engine` to a given time. The adapter a virtual-time fleet simulation uses.

`Engine.step(now)` applies a whole step at once and says when it ends; the driver holds the step in
flight, so a caller can ask "what happened by time t?" without knowing about steps:

    d = EngineDriver(engine)
    d.add(SimRequest("r1", 512, 128), now=0.0)
    for res in d.advance_to(0.5):      # every step that ended by t=0.5, in order
        ...res.emitted, res.finished, res.end...
    d.next_event_time()                # when the next step ends (None when idle): the DES wake-up

A discrete-event fleet simulation keeps one driver per replica, jumps the clock to the earliest
`next_event_time()` or arrival, and calls `advance_to` on the replicas it touches. The live server
uses the same `Engine` with a wall clock (server.py); only the clock differs.
"""

from __future__ import annotations

from extproc.sim.engine import Engine
from extproc.sim.sequences import SimRequest, StepResult


class EngineDriver:
    __slots__ = ("engine", "clock", "pending")

    def __init__(self, engine: Engine, start: float = 0.0) -> None:
        self.engine = engine
        self.clock = start  # the latest time the driver has been told about
        self.pending: StepResult | None = None  # the step on the GPU now; its tokens show at .end

    def add(self, request: SimRequest, now: float) -> None:
        """Admit at `now` (>= the last advance). It joins the step after the one in flight, as in vLLM."""
        self.clock = max(self.clock, now)
        self.engine.add(request, self.clock)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def next_event_time(self) -> float | None:
        if self.pending is not None:
            return self.pending.end
        return self.clock if self.engine.has_work() else None

    def advance_to(self, t: float) -> list[StepResult]:
        """Run every step that ends by `t`; a step that starts by `t` but ends later stays in flight."""
        done: list[StepResult] = []
        while True:
            if self.pending is None:
                start = max(self.clock, self.engine.busy_until())
                if not self.engine.has_work() or start > t:
                    break
                self.pending = self.engine.step(start)
                if self.pending is None:
                    # has_work() with nothing schedulable would make next_event_time() repeat forever.
                    raise RuntimeError("engine has work but nothing it can schedule")
            if self.pending.end > t:
                break
            done.append(self.pending)
            self.clock = max(self.clock, self.pending.end)
            self.pending = None
        self.clock = max(self.clock, t)
        return done
