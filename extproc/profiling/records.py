"""AIBrix's benchmark JSONL: one line per (input_tokens, output_tokens, request_rate, metric).

    {"input_tokens": 128, "output_tokens": 4, "request_rate": 1.0, "seed": 0, "model": "llama2-7b",
     "samples": 100, "metric": "E2E", "mean": 0.57, "P50": 0.07, "P90": 1.5, "P99": 3.9}

Throughput lines (TPUT, TT) carry only `mean`, as AIBrix writes them. Extra keys (AIBrix's `temperature`,
our `failed`, `unfinished`, `overloaded`) are kept but ignored by AIBrix's reader, which picks its columns.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

THROUGHPUT_METRICS = ("TPUT", "TT")  # completed requests/s, output tokens/s: higher is better
TIME_METRICS = ("E2E", "TTFT", "TPOT")  # seconds: lower is better
METRICS = THROUGHPUT_METRICS + TIME_METRICS  # the order AIBrix writes a cell's lines in
STAT_KEYS = ("mean", "P50", "P90", "P99")
KEY_ORDER = ("input_tokens", "output_tokens", "request_rate", "seed", "model", "temperature", "samples",
             "metric", *STAT_KEYS)


class BenchmarkError(ValueError):
    """A benchmark file that cannot be used; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class MetricLine:
    input_tokens: int
    output_tokens: int
    request_rate: float
    metric: str
    stats: Mapping[str, float | None]  # mean/P50/P90/P99 that the line has; None: nothing was measured
    extra: Mapping[str, Any] = field(default_factory=dict)  # seed, model, samples, failed, ...

    def stat(self, key: str) -> float | None:
        value = self.stats.get(key)
        return None if value is None or math.isnan(value) else value

    def to_json(self) -> str:
        data: dict[str, Any] = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                                "request_rate": self.request_rate, **self.extra, "metric": self.metric,
                                **self.stats}
        ordered = {k: data[k] for k in KEY_ORDER if k in data}
        ordered.update((k, v) for k, v in data.items() if k not in ordered)
        return json.dumps(ordered)


def _number(obj: Mapping[str, Any], key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BenchmarkError(f"{where}: '{key}' must be a number, got {value!r}")
    return float(value)


def parse_line(obj: Any, where: str) -> MetricLine:
    if not isinstance(obj, dict):
        raise BenchmarkError(f"{where}: expected a JSON object")
    metric = obj.get("metric")
    if not isinstance(metric, str) or not metric:
        raise BenchmarkError(f"{where}: 'metric' is missing")
    tokens = {k: _number(obj, k, where) for k in ("input_tokens", "output_tokens")}
    if any(v != int(v) or v < 0 for v in tokens.values()):
        raise BenchmarkError(f"{where}: token counts must be non-negative integers")
    rate = _number(obj, "request_rate", where)
    stats: dict[str, float | None] = {}
    for key in STAT_KEYS:
        if key in obj:
            stats[key] = None if obj[key] is None else _number(obj, key, where)
    if "mean" not in stats:
        raise BenchmarkError(f"{where}: 'mean' is missing")
    known = {"input_tokens", "output_tokens", "request_rate", "metric", *STAT_KEYS}
    return MetricLine(int(tokens["input_tokens"]), int(tokens["output_tokens"]), rate, metric, stats,
                      {k: v for k, v in obj.items() if k not in known})


def read_lines(stream: TextIO, name: str) -> list[MetricLine]:
    lines = []
    for number, text in enumerate(stream, 1):
        if not text.strip():
            continue  # AIBrix's files start with a blank line
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BenchmarkError(f"{name}:{number}: not JSON ({exc.msg})") from None
        lines.append(parse_line(obj, f"{name}:{number}"))
    if not lines:
        raise BenchmarkError(f"{name}: no benchmark lines")
    return lines


def read_benchmark(path: str | Path) -> list[MetricLine]:
    try:
        with open(path, encoding="utf-8") as stream:
            return read_lines(stream, str(path))
    except OSError as exc:
        raise BenchmarkError(f"cannot read benchmark file {path}: {exc.strerror}") from None


def write_lines(stream: TextIO, lines: Iterable[MetricLine]) -> None:
    stream.writelines(line.to_json() + "\n" for line in lines)
    stream.flush()  # a finished cell is on disk before the next one starts
