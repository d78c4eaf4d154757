"""Virtual-time drivers: run the engine model as a discrete-event simulation (no sleeping).

These are the reference for how a fleet simulation drives `Engine`: keep the next event time of each
replica (`res.end` while busy), jump the clock to the earliest event, deliver what that step emitted,
admit arrivals with `add(req, now)`, then call `step(now)` again.
"""

from __future__ import annotations

import bisect
import heapq
import random
import statistics
from dataclasses import dataclass, field

from extproc.sim.engine import Engine
from extproc.sim.sequences import SeqState, SimRequest


@dataclass(slots=True)
class LoadResult:
    duration: float  # first arrival to last finish, simulated seconds
    finished: list[SeqState] = field(default_factory=list)
    failed: int = 0  # dropped by the engine (no longer fit the KV cache after a kv_pressure change)
    preemptions: int = 0
    mean_batch: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(s.num_output for s in self.finished)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration if self.duration > 0 else 0.0

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(s.first_token_time - s.arrival for s in self.finished)  # type: ignore[operator]

    @property
    def mean_e2e(self) -> float:
        return statistics.fmean(s.finish_time - s.arrival for s in self.finished)  # type: ignore[operator]

    @property
    def mean_decode_rate(self) -> float:
        """Per-request decode tokens/s after the first token: (n - 1) / (finish - first token)."""
        rates = [
            (s.num_output - 1) / (s.finish_time - s.first_token_time)  # type: ignore[operator]
            for s in self.finished
            if s.num_output > 1
        ]
        return statistics.fmean(rates) if rates else 0.0


def run_closed_loop(
    engine: Engine,
    concurrency: int,
    prompt_tokens: int,
    output_tokens: int,
    num_requests: int,
    start: float = 0.0,
) -> LoadResult:
    """`concurrency` clients, each sending its next request the moment the previous one finishes."""
    now = start
    sent = 0
    out = LoadResult(0.0)
    batch_sum = steps = 0
    for _ in range(min(concurrency, num_requests)):
        engine.add(SimRequest(f"r{sent}", prompt_tokens, output_tokens), now)
        sent += 1
    while engine.has_work():
        res = engine.step(now)
        if res is None:
            break
        now = res.end
        batch_sum += res.num_seqs
        steps += res.num_seqs > 0  # a step that only reports failures ran nothing
        out.failed += len(res.failed)
        out.finished.extend(res.finished)
        for _ in range(len(res.finished) + len(res.failed)):  # a failed client moves on too
            if sent < num_requests:
                engine.add(SimRequest(f"r{sent}", prompt_tokens, output_tokens), now)
                sent += 1
    out.duration = now - start
    out.preemptions = engine.preemptions_total
    out.mean_batch = batch_sum / steps if steps else 0.0
    return out


def run_admitted(engine: Engine, limit: int, prompt_tokens: int, output_tokens: int, num_requests: int,
                 stagger: float) -> LoadResult:
    """A replica behind a router that holds it at `limit` requests in flight: the first `limit` arrive
    `stagger` seconds apart (requests reach a router one after another, not all at once), then each
    one that ends lets the next in at once. Unlike `run_closed_loop`, the requests stay out of step,
    so a long prompt's prefill lands in the middle of the others' decodes, as it does in production."""
    now = 0.0
    sent = 0
    out = LoadResult(0.0)
    due = [k * stagger for k in range(min(limit, num_requests))]  # admission times, ascending
    while due or engine.has_work():
        if not engine.has_work() and due and due[0] > now:
            now = due[0]
        while due and due[0] <= now:
            engine.add(SimRequest(f"r{sent}", prompt_tokens, output_tokens), due.pop(0))  # ascending
            sent += 1
        res = engine.step(now)
        if res is None:
            if not due:
                raise RuntimeError("engine has work but nothing it can schedule")
            now = max(now, due[0])
            continue
        now = res.end
        out.finished.extend(res.finished)
        out.failed += len(res.failed)
        for _ in range(len(res.finished) + len(res.failed)):
            if sent + len(due) < num_requests:
                bisect.insort(due, now)  # before the staggered first ones still to come, if any
    out.duration = now
    out.preemptions = engine.preemptions_total
    return out


def run_open_loop(
    engine: Engine, rate: float, prompt_tokens: int, output_tokens: int, num_requests: int, seed: int = 0
) -> LoadResult:
    """Poisson arrivals at `rate` req/s, as AIBrix's benchmark lines (request_rate, samples)."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = 0.0
    for _ in range(num_requests):
        arrivals.append(t)
        t += rng.expovariate(rate)
    heapq.heapify(arrivals)
    now = 0.0
    out = LoadResult(0.0)
    batch_sum = steps = i = 0
    while arrivals or engine.has_work():
        # Admit everything that has arrived by `now`; if idle, jump to the next arrival.
        if not engine.has_work() and arrivals and arrivals[0] > now:
            now = arrivals[0]
        while arrivals and arrivals[0] <= now:
            engine.add(SimRequest(f"r{i}", prompt_tokens, output_tokens), heapq.heappop(arrivals))
            i += 1
        res = engine.step(now)
        if res is None:
            if not arrivals:  # cannot happen with a sound engine; fail loudly rather than spin
                raise RuntimeError("engine has work but nothing it can schedule")
            now = max(now, arrivals[0])
            continue
        now = res.end
        batch_sum += res.num_seqs
        steps += res.num_seqs > 0  # a step that only reports failures ran nothing
        out.finished.extend(res.finished)
        out.failed += len(res.failed)
    out.duration = now
    out.preemptions = engine.preemptions_total
    out.mean_batch = batch_sum / steps if steps else 0.0
    return out
