"""`extproc bench floor`: what a trivial ext_proc server costs per stream, the floor under the gateway.

The server reads one `ProcessingRequest` (a buffered chat body with request attributes, as Envoy sends
the gateway) and answers one `ProcessingResponse` (a header mutation and dynamic metadata), with no
routing at all. A client in this process keeps `concurrency` streams going (each: write, read, half-close,
read the end, check OK), either back to back or started at a fixed `rate`, and the server's CPU over the
measured seconds (/proc) is divided by the streams completed. Variants run interleaved round by round,
so their differences are not the machine's drift.

  grpc.aio  the gateway's server (one process, one event loop)
  sync      grpc's thread-pool server (`--threads`): a thread per open stream
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg

from extproc.localstack import Proc, free_port, port_open
from extproc.perf.stats import cpu_seconds, median

METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
BODY = json.dumps({"model": "m", "max_tokens": 128, "messages": [
    {"role": "system", "content": "You are a helpful assistant. " * 3},
    {"role": "user", "content": "summarise in one line: " + "lorem ipsum " * 8}]}).encode()
VARIANTS = ("aio", "sync")


def request() -> ep.ProcessingRequest:
    msg = ep.ProcessingRequest()
    msg.request_body.body = BODY
    msg.request_body.end_of_stream = True
    attrs = msg.attributes["envoy.filters.http.ext_proc"]
    attrs.fields["request.path"].string_value = "/v1/chat/completions"
    attrs.fields["request.method"].string_value = "POST"
    return msg


def response() -> ep.ProcessingResponse:
    msg = ep.ProcessingResponse()
    header = msg.request_body.response.header_mutation.set_headers.add()
    header.header.key = "x-gateway-destination-endpoint"
    header.header.raw_value = b"10.0.0.17:8000"
    msg.dynamic_metadata.fields["pod"].string_value = "10.0.0.17:8000"
    msg.dynamic_metadata.fields["model"].string_value = "m"
    return msg


def serve(variant: str, port: int, threads: int) -> None:
    """The trivial server (run as `python -m extproc.perf.floor VARIANT PORT THREADS`)."""
    if variant == "aio":
        class AioProcessor(epg.ExternalProcessorServicer):
            async def Process(self, requests, context):  # noqa: N802
                async for _ in requests:
                    yield response()

        async def main() -> None:
            server = grpc.aio.server()
            epg.add_ExternalProcessorServicer_to_server(AioProcessor(), server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            await server.wait_for_termination()

        asyncio.run(main())
    else:
        class SyncProcessor(epg.ExternalProcessorServicer):
            def Process(self, requests, context):  # noqa: N802
                for _ in requests:
                    yield response()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
        epg.add_ExternalProcessorServicer_to_server(SyncProcessor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()


async def _load(port: int, pid: int, concurrency: int, rate: float, duration: float) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    counts = {"done": 0, "errors": 0}
    stop = False
    next_start = [loop.time()]
    msg = request()

    async def worker(open_stream) -> None:  # type: ignore[no-untyped-def]
        while not stop:
            if rate:
                at = max(loop.time(), next_start[0])
                next_start[0] = at + 1.0 / rate
                await asyncio.sleep(at - loop.time())
            call = open_stream()
            try:
                await call.write(msg)
                reply = await call.read()
                await call.done_writing()
                end = await call.read()
                ok = await call.code() == grpc.StatusCode.OK and end is grpc.aio.EOF
                counts["done" if ok and reply.HasField("request_body") else "errors"] += 1
            except grpc.RpcError:
                counts["errors"] += 1

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        open_stream = channel.stream_stream(METHOD, request_serializer=ep.ProcessingRequest.SerializeToString,
                                            response_deserializer=ep.ProcessingResponse.FromString)
        workers = [asyncio.create_task(worker(open_stream)) for _ in range(concurrency)]
        await asyncio.sleep(min(1.0, duration / 3))  # warm-up
        n0, cpu0, t0 = counts["done"], cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(duration)
        n1, cpu1, t1 = counts["done"], cpu_seconds(pid), time.monotonic()
        stop = True
        await asyncio.gather(*workers, return_exceptions=True)
    n = n1 - n0
    per_stream = (cpu1 - cpu0) / n * 1e6 if n else float("nan")
    return {"streams_per_s": n / (t1 - t0), "server_us_per_stream": per_stream, "errors": counts["errors"]}


def run(variants: tuple[str, ...], rates: tuple[float, ...], concurrency: int, duration: float, rounds: int,
        threads: int, log_dir: Path) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {}
    for r in range(rounds):
        for rate in rates:
            for i in range(len(variants)):
                variant = variants[(i + r) % len(variants)]  # rotate: no variant always goes first
                port = free_port()
                argv = [sys.executable, "-m", "extproc.perf.floor", variant, str(port), str(threads)]
                proc = Proc(f"floor-{variant}", argv, log_dir)
                try:
                    proc.wait_ready(lambda: port_open(port))
                    result = asyncio.run(_load(port, proc.popen.pid, concurrency, rate, duration))
                finally:
                    proc.stop()
                runs.setdefault(f"{variant}@{rate:g}", []).append(result)
                print(f"round {r + 1} {variant:5} rate {rate or 'closed':>6}: "
                      f"{result['server_us_per_stream']:6.0f} us/stream, "
                      f"{result['streams_per_s']:6.0f} streams/s", file=sys.stderr, flush=True)
    return runs


def render(runs: dict[str, list[dict[str, float]]], concurrency: int) -> str:
    lines = [f"{'server':8} {'load':>14} {'us/stream':>10} {'streams/s':>10}  "
             f"(medians, {concurrency} streams max)"]
    for key, rs in runs.items():
        variant, rate = key.split("@")
        load = "closed loop" if rate == "0" else f"{rate}/s paced"
        lines.append(f"{variant:8} {load:>14} {median(r['server_us_per_stream'] for r in rs):10.0f} "
                     f"{median(r['streams_per_s'] for r in rs):10.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
