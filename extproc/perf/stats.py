"""Small, pure helpers of the benchmarks: percentiles, process CPU, Prometheus text sums."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Sequence

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile (0 < q <= 1) of `values`; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered) - 1e-9)))  # guard 0.99 * 100 = 98.99..
    return ordered[rank - 1]


def median(values: Iterable[float]) -> float:
    kept = [v for v in values if v == v]  # NaN (a path with no samples) never wins a median
    return statistics.median(kept) if kept else float("nan")


def parse_proc_stat(text: str) -> float:
    """utime + stime in seconds from a /proc/<pid>/stat line (the name may hold spaces or parens)."""
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_seconds(pid: int) -> float:
    """CPU a process has used so far (Linux /proc); NaN when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_proc_stat(f.read())
    except (OSError, IndexError, ValueError):
        return float("nan")


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and every live descendant (NaN when the process itself is unreadable)."""
    total = cpu_seconds(pid)
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return total
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
        for child in children:
            cpu = tree_cpu_seconds(child)
            if cpu == cpu:
                total += cpu
    return total


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size from /proc/<pid>/statm."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` in Prometheus text whose labels include `labels`.

    A minimal parser (no escapes inside label values are needed for our own metrics) so polling the
    gateway's /metrics costs the benchmark little.
    """
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name):]
        if rest[:1] == "{":
            close = rest.index("}")
            found = dict(_label(p) for p in rest[1:close].split(",") if p)
            if any(found.get(k) != v for k, v in labels.items()):
                continue
            rest = rest[close + 1:]
        elif rest[:1] != " " or labels:
            continue
        total += float(rest.split()[0])
    return total


def _label(pair: str) -> tuple[str, str]:
    key, _, value = pair.partition("=")
    return key.strip(), value.strip().strip('"')
