"""One live replica's state, shared by its HTTP faces: the engine and its pacer, the open streams, faults.

The pacer hands each step here (`deliver`): tokens go to the waiting responders, the finished and the
failed end their streams, and the engine metrics observe the step. The OpenAI handlers
(`openai_http.py`) add streams; the admin endpoints (`admin.py`) change the faults.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from extproc.sim.engine import Engine
from extproc.sim.faults import in_slow_start
from extproc.sim.metrics import EngineMetrics
from extproc.sim.pacer import Pacer
from extproc.sim.replica import ReplicaSpec
from extproc.sim.sequences import StepResult
from extproc.sim.streams import CONNECTION_BROKEN, KV_DROPPED, Failure, TokenStream

log = logging.getLogger(__name__)


class LiveReplica:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.engine: Engine = spec.build_engine()
        self.rng = random.Random(spec.seed)
        self.pacer = Pacer(self.engine, spec.time_scale, self.deliver, self._slowdown)
        self.metrics = EngineMetrics(spec.engine, spec.model_name, self.engine, self.pacer.now)
        self.dead = False  # the engine loop died: nothing will be generated any more
        self.timelines: dict[str, list[float]] = {}
        self.streams: dict[str, TokenStream] = {}
        self.wall_t0 = 0.0
        # Faults can be changed at runtime (POST /sim/faults); slow start counts from the last change.
        self.faults = spec.faults
        self.fault_t0 = 0.0

    def start(self) -> None:
        """Model time, wall time and slow start all count from now."""
        self.pacer.start()
        self.wall_t0 = time.time()
        self.fault_t0 = asyncio.get_running_loop().time()

    def slow(self) -> bool:
        """In the slow-start window after start or the last fault change."""
        if not self.pacer.started:
            return False
        return in_slow_start(self.faults, asyncio.get_running_loop().time() - self.fault_t0)

    def _slowdown(self) -> float:
        return self.faults.slow_start_factor if self.slow() else 1.0

    def broken(self, rid: str, s: TokenStream) -> None:
        """A stream's socket write failed: drop that connection and its request, keep the loop going."""
        log.warning("engine-sim %s: dropping %s after a write error", self.spec.name, rid, exc_info=True)
        s.sink = None
        if s.transport is not None:
            s.transport.abort()
        s.fail(CONNECTION_BROKEN)
        self.engine.abort(rid)

    def fail_streams(self, failure: Failure, drop: bool) -> None:
        """End every open stream with `failure`; `drop` also closes its connection at once."""
        for s in list(self.streams.values()):
            s.fail(failure)
            if drop and s.transport is not None:
                s.transport.abort()

    def deliver(self, res: StepResult) -> None:
        streams = self.streams
        stamp = self.engine.busy_seconds_total  # model time: the sum of step durations so far
        for rid in res.emitted:
            s = streams.get(rid)
            if s is not None:
                s.tokens += 1
                if s.stamps is not None:
                    s.stamps.append(stamp)
                if s.sink is not None:
                    try:
                        s.sink.emit(s.tokens)  # written now; the handler only wakes at the end
                    except Exception:  # one bad socket must not kill the loop
                        self.broken(rid, s)
                else:
                    s.notify()
        self.metrics.observe_step(res)
        for seq in res.first_tokens:
            self.metrics.observe_first_token(seq)
        for seq in res.finished:
            self.metrics.observe_finished(seq)
            s = streams.get(seq.request_id)
            if s is not None and not s.done:
                s.done, s.seq = True, seq
                if s.sink is not None:
                    try:
                        s.sink.finish()
                    except Exception:  # as above
                        self.broken(seq.request_id, s)
                s.notify()
        for seq in res.failed:
            s = streams.get(seq.request_id)
            if s is not None:
                s.fail(KV_DROPPED)
