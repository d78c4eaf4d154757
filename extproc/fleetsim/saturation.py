"""Saturated throughput: the denominator of utilization.

Utilization in the report is a replica's achieved output-token throughput divided by what the same
replica produces when it is never short of work, *for the same request mix*. A busy fraction cannot
show load under continuous batching (any running sequence keeps the GPU "busy"), and tokens/s alone
cannot be compared across GPU types. The saturated figure comes from the engine model itself: a
closed-loop virtual run with as many clients as the engine admits (max_num_seqs), each sending its next
request (sampled from the scenario's streams, weighted by rate) as soon as the previous one ends.
Only the steady part counts: after the first wave has finished, until the last request is sent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from extproc.fleetsim.scenario import Scenario
from extproc.sim.engine import Engine
from extproc.sim.replica import ReplicaSpec
from extproc.sim.sequences import SimRequest

_CACHE: dict[tuple[object, ...], float] = {}


@dataclass(frozen=True, slots=True)
class MixSampler:
    """Requests drawn from the scenario's streams in proportion to their base rates."""

    scenario: Scenario

    def sample(self, rng: random.Random) -> tuple[int, int]:
        streams = self.scenario.streams
        s = rng.choices(streams, weights=[x.rate for x in streams])[0] if len(streams) > 1 else streams[0]
        prefix = s.prefix.tokens.sample(rng) if s.prefix is not None else 0  # no cache hits: the full cost
        return prefix + s.prompt.sample(rng), s.output.sample(rng)


def build_engine(scenario: Scenario, gpu: str, tensor_parallel: int | None = None) -> Engine:
    return ReplicaSpec(gpu=gpu, model=scenario.model, tensor_parallel=tensor_parallel,
                       engine_overrides=scenario.engine).build_engine()


def saturated_throughput(scenario: Scenario, gpu: str, tensor_parallel: int | None = None,
                         seed: int = 0, waves: int = 6) -> float:
    """Output tokens/s of one replica of `gpu` kept full with the scenario's mix (cached)."""
    mix = tuple((s.rate / scenario.total_rate, s.prompt, s.output, s.prefix) for s in scenario.streams)
    key = (gpu, scenario.model, tensor_parallel, tuple(sorted(scenario.engine.items())), mix, seed, waves)
    if key not in _CACHE:
        _CACHE[key] = _measure(build_engine(scenario, gpu, tensor_parallel), MixSampler(scenario),
                               random.Random(seed), waves)
    return _CACHE[key]


def _measure(engine: Engine, mix: MixSampler, rng: random.Random, waves: int) -> float:
    clients = engine.config.max_num_seqs
    total = clients * waves
    limit = engine.max_model_len
    sent = done = 0
    now = 0.0

    def send() -> None:
        nonlocal sent
        while True:  # a request that can never fit is redrawn, as a client would shorten it
            prompt, output = mix.sample(rng)
            if prompt + output <= limit:
                break
        engine.add(SimRequest(f"s{sent}", prompt, output), now)
        sent += 1

    for _ in range(clients):
        send()
    t0 = tokens = None
    counted = 0
    while engine.has_work() and sent < total:
        res = engine.step(now)
        if res is None:
            break
        now = res.end
        if t0 is not None:
            counted += len(res.emitted)
        for _ in range(len(res.finished) + len(res.failed)):
            done += 1
            if done == clients and t0 is None:
                t0 = now  # first wave over: from here the batch is in steady state
            send()
    tokens = counted
    span = now - t0 if t0 is not None else 0.0
    if span <= 0 or not tokens:
        raise RuntimeError(f"saturation run too short on {engine.perf.gpu.name}")
    return tokens / span
