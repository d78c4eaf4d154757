"""Arrivals: one Poisson process per stream, sampled up front so every strategy sees the same requests.

Rate events (bursts) are applied by thinning: candidates at the peak rate, each kept with probability
rate(t) / peak. Each stream has its own generator seeded from (seed, stream index), so adding a stream
to a scenario leaves the others' requests unchanged.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from extproc.fleetsim.scenario import Scenario, Stream
from extproc.openai import CHARS_PER_TOKEN


@dataclass(frozen=True, slots=True)
class Arrival:
    time: float
    stream: int  # index into Scenario.streams
    prompt_tokens: int
    output_tokens: int  # what the engine will generate (it stops at max_tokens = this)
    gateway: int  # which gateway replica receives it (Envoy in front spreads connections)
    group: int = -1  # shared-prefix group (-1: none); its prefix is the first prefix_tokens of the prompt
    prefix_tokens: int = 0


def generate(scenario: Scenario, seed: int, gateways: int = 1) -> list[Arrival]:
    out: list[Arrival] = []
    peak = max([1.0, *(c.factor for c in scenario.rate_changes)])
    thinned = bool(scenario.rate_changes)
    for i, stream in enumerate(scenario.streams):
        rng = random.Random(f"{seed}:{i}:{stream.name}")  # str seeds hash deterministically (SHA-512)
        lam = stream.rate * peak
        groups = _groups(stream, random.Random(f"{seed}:{i}:{stream.name}:groups"))
        t = rng.expovariate(lam)
        while t < scenario.duration_s:
            if not thinned or rng.random() * peak < scenario.rate_factor(t, stream.name):
                group, prefix = -1, 0
                if groups:
                    group = rng.choices(range(len(groups[0])), cum_weights=groups[1])[0]
                    prefix = groups[0][group]
                out.append(Arrival(t, i, prefix + stream.prompt.sample(rng), stream.output.sample(rng),
                                   rng.randrange(gateways), group, prefix))
            t += rng.expovariate(lam)
    out.sort(key=lambda a: (a.time, a.stream))
    return out


def _groups(stream: Stream, rng: random.Random) -> tuple[list[int], list[float]] | None:
    """Each shared-prefix group's length and the cumulative Zipf weights of the groups."""
    if stream.prefix is None:
        return None
    p = stream.prefix
    lengths = [p.tokens.sample(rng) for _ in range(p.groups)]
    weights = [1.0 / (k + 1) ** p.skew for k in range(p.groups)]
    return lengths, list(itertools.accumulate(weights))


def prompt_text(a: Arrival, i: int) -> str:
    """A prompt whose first `prefix_tokens` are its group's and the rest its own (~4 characters per
    token, as the gateway and the simulator count): what prefix-cache routing hashes, and what the
    engine's prefix cache sees through the same hash chain the live simulator uses."""
    shared = _fill(f"[stream {a.stream} group {a.group}]", a.prefix_tokens * CHARS_PER_TOKEN)
    return shared + _fill(f"<request {i}>", (a.prompt_tokens - a.prefix_tokens) * CHARS_PER_TOKEN)


def _fill(unit: str, chars: int) -> str:
    return (unit * (chars // len(unit) + 1))[:chars]
