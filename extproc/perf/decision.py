"""Routing decision time, in process: `Gateway.route` over pools of 10, 100 and 1000 pods.

Each decision is timed alone (perf_counter_ns around `route`); requests are completed through
`gateway.complete` as the access log would, so counts stay bounded, and some stay in flight so the
strategy sees unequal pods. `gateway.refresh()` runs as the 1 s background loop would, folding the
completed tokens into capacity estimates: load-balance decides on its real inputs.
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Any

from extproc.perf.stats import median, percentile

MODEL = "bench"
REFRESH_EVERY = 200  # decisions between capacity refreshes (the live loop runs once a second)


def _gateway(pods: int, strategy: str) -> Any:
    from extproc.config import parse
    from extproc.server.gateway import Gateway

    gpus = ("A100", "H100", "L20", "V100")
    config = parse({"models": {MODEL: {"pods": [
        {"name": f"pod-{i}", "address": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000",
         "labels": {"gpu": gpus[i % len(gpus)]}} for i in range(pods)]}},
        "routing": {"default_strategy": strategy, "seed": 1}}, {})
    return Gateway(config)


def decision_times(pod_counts: tuple[int, ...] = (10, 100, 1000), decisions: int = 3000,
                   strategy: str | None = None) -> dict[str, Any]:
    """Median and p99 µs per decision for each pool size."""
    from extproc.openai import Request
    from extproc.perf.stack import strategy_for_bench

    name = strategy or strategy_for_bench()
    rng = random.Random(1)
    out: dict[str, Any] = {"strategy": name}
    for n in pod_counts:
        gw = _gateway(n, name)
        profile = gw.profile(name)
        requests = [Request(model=MODEL, path="/v1/chat/completions", stream=True,
                            prompt_tokens=rng.randint(50, 2000), max_tokens=rng.randint(16, 512))
                    for _ in range(64)]
        in_flight: deque[str] = deque()
        keep = 2 * n  # requests left running: the pods differ in load, as in a busy fleet
        samples: list[float] = []
        for i in range(decisions + keep):
            request = requests[i % len(requests)]
            t = time.perf_counter_ns()
            decision = gw.route(request, profile, "bench")
            elapsed = time.perf_counter_ns() - t
            if decision is None:
                raise RuntimeError(f"no pod chosen among {n}")
            if i >= keep:
                samples.append(elapsed / 1e3)
            in_flight.append(decision.key)
            if len(in_flight) > keep:
                gw.complete(in_flight.popleft(), status=200, output_tokens=rng.randint(16, 512),
                            token_source="usage")
            if i % REFRESH_EVERY == 0:
                gw.refresh()
        while in_flight:
            gw.complete(in_flight.popleft(), status=200, output_tokens=1)
        out[str(n)] = median(samples)
        out[f"{n}_p99"] = percentile(samples, 0.99)
    return out
