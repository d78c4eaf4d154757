"""Per-model 10-second request-trace windows, as AIBrix's gateway keeps them (pure: the caller passes `now`).

AIBrix (pkg/cache/trace.go, cache_trace.go) counts completed requests per (input, output) bucket, where a
bucket is log2(tokens) rounded to 0.1 and written as an integer in tenths: "<in>:<out>". Every 10 s it
writes the closed window to Redis at `aibrix:<model>_request_trace_<window end>` with meta fields the
optimizer reads (python/aibrix/aibrix/gpu_optimizer/load_monitor/load_reader.py). We write the same
keys and values, so AIBrix's optimizer reads our traces and ours reads AIBrix's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

TRACE_VERSION = 4  # v3 added meta_total_reqs/meta_pending_reqs, v4 meta_queueing_reqs
INTERVAL_SEC = 10
PRECISION = 10  # buckets per doubling of the token count (AIBrix: 1 / RequestTracePrecision)


def bucket(tokens: int, precision: int = PRECISION) -> int:
    """round(log2(tokens) × precision); tokens ≤ 1 → 0. Half rounds up, as Go's math.Round does."""
    if tokens <= 1:
        return 0
    return math.floor(math.log2(tokens) * precision + 0.5)


def trace_key_prefix(model: str) -> str:
    return f"aibrix:{model}_request_trace_"


def trace_key(model: str, window_end: int) -> str:
    return f"{trace_key_prefix(model)}{window_end}"


def window_end(now_wall: float, interval: int = INTERVAL_SEC) -> int:
    """The end of the window holding `now_wall`: windows are [k·interval, (k+1)·interval) of unix time."""
    return (int(now_wall) // interval + 1) * interval


TPOT_PRECISION = 32  # TPOT histogram buckets per doubling (2.2 % apart): round(log2(ms) x 32)
TPOT_KEY = "meta_tpot"  # ours: {deployment: {bucket: completed}}; AIBrix's reader skips meta_ keys
# ours, the same shape: the latencies a profile's SLO may name besides TPOT (gen-profile's "ttft",
# "e2e", "tpat")
LATENCY_KEYS = {"tpot": TPOT_KEY, "ttft": "meta_ttft", "e2e": "meta_e2e", "tpat": "meta_tpat"}
REJECTED_KEY = "meta_rejected"  # ours: {deployment: requests refused that it could have served}


def tpot_bucket(tpot_s: float) -> int:
    """The histogram bucket of a latency (a time per output token, a TTFT, an E2E):
    round(log2(milliseconds) x TPOT_PRECISION)."""
    return math.floor(math.log2(max(tpot_s * 1000.0, 1e-3)) * TPOT_PRECISION + 0.5)


def tpot_of_bucket(b: int) -> float:
    """Seconds at the bucket's centre."""
    return 2.0 ** (b / TPOT_PRECISION) / 1000.0


def _count(latency: dict[str, dict[str, dict[int, int]]], metric: str, deployment: str,
           seconds: float) -> None:
    """One request's latency in its metric's histogram of its deployment (no setdefault chain: this
    runs up to four times per completed request)."""
    per_deployment = latency.get(metric)
    if per_deployment is None:
        per_deployment = latency[metric] = {}
    hist = per_deployment.get(deployment)
    if hist is None:
        hist = per_deployment[deployment] = {}
    b = tpot_bucket(seconds)
    hist[b] = hist.get(b, 0) + 1


@dataclass(slots=True)
class _Window:
    counts: dict[str, int] = field(default_factory=dict)
    arrived: int = 0
    # metric ("tpot", "ttft", "e2e", "tpat") -> deployment -> bucket -> completed
    latency: dict[str, dict[str, dict[int, int]]] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)  # deployment -> refused requests


