"""What the demo runs: the simulated pool, the request mix, the arrival rate and each phase's length.

The pool is one model on two GPU types, the faster about 2.3x the slower (llama3-8b on L20 and
A100-80GB in the engine simulator's calibrated presets). The rate is sized from the engine model's own
saturated throughput for this mix (extproc.fleetsim.saturation), so that the pool as a whole runs at
`LOAD` of what it can serve: equal shares (round-robin) then push each L20 to about its limit while the
A100 idles at half, which is the spec's "before".
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from extproc.fleetsim.saturation import saturated_throughput
from extproc.fleetsim.scenario import Scenario, Stream, parse

MODEL = "llama3-8b"
POOL = (("l20-0", "L20"), ("l20-1", "L20"), ("a100-0", "A100-80GB"))
LOAD = 0.7  # of the pool's saturated output-token throughput
# Lengths in tokens: short chat turns, so that a measured phase holds many requests per pod.
MIX = {"prompt": {"dist": "lognormal", "mean": 256, "sigma": 0.6, "min": 16, "max": 2048},
       "output": {"dist": "lognormal", "mean": 128, "sigma": 0.6, "min": 8, "max": 512}}
# What each strategy's requests carry. Plain `least-request` would be auto-blended with load-balance
# (as AIBrix's gateway does); `:0` turns that off so the demo shows least-request itself.
STRATEGIES = {"round-robin": "round-robin", "least-request": "least-request,load-balance:0",
              "load-balance": "load-balance"}


@dataclass(frozen=True, slots=True)
class Phases:
    warmup_s: float   # requests sent but not measured: the previous strategy's requests drain meanwhile
    measure_s: float  # requests arriving in this window are measured
    drain_s: float    # at most this long for the measured requests to finish after the window


FULL = Phases(warmup_s=10.0, measure_s=30.0, drain_s=30.0)
QUICK = Phases(warmup_s=5.0, measure_s=12.0, drain_s=15.0)

# `--burst`: the same load burst, on the same arrivals, routed by least-request (the fleet simulation's
# baseline) and by load-balance under each capacity estimate: each phase a normal-load part (twice the
# warm-up, so the estimates settle to it), then the measured window at BURST_LOAD.
BURST_LOAD = 0.95  # of the pool's saturated throughput: just under what it can serve
# (strategy, routing.load_balance.capacity), in the order they run; least-request reads no capacity
BURST_PHASES = (("least-request", "speed"), ("load-balance", "observed"), ("load-balance", "speed"))
BURST_SEED_OFFSET = 1_000_003  # the burst phases' own arrivals: the same for all, apart from the others'


def burst_phases(phases: Phases) -> Phases:
    return Phases(2 * phases.warmup_s, phases.measure_s, phases.drain_s)


def burst_label(strategy: str, mode: str) -> str:
    return f"load-balance ({mode})" if strategy == "load-balance" else f"{strategy} (burst)"


def scenario() -> Scenario:
    """The demo as a fleet-simulation scenario: the same pool and mix (for the saturated figures)."""
    fleet = [{"gpu": "L20", "replicas": 2}, {"gpu": "A100-80GB", "replicas": 1}]
    return parse({"name": "demo", "model": MODEL, "fleet": fleet,
                  "streams": [{"name": "chat", "rate": 1.0, **MIX}]})


@dataclass(frozen=True, slots=True)
class Plan:
    stream: Stream                # the request mix
    saturated: dict[str, float]   # per GPU type: output tokens/s of one replica kept full with the mix
    mean_output: float            # tokens per request, of the mix
    rate: float                   # requests/s sent

    @staticmethod
    def make(load: float = LOAD, seed: int = 0) -> Plan:
        sc = scenario()
        stream = sc.streams[0]
        saturated = {gpu: saturated_throughput(sc, gpu) for gpu in sorted({g for _, g in POOL})}
        rng = random.Random(seed)
        mean_output = sum(stream.output.sample(rng) for _ in range(20_000)) / 20_000
        pool_tokens = sum(saturated[gpu] for _, gpu in POOL)
        return Plan(stream, saturated, mean_output, load * pool_tokens / mean_output)

    def request_shape(self, rng: random.Random) -> tuple[int, int]:
        """(prompt tokens, max_tokens) of one request."""
        return self.stream.prompt.sample(rng), self.stream.output.sample(rng)
