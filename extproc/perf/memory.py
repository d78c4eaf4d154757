"""`extproc bench memory`: RSS of the gateway's state machine over many requests, in process.

Each request is what the live server does for it: the request-headers and buffered-body ext_proc
messages (serialized as Envoy sends them, each with its own x-request-id) through `Stream.handle`,
the stream closed, then `gateway.complete(...)` as the access log would deliver it. RSS is sampled
every `--every` requests; nothing is asserted: the slope over the second half is reported
(bytes/request), so a leak shows as a number, not a test failure.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.extras import ToolsMissing, pyplot
from extproc.perf.stats import rss_bytes

MODEL = "bench"
_ID = b"0" * 24  # placeholder request id, replaced in the serialized bytes (same length)


@dataclass(slots=True)
class Curve:
    requests: list[int] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    seconds: float = 0.0
    routed: int = 0  # requests that got a pod (the rest were answered by the gateway: a bench bug)
    open_after: int = -1  # requests the gateway still holds open at the end (should be 0)

    def slope(self) -> float:
        """Least-squares bytes per request over the second half of the samples."""
        return slope(self.requests[len(self.requests) // 2:], self.rss[len(self.rss) // 2:])


def slope(x: list[int], y: list[int]) -> float:
    if len(x) < 2:
        return float("nan")
    mx, my = sum(x) / len(x), sum(y) / len(y)
    var = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / var if var else float("nan")


def _messages() -> tuple[bytes, list[bytes]]:
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

    headers = {":path": "/v1/chat/completions", ":method": "POST", ":authority": "gw",
               "x-request-id": _ID.decode(), "content-type": "application/json", "content-length": "100"}
    head = ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]))).SerializeToString()
    bodies = [ProcessingRequest(request_body=HttpBody(end_of_stream=True, body=json.dumps({
        "model": MODEL, "stream": stream, "max_tokens": 128,
        "messages": [{"role": "user", "content": f"prompt {i} " * 50}]}).encode())).SerializeToString()
        for i, stream in enumerate((True, False, True, True))]
    return head, bodies


def run(requests: int = 1_000_000, every: int = 50_000, pods: int = 16,
        progress: Any = print) -> Curve:
    from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

    from extproc.config import parse
    from extproc.server.gateway import Gateway
    from extproc.server.processor import Stream
    from extproc.vocabulary import RequestEnd

    gw = Gateway(parse({"models": {MODEL: {"pods": [
        {"name": f"pod-{i}", "address": f"10.0.{i // 256}.{i % 256}:8000"} for i in range(pods)]}}}, {}))
    head, bodies = _messages()
    rng = random.Random(1)
    curve = Curve()
    start = time.perf_counter()
    curve.requests.append(0)
    curve.rss.append(rss_bytes())
    for i in range(1, requests + 1):
        stream = Stream(gw)
        stream.handle(ProcessingRequest.FromString(head.replace(_ID, b"%024x" % i)))
        stream.handle(ProcessingRequest.FromString(bodies[i % len(bodies)]))
        stream.close(False)
        decision = stream.decision
        if decision is not None:
            curve.routed += 1
            gw.complete(decision.key, RequestEnd(200, output_tokens=rng.randint(1, 512),
                                                 token_source="usage"))
        if i % every == 0:
            curve.requests.append(i)
            curve.rss.append(rss_bytes())
            progress(f"{i:>9} requests  RSS {curve.rss[-1] / 2**20:7.1f} MiB  "
                     f"{(time.perf_counter() - start) / i * 1e6:5.1f} us/request")
        if i % 100_000 == 0:
            gw.refresh()  # the capacity loop's work, so its structures are exercised too
    curve.seconds = time.perf_counter() - start
    curve.open_after = len(gw.open)
    return curve


def plot(curve: Curve, path: Path) -> bool:
    """A PNG of the curve when matplotlib is installed (not a dependency of the gateway)."""
    try:
        plt = pyplot()
    except ToolsMissing:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r / 1e3 for r in curve.requests], [b / 2**20 for b in curve.rss], marker="o")
    ax.set_xlabel("requests (thousands)")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"gateway state machine RSS; slope {curve.slope():.2f} B/request over the 2nd half")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