class TraceRecorder:
    """Counts arrivals and completions per model and window; `due` hands closed windows to the writer.

    Called from the request path, so each call is a couple of dict operations and never does I/O."""

    def __init__(self, interval: int = INTERVAL_SEC, precision: int = PRECISION,
                 max_windows: int = 10_000) -> None:
        self.interval = interval
        self.precision = precision
        self.max_windows = max_windows  # bounds memory if nothing drains `due` (no writer running)
        self.discarded = 0
        self._windows: dict[tuple[str, int], _Window] = {}
        self._gauges: dict[str, tuple[int, int]] = {}  # model -> (pending, queueing), latest snapshot

    def _window(self, model: str, now_wall: float) -> _Window:
        key = (model, window_end(now_wall, self.interval))
        w = self._windows.get(key)
        if w is None:
            if len(self._windows) >= self.max_windows:
                oldest = min(self._windows, key=lambda k: k[1])
                del self._windows[oldest]
                self.discarded += 1
            w = self._windows[key] = _Window()
        return w

    def arrived(self, model: str, now_wall: float) -> None:
        """A request of `model` was routed (AIBrix's meta_total_reqs counts these)."""
        self._window(model, now_wall).arrived += 1

    def completed(self, model: str, prompt_tokens: int, output_tokens: int, now_wall: float,
                  deployment: str = "", tpot_s: float | None = None, ttft_s: float | None = None,
                  e2e_s: float | None = None) -> None:
        """A request finished: count it in its (input, output) bucket of the window it finished in, and
        its latencies (time per output token, TTFT, E2E: those given; TPAT, E2E over every token of
        prompt and output, with E2E) in its deployment's histograms (what the optimizer's feedback
        reads: how each GPU type kept the SLO under the plan)."""
        w = self._window(model, now_wall)
        key = f"{bucket(prompt_tokens, self.precision)}:{bucket(output_tokens, self.precision)}"
        w.counts[key] = w.counts.get(key, 0) + 1
        if not deployment:
            return
        latency = w.latency
        if tpot_s is not None and tpot_s >= 0:
            _count(latency, "tpot", deployment, tpot_s)
        if ttft_s is not None and ttft_s >= 0:
            _count(latency, "ttft", deployment, ttft_s)
        if e2e_s is not None and e2e_s >= 0:
            _count(latency, "e2e", deployment, e2e_s)
            _count(latency, "tpat", deployment, e2e_s / max(1, prompt_tokens + output_tokens))

    def rejected(self, model: str, deployments: Iterable[str], now_wall: float) -> None:
        """The SLO router refused a request (a 429) that these deployments could have served within its
        SLO: a miss each of them did not have room for, which the optimizer's feedback counts against
        them (a refused request never completes, so its TPOT is never seen)."""
        w = self._window(model, now_wall)
        for d in deployments:
            w.rejected[d] = w.rejected.get(d, 0) + 1

    def snapshot(self, model: str, pending: int, queueing: int) -> None:
        """The model's in-flight count and SLO-queue length, reported with the next window written."""
        self._gauges[model] = (int(pending), int(queueing))

    def due(self, now_wall: float) -> list[tuple[str, str]]:
        """Closed windows as (redis key, JSON value), removed from the recorder; empty windows never exist."""
        closed = [k for k in self._windows if k[1] <= now_wall]
        out = []
        for model, end in sorted(closed, key=lambda k: (k[1], k[0])):
            w = self._windows.pop((model, end))
            pending, queueing = self._gauges.get(model, (0, 0))
            out.append((trace_key(model, end), json.dumps(self._value(w, pending, queueing),
                                                          separators=(",", ":"))))
        return out

    def _value(self, w: _Window, pending: int, queueing: int) -> dict[str, object]:
        value: dict[str, object] = dict(sorted(w.counts.items()))
        value.update(meta_v=TRACE_VERSION, meta_interval_sec=self.interval, meta_precision=self.precision,
                     meta_total_reqs=w.arrived, meta_pending_reqs=pending, meta_queueing_reqs=queueing)
        for metric, per_deployment in sorted(w.latency.items()):
            value[LATENCY_KEYS[metric]] = {d: {str(b): n for b, n in sorted(h.items())}
                                           for d, h in sorted(per_deployment.items())}
        if w.rejected:
            value[REJECTED_KEY] = dict(sorted(w.rejected.items()))
        return value

    def __len__(self) -> int:
        """Open (not yet written) windows, across models."""
        return len(self._windows)
