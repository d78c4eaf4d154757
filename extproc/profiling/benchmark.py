"""`extproc benchmark`: a load plan (profiling/plan.py) run against an OpenAI endpoint over HTTP, written as
AIBrix's benchmark JSONL, one finished cell at a time.

Open-loop Poisson load per (input, output, rate) cell; with `admitted` (a profile made from such a run),
each of the profile's cells with the replica held at a per-pod budget of k requests in flight, for k =
Little's budget max(1, floor(tput x e2e)) times each of `budget_factors` (1, 2, 4, 8), and with
`max_budget` doubled past them while the largest meets the profile's SLOs and serves more. Those lines go to a
file of their own, since AIBrix's gen_profile would read them as rates. The load generator, the
measurement and the overload rule are profiling/sweep.py's, which the fleet simulation runs in virtual time.
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from extproc import extras
from extproc.profiling.client import RequestResult, send
from extproc.profiling.plan import LoadPlan
from extproc.profiling.records import MetricLine, write_lines
from extproc.profiling.sweep import Report, run_sweep
from extproc.profiling.workload import Cell, request_body

API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class EndpointError(RuntimeError):
    """The endpoint cannot be benchmarked at all (unreachable, wrong model, refused key)."""


@dataclass(frozen=True, slots=True)
class BenchmarkOptions:
    model: str
    endpoint: str
    output: Path
    plan: LoadPlan = LoadPlan()
    append: bool = False
    api: str = "completions"
    api_key: str | None = field(default=None, repr=False)  # never printed, never logged
    exact_length: bool = True
    temperature: float = 0.0
    fit_context: bool = False  # the default input grid: fitted to the model's context (`LoadPlan.fit`)

    def url(self) -> str:
        base = self.endpoint.rstrip("/")
        return base if base.endswith("/completions") else base + API_PATHS[self.api]

    def headers(self) -> dict[str, str]:
        headers = {"User-Agent": "extproc-benchmark"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def redact(self, text: str) -> str:
        return text.replace(self.api_key, "***") if self.api_key else text


def public_url(url: str) -> str:
    """The URL without user:password, for printing."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


class HttpEndpoint:
    """A sweep's requests as streamed OpenAI requests to `opts.url()`."""

    def __init__(self, session: aiohttp.ClientSession, opts: BenchmarkOptions) -> None:
        self._session, self._opts = session, opts
        self._url, self._headers = opts.url(), opts.headers()

    async def send(self, cell: Cell, rng: random.Random) -> RequestResult:
        o = self._opts
        body = request_body(o.api, o.model, cell.input_tokens, cell.output_tokens, rng, o.exact_length,
                            o.temperature)
        return await send(self._session, self._url, body, self._headers)

    def redact(self, text: str) -> str:
        return self._opts.redact(text)


def new_session() -> aiohttp.ClientSession:
    # limit=0: an open loop must not queue requests in the client's connection pool.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))


async def max_model_len(session: aiohttp.ClientSession, opts: BenchmarkOptions) -> int | None:
    """The model's context from `GET /v1/models` (vLLM's and engine-sim's model card carry
    `max_model_len`); None when the server does not say."""
    base = opts.url().rsplit("/v1/", 1)[0]
    try:
        async with session.get(base + "/v1/models", headers=opts.headers()) as resp:
            cards = (await resp.json(content_type=None)).get("data") if resp.status == 200 else None
    except (aiohttp.ClientError, OSError, ValueError, AttributeError):
        return None
    for card in cards if isinstance(cards, list) else ():
        if isinstance(card, dict) and card.get("id") == opts.model:
            value = card.get("max_model_len")
            return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    return None


async def preflight(endpoint: HttpEndpoint, opts: BenchmarkOptions) -> None:
    """One short request before hours of cells: a wrong URL, model or key fails here, clearly."""
    result = await endpoint.send(Cell(8, 1, 1.0), random.Random(opts.plan.seed))
    # Only what can never work stops the run: no connection, or a 4xx (wrong path, model or key). A 5xx or a
    # broken stream may be transient, and the cells count such failures anyway.
    if not result.ok and (not result.error.startswith("HTTP ") or result.error.startswith("HTTP 4")):
        raise EndpointError(f"cannot benchmark {public_url(opts.url())}: {opts.redact(result.error)}")


class Progress:
    """A tqdm bar measured in scheduled seconds (num_prompts / rate per cell), so its ETA is in time."""

    def __init__(self, plan: LoadPlan, stream: TextIO) -> None:
        tqdm = extras.tqdm()
        self._stream = stream
        self._bar = tqdm(total=sum(plan.scheduled_seconds(c) for c in plan.cells()), unit="s", file=stream,
                         smoothing=0, dynamic_ncols=True, disable=None,  # no bar when not a terminal
                         bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}")

    def start(self, cell: Cell) -> None:
        self._bar.set_description(cell.label(), refresh=False)

    def advance(self, seconds: float) -> None:
        self._bar.update(seconds)

    def note(self, text: str) -> None:
        self._bar.write(text, file=self._stream)

    def close(self) -> None:
        self._bar.close()


async def run_benchmark(opts: BenchmarkOptions, stop: asyncio.Event, stream: TextIO = sys.stderr) -> Report:
    """Runs every cell until done or `stop` is set; a cell stopped half-way is dropped, finished ones kept."""
    async with new_session() as session:
        endpoint = HttpEndpoint(session, opts)
        await preflight(endpoint, opts)
        plan = opts.plan
        if opts.fit_context and (context := await max_model_len(session, opts)) is not None:
            plan = plan.fit(context)
            if plan is not opts.plan:
                stream.write(f"input lengths fitted to the model's {context}-token context: "
                             f"{','.join(str(i) for i in plan.input_lens)}\n")
        progress = Progress(plan, stream)
        try:
            with open(opts.output, "a" if opts.append else "w", encoding="utf-8") as out:
                def write(lines: list[MetricLine]) -> None:
                    write_lines(out, lines)

                return await run_sweep(endpoint, plan, write, opts.model, opts.temperature, progress, stop)
        finally:
            progress.close()
