"""Arrivals: one Poisson process per stream, sampled up front so every strategy sees the same requests.

Rate events (bursts) are applied by thinning: candidates at the peak rate, each kept with probability
rate(t) / peak. Each stream has its own generator seeded from (seed, stream index), so adding a stream
to a scenario leaves the others' requests unchanged.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from extproc.fleetsim.scenario import Scenario


@dataclass(frozen=True, slots=True)
class Arrival:
    time: float
    stream: int  # index into Scenario.streams
    prompt_tokens: int
    output_tokens: int  # what the engine will generate (it stops at max_tokens = this)
    gateway: int  # which gateway replica receives it (Envoy in front spreads connections)


def generate(scenario: Scenario, seed: int, gateways: int = 1) -> list[Arrival]:
    out: list[Arrival] = []
    peak = max([1.0, *(c.factor for c in scenario.rate_changes)])
    for i, stream in enumerate(scenario.streams):
        rng = random.Random(f"{seed}:{i}:{stream.name}")  # str seeds hash deterministically (SHA-512)
        lam = stream.rate * peak
        t = rng.expovariate(lam)
        while t < scenario.duration_s:
            if peak == 1.0 or rng.random() * peak < scenario.rate_factor(t):
                out.append(Arrival(t, i, stream.prompt.sample(rng), stream.output.sample(rng),
                                   rng.randrange(gateways)))
            t += rng.expovariate(lam)
    out.sort(key=lambda a: (a.time, a.stream))
    return out
