"""Client traffic for the fault matrix: background load that records what every client saw, streams
held open, and the engines' own token counters to hold the gateways' tally against."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.localstack import http_get, wait_until

CUT = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionError,
       asyncio.IncompleteReadError)


def engine_tokens(urls: Iterable[str]) -> float:
    """Sum of the engines' vllm:generation_tokens_total."""
    total = 0.0
    for url in urls:
        text = http_get(url + "/metrics")[1].decode()
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "vllm:generation_tokens_total")
    return total


def chat(model: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Say this is a test!"}],
            "max_tokens": max_tokens, "stream": stream}


async def request(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[str, float]:
    """(outcome, seconds): "200", another status with its error code, "done" / "cut" for a stream,
    or "refused" when nothing listened."""
    started = time.monotonic()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                error = (await resp.json(content_type=None))["error"]
                return f"{resp.status} {error.get('code')}", time.monotonic() - started
            if not body.get("stream"):
                await resp.read()
                return "200", time.monotonic() - started
            done = False
            async for line in resp.content:
                done = done or line.strip() == b"data: [DONE]"
            return ("done" if done else "cut"), time.monotonic() - started
    except aiohttp.ClientConnectorError:
        return "refused", time.monotonic() - started
    except CUT:
        return "cut", time.monotonic() - started


@dataclass
class Load:
    """Short requests one after another through each URL until stopped; every outcome kept."""

    urls: list[str]
    body: dict
    outcomes: Counter[str] = field(default_factory=Counter)
    longest: float = 0.0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def start(self) -> Load:
        self._tasks = [asyncio.create_task(self._run(url)) for url in self.urls]
        return self

    async def _run(self, url: str) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            while not self._stop.is_set():
                outcome, took = await request(session, url, self.body)
                self.outcomes[outcome] += 1
                self.longest = max(self.longest, took)
                if outcome == "refused":
                    await asyncio.sleep(0.05)  # nothing listening: do not spin

    async def stop(self) -> Counter[str]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes


async def fill_then_queue(client: Any, stack: Any, model: str, pod: str, fill_tokens: int,
                          messages: list[dict]) -> tuple[list[asyncio.Task], asyncio.Task]:
    """Two requests of `fill_tokens` fill `pod` (a profile whose every request holds half a pod), then a
    third, short one waits in the gateway's SLO queue: the fillers' tasks and the held request's (raw
    response)."""
    fill = [asyncio.create_task(client.chat.completions.create(model=model, messages=messages,
                                                               max_tokens=fill_tokens)) for _ in range(2)]
    await asyncio.to_thread(wait_until, lambda: stack.running(model, pod) == 2, 20, "pod full")
    queued = asyncio.create_task(client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=8))
    await asyncio.to_thread(wait_until, lambda: stack.sample("extproc_slo_queue_length", model=model) == 1,
                            20, "third request queued")
    return fill, queued
