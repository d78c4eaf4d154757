"""Open-loop load: Poisson arrivals at a fixed rate, whatever the replies are doing.

Requests are non-streaming chat completions, so Envoy, the gateway and this client do work per
request, not per token: at the demo's ~37 requests/s the 2-core machine stays far from its limit and
the latencies measured are the simulated GPUs' (the summary prints each process's CPU share to show it).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass

import aiohttp

from extproc.demo.plan import MODEL, Plan
from extproc.envoy_contract import STRATEGY_HEADER, TARGET_POD_HEADER


@dataclass(slots=True)
class Outcome:
    sent_at: float               # monotonic seconds
    pod: str = ""                # the target-pod response header
    status: int = 0              # 0: no answer (connection error or timeout)
    latency_s: float | None = None
    output_tokens: int = 0
    unfinished: bool = False     # still running when the phase stopped waiting: latency is a lower bound


def _body(prompt_tokens: int, max_tokens: int) -> dict:
    # Random text: no two requests share a prefix, so the engines' prefix caches stay out of the result.
    # The simulator counts ~4 characters per token.
    content = os.urandom(max(1, prompt_tokens * 2)).hex()
    return {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}


async def _one(session: aiohttp.ClientSession, url: str, strategy: str, body: dict, out: Outcome) -> None:
    try:
        async with session.post(url, json=body, headers={STRATEGY_HEADER: strategy}) as resp:
            data = await resp.json(content_type=None)
            out.status = resp.status
            out.pod = resp.headers.get(TARGET_POD_HEADER, "")
            if resp.status == 200:
                out.output_tokens = int(data["usage"]["completion_tokens"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
        out.status = 0
    finally:
        out.latency_s = time.monotonic() - out.sent_at


async def drive(base_url: str, strategy: str, plan: Plan, duration_s: float, rng: random.Random,
                session: aiohttp.ClientSession, outcomes: list[Outcome], tasks: set[asyncio.Task],
                rate: float | None = None) -> None:
    """Send requests for `duration_s` at `rate` (default `plan.rate`); each Outcome is appended when sent
    and filled in when answered; the tasks still running are left in `tasks` for the caller to await."""
    url = base_url + "/v1/chat/completions"
    rate = rate or plan.rate
    loop = asyncio.get_running_loop()
    start = next_at = loop.time()
    while True:
        next_at += rng.expovariate(rate)
        if next_at - start >= duration_s:
            break
        await asyncio.sleep(max(0.0, next_at - loop.time()))
        out = Outcome(sent_at=time.monotonic())
        outcomes.append(out)
        task = asyncio.create_task(_one(session, url, strategy, _body(*plan.request_shape(rng)), out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.sleep(max(0.0, start + duration_s - loop.time()))
