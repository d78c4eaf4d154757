"""What the rate-limit check costs a request, in process: the gateway's whole request side (an ext_proc
headers + body pair through `Processor.serve`, routing included) with limits off, on but with none
for the request's model or key, on in process, and on through Redis (`--redis-url`), side by side in rounds;
the differences of the medians against the routing decision alone (`extproc.perf.decision`).

`extproc bench limits [--requests N] [--rounds R] [--redis-url URL]`
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any

from extproc.perf.stats import median

MODEL = "bench"
PODS = 100
CHAT = json.dumps({"model": MODEL, "max_tokens": 64,
                   "messages": [{"role": "user", "content": "Say this is a test! " * 20}]}).encode()
OTHER_KEY = hashlib.sha256(b"someone-else").hexdigest()
VARIANTS: dict[str, dict[str, Any] | None] = {
    "off": None,
    # limits configured, none for this request (the issue bounds these: <= 10 % of a decision)
    "on, none for this model": {"overrides": [{"model": "other", "requests_per_minute": 1}]},
    "on, none for this key": {"overrides": [{"api_key_sha256": OTHER_KEY, "requests_per_minute": 1}]},
    "on, in process": {"requests_per_minute": 10**9, "tokens_per_minute": 10**12},
    "on, Redis": {"requests_per_minute": 10**9, "tokens_per_minute": 10**12},
}


def _messages() -> list:
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

    headers = {":path": "/v1/chat/completions", ":method": "POST", "authorization": "Bearer sk-bench",
               "content-length": str(len(CHAT))}
    return [ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=[
                HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]))),
            ProcessingRequest(request_body=HttpBody(body=CHAT, end_of_stream=True))]


def _processor(limits: dict[str, Any] | None, redis_url: str | None) -> Any:
    from extproc.config import parse
    from extproc.ratelimit import RateLimiter
    from extproc.ratelimit.redis_store import RedisStore
    from extproc.server.gateway import Gateway
    from extproc.server.processor import Processor

    raw: dict[str, Any] = {"models": {MODEL: {"pods": [
        {"name": f"pod-{i}", "address": f"10.0.{i // 256}.{i % 256}:8000"} for i in range(PODS)]},
        "other": {"pods": [{"name": "other-0", "address": "10.1.0.1:8000"}]}},
        "routing": {"default_strategy": "least-request"}}
    if limits is not None:
        raw["rate_limits"] = {**limits, "redis_timeout_ms": 100}
    config = parse(raw, {})
    store = RedisStore(redis_url, config.rate_limits.redis_timeout_s) if redis_url else None
    gw = Gateway(config, limiter=RateLimiter(config.rate_limits, store=store))
    return Processor(gw)


async def _run(requests: int, rounds: int, redis_url: str | None) -> dict[str, float]:
    import grpc

    from extproc.vocabulary import RequestEnd

    messages = _messages()
    names = [n for n in VARIANTS if redis_url or n != "on, Redis"]
    processors = {n: _processor(VARIANTS[n], redis_url if n == "on, Redis" else None) for n in names}
    samples: dict[str, list[float]] = {n: [] for n in names}
    replies: list = []

    async def serve(proc: Any) -> None:
        """One stream through Processor.serve, as gRPC drives it (its read/write API)."""
        left = iter(messages)
        replies.clear()

        async def read():
            return next(left, grpc.aio.EOF)

        async def write(reply) -> None:
            replies.append(reply)

        await proc.serve(read, write)

    for _ in range(rounds):
        for name in names:
            proc = processors[name]
            gw = proc._gw
            for _ in range(requests):
                t = time.perf_counter_ns()
                await serve(proc)
                samples[name].append((time.perf_counter_ns() - t) / 1e3)
                key = replies[-1].dynamic_metadata.fields["extproc"].struct_value.fields["key"].string_value
                gw.complete(key, RequestEnd(200, output_tokens=64))  # counts stay bounded
    check = {n: _check_alone(processors[n]._gw.limiter) for n in names if n != "on, Redis"}
    for proc in processors.values():
        await proc._gw.limiter.close()
    return {n: median(v) for n, v in samples.items()}, check


def _check_alone(limiter: Any, batches: int = 50, per_batch: int = 2000) -> float:
    """Median µs of the synchronous check (`budget`, plus `admit_here` when a limit applies), timed in
    batches: the part of the request's side the limits add, without the rest's noise."""
    from extproc.openai import parse_request

    request = parse_request("/v1/chat/completions", CHAT)
    authorization = "Bearer sk-bench"
    times = []
    for _ in range(batches):
        t = time.perf_counter_ns()
        for _ in range(per_batch):
            if limiter.enabled and (budget := limiter.budget(authorization, request)) is not None:
                limiter.admit_here(budget, request)
        times.append((time.perf_counter_ns() - t) / per_batch / 1e3)
    return median(times)


def limit_times(requests: int = 2000, rounds: int = 5, redis_url: str | None = None) -> dict[str, Any]:
    from extproc.perf.decision import decision_times

    medians, check = asyncio.run(_run(requests, rounds, redis_url))
    decision = decision_times(pod_counts=(PODS,), decisions=3000)[str(PODS)]
    return {"request_us": medians, "decision_us": decision, "check_us": check,
            "added_us": {n: v - medians["off"] for n, v in medians.items() if n != "off"}}


def render(result: dict[str, Any]) -> str:
    decision = result["decision_us"]
    lines = [f"routing decision alone, {PODS} pods: {decision:.1f} µs (median)", "",
             "| limits | request side (µs, median) | added vs off | check alone (µs) | check / decision |",
             "|---|---|---|---|---|"]
    for name, value in result["request_us"].items():
        added = result["added_us"].get(name)
        check = result["check_us"].get(name)
        lines.append(f"| {name} | {value:.1f} | {'' if added is None else f'{added:+.1f}'} | "
                     f"{'' if check is None else f'{check:.2f}'} | "
                     f"{'' if check is None else f'{100 * check / decision:.1f} %'} |")
    return "\n".join(lines)
