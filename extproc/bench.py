"""`make bench`: what the gateway costs on the request path, measured side by side in one run.

1. In process: CPU time of the ext_proc state machine for one whole request (headers, body, route,
   response headers, N streamed chunks), without gRPC. The floor the server adds per request/chunk.
2. End to end, on real processes: the same load sent (a) to the engine directly, (b) through Envoy
   without ext_proc (the client names the pod: the baseline proxy cost), (c) through Envoy + the
   gateway. Rounds alternate the three so machine noise hits each alike; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from extproc.config import parse
from extproc.envoy_bootstrap import BootstrapOptions
from extproc.localstack import (
    LocalStack,
    Proc,
    bootstrap_without_ext_proc,
    free_port,
    http_get,
    port_open,
    start_envoy,
)

MODEL = "llama2-7b"


def bench_state_machine(chunks: int, n: int = 20000) -> dict[str, float]:
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

    from extproc.server.gateway import Gateway
    from extproc.server.processor import Stream

    gw = Gateway(parse({"models": {MODEL: {"pods": [
        {"name": f"p{i}", "address": f"10.0.0.{i}:8000"} for i in range(8)]}}}, {}))

    def headers(pairs: dict[str, str], eos: bool = False) -> HttpHeaders:
        return HttpHeaders(end_of_stream=eos, headers=HeaderMap(
            headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))

    # Serialized as Envoy sends them, so parsing is part of the measured cost.
    wire = [ProcessingRequest(request_headers=headers({
                ":path": "/v1/chat/completions", ":method": "POST", ":authority": "gw", "x-request-id": "r",
                "content-type": "application/json", "user-agent": "bench", "accept": "*/*"})),
            ProcessingRequest(request_body=HttpBody(end_of_stream=True, body=json.dumps({
                "model": MODEL, "stream": True, "max_tokens": chunks,
                "messages": [{"role": "user", "content": "x" * 2000}]}).encode())),
            ProcessingRequest(response_headers=headers({":status": "200",
                                                        "content-type": "text/event-stream"}))]
    wire = [m.SerializeToString() for m in wire]
    sse = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    chunk = ProcessingRequest(response_body=HttpBody(body=sse))
    last = ProcessingRequest(response_body=HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))
    chunk_wire, last_wire = chunk.SerializeToString(), last.SerializeToString()

    def one_request() -> None:
        s = Stream(gw)
        for raw in wire:
            s.handle(ProcessingRequest.FromString(raw)).SerializeToString()
        for _ in range(chunks):
            s.handle(ProcessingRequest.FromString(chunk_wire)).SerializeToString()
        s.handle(ProcessingRequest.FromString(last_wire)).SerializeToString()
        s.close()

    def per_call(fn, count: int) -> float:
        start = time.process_time()
        for _ in range(count):
            fn()
        return (time.process_time() - start) / count * 1e6

    def one_chunk() -> None:
        stream.handle(ProcessingRequest.FromString(chunk_wire)).SerializeToString()

    stream = Stream(gw)
    request_us = statistics.median(per_call(one_request, n // max(chunks, 1) + 100) for _ in range(5))
    chunk_us = statistics.median(per_call(one_chunk, n) for _ in range(5))
    return {"request_us": request_us, "chunk_us": chunk_us}


async def drive(url: str, n: int, concurrency: int, stream: bool, tokens: int,
                headers: dict[str, str]) -> dict[str, float]:
    body = {"model": MODEL, "stream": stream, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "Say this is a test!"}]}
    latencies: list[float] = []
    queue = iter(range(n))

    async def worker(session: aiohttp.ClientSession) -> None:
        for _ in queue:
            start = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            latencies.append(time.perf_counter() - start)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {"rps": n / elapsed, "p50_ms": latencies[len(latencies) // 2] * 1e3}


def end_to_end(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    log_dir = Path(tempfile.mkdtemp(prefix="extproc-bench-"))
    port = free_port()
    engine = Proc("engine", [sys.executable, "-m", "extproc", "engine-sim", "--gpu", "H100",
                             "--model", MODEL, "--port", str(port), "--time-scale", "1000"], log_dir)
    engine.wait_ready(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200)
    address = f"127.0.0.1:{port}"
    stack = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
    stack.write_config({"models": {MODEL: {"pods": [{"name": "h100-0", "address": address}]}}})
    stack.start_gateway()
    stack.start_envoy()

    # The same Envoy without the ext_proc filter: the client sets the destination header itself.
    plain_port, plain_admin = free_port(), free_port()
    envoy_plain = start_envoy("envoy-plain", bootstrap_without_ext_proc(BootstrapOptions(
        listen_port=plain_port, listen_address="127.0.0.1", admin_port=plain_admin)), log_dir)
    envoy_plain.wait_ready(lambda: port_open(plain_port))

    targets = {
        "direct": (f"http://{address}", {}),
        "envoy": (f"http://127.0.0.1:{plain_port}", {"x-gateway-destination-endpoint": address}),
        "envoy+gateway": (stack.url, {}),
    }
    results: dict[str, list[dict[str, float]]] = {f"{k} {m}": [] for k in targets for m in ("json", "sse")}
    try:
        for _ in range(args.rounds):
            for name, (url, headers) in targets.items():
                for mode, stream in (("json", False), ("sse", True)):
                    results[f"{name} {mode}"].append(asyncio.run(drive(
                        url, args.requests, args.concurrency, stream, args.tokens, headers)))
    finally:
        envoy_plain.stop()
        stack.stop()
        engine.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens (= SSE chunks) per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args(argv)

    sm = bench_state_machine(args.tokens)
    print(f"state machine, in process: {sm['request_us']:.0f} us CPU per request with {args.tokens} "
          f"streamed chunks; {sm['chunk_us']:.1f} us per chunk")
    if args.skip_e2e:
        return 0
    results = end_to_end(args)
    print(f"\nend to end: {args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}, "
          f"{args.tokens} tokens each (medians of rounds)")
    print(f"{'path':22} {'req/s':>8} {'p50 ms':>8} {'req/s vs direct':>16}")
    medians = {k: {m: statistics.median(r[m] for r in v) for m in ("rps", "p50_ms")}
               for k, v in results.items()}
    for key, m in medians.items():
        base = medians["direct " + key.split()[-1]]["rps"]
        print(f"{key:22} {m['rps']:8.0f} {m['p50_ms']:8.1f} {m['rps'] / base:16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
