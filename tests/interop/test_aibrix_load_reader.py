"""AIBrix's own GatewayLoadReader (aibrix 0.8.0, load_monitor/load_reader.py) reads the windows that
several of our gateways merged in a real redis-server (extproc.tracing.merge): the summed counts, the
summed arrival rate, and it skips our `meta_tpot` and `meta_writers` fields."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import asyncio as aioredis

from extproc.tracing import TraceFlusher, TraceRecorder
from tests.support.redis_server import RedisServer

MODEL = "llama2-7b"
END = 1_700_000_010

# Runs in AIBrix's interpreter: its reader's first read scans every window of the model, in time order.
READER = """
import json, sys
from redis import Redis
from aibrix.gpu_optimizer.load_monitor.load_reader import GatewayLoadReader

reader = GatewayLoadReader(Redis.from_url(sys.argv[1]), sys.argv[2])
records, rate = reader.read(float(sys.argv[3]))
print(json.dumps({"records": [list(r) for r in records], "rate": rate}))
"""

# (gateway, window) -> completed requests per (prompt, output) tokens; arrivals are completions + 1
TRAFFIC = {
    (0, 0): {(128, 8): 5, (1024, 128): 2},
    (1, 0): {(128, 8): 3},
    (2, 0): {(16, 16): 4},
    (0, 1): {(128, 8): 1},
    (1, 1): {(1024, 128): 6},
    (2, 1): {(128, 8): 2, (16, 16): 1},
}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("aibrix-load-reader")))
    yield server
    server.stop()


async def write_windows(url: str) -> None:
    """Three gateways, each its own recorder, flusher and connection; each window flushed by all at once."""
    recorders = [TraceRecorder() for _ in range(3)]
    for (gateway, window), shapes in TRAFFIC.items():
        at = END + 10 * window - 5.0
        recorders[gateway].arrived(MODEL, at)  # one request still in flight at the window's end
        for (prompt, output), n in shapes.items():
            for _ in range(n):
                recorders[gateway].arrived(MODEL, at)
                recorders[gateway].completed(MODEL, prompt, output, at, "default/a100", 0.02)
    clients = [aioredis.Redis.from_url(url) for _ in recorders]
    flushers = [TraceFlusher(c, r) for c, r in zip(clients, recorders)]
    try:
        for window in range(2):
            now = END + 10 * window + 1.0
            written = await asyncio.gather(*(f.flush(now) for f in flushers))
            assert written == [1, 1, 1]
    finally:
        for c in clients:
            await c.aclose()


def test_aibrix_reader_sees_every_gateways_requests(aibrix_python: Path, redis_server: RedisServer) -> None:
    asyncio.run(write_windows(redis_server.url))
    done = subprocess.run([str(aibrix_python), "-c", READER, redis_server.url, MODEL, str(END)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])

    read: Counter[tuple[int, float, float]] = Counter()
    for ts, prompt_log2, output_log2, freq in seen["records"]:
        read[(int(ts), prompt_log2, output_log2)] += freq
    sent: Counter[tuple[int, float, float]] = Counter()
    for (_, window), shapes in TRAFFIC.items():
        for (prompt, output), n in shapes.items():
            # AIBrix's reader gives log2(tokens) at the gateway's 0.1 precision
            cell = {8: 3.0, 16: 4.0, 128: 7.0, 1024: 10.0}
            sent[(END + 10 * window, cell[prompt], cell[output])] += n
    assert read == sent
    # the rate is the newest window's arrivals (meta_total_reqs, every gateway's) over its 10 s
    last_arrivals = sum(sum(shapes.values()) + 1 for (_, w), shapes in TRAFFIC.items() if w == 1)
    assert seen["rate"] == pytest.approx(last_arrivals / 10)
