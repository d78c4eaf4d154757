"""One streamed OpenAI request, timed: TTFT, the gaps between tokens, E2E, and the output tokens received."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass(slots=True)
class RequestResult:
    ok: bool
    start: float  # the event loop's clock at send (wall time over HTTP, virtual time in a simulation)
    end: float = 0.0
    ttft: float | None = None
    output_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive tokens
    error: str = ""

    @property
    def e2e(self) -> float:
        return self.end - self.start


class StreamReader:
    """Feeds on SSE lines as they arrive; pure, so its parsing is testable without a server."""

    __slots__ = ("result", "_last", "_events", "_usage", "done")

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self._last = result.start
        self._events = 0
        self._usage: int | None = None
        self.done = False

    def feed(self, line: bytes, now: float) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return  # blank separators, comments, event names
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.result.error = "unparsable stream event"
            return
        if not isinstance(event, dict):
            return
        if "error" in event:  # vLLM reports mid-stream failures as an error event
            err = event["error"]
            self.result.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
            return
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self._usage = usage["completion_tokens"]
        if _has_text(event):
            if self.result.ttft is None:
                self.result.ttft = now - self.result.start
            else:
                self.result.gaps.append(now - self._last)
            self._last = now
            self._events += 1

    def finish(self, now: float) -> RequestResult:
        r = self.result
        r.end = now
        r.output_tokens = self._usage if self._usage is not None else self._events
        if not r.error and not self.done:
            r.error = "stream ended before [DONE]"
        if not r.error and r.ttft is None:
            r.error = "no tokens received"
        r.ok = not r.error
        return r


def _has_text(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if choice.get("text") or (isinstance(delta, dict) and delta.get("content")):
            return True
    return False


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str]) -> RequestResult:
    """Never raises for a failed request (cancellation aside): failures come back with `ok=False, error`.
    Timed on the event loop's clock, as the sweep that sends it (profiling/sweep.py)."""
    clock = asyncio.get_running_loop().time
    result = RequestResult(ok=False, start=clock())
    reader = StreamReader(result)
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:200]
                result.end, result.error = clock(), f"HTTP {resp.status}: {_message(text)}"
                return result
            async for line in resp.content:
                reader.feed(line, clock())
                if reader.done:
                    break
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        result.end, result.error = clock(), f"{type(exc).__name__}: {exc}"[:200]
        return result
    return reader.finish(clock())


def _message(text: str) -> str:
    """The OpenAI error message when the body is one, else the text."""
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except (ValueError, AttributeError):
        pass
    return text.strip()
