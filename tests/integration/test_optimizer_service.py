"""`extproc optimizer` as a real process against a real redis-server: traces written by the gateway's
recorder change the plan it serves; min_replicas with no load; the override; the dashboard in Chromium."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import yaml

from extproc.gpu_profiles import dump_profile
from extproc.localstack import VENV_BIN, Proc, free_port, http_get, wait_until
from extproc.tracing import TraceFlusher, TraceRecorder
from tests.unit.optimizer.support import LONG, SHORT, profile

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed"),
]

MODEL = "llama"
METRIC = re.compile(r'^vllm:deployment_replicas\{model_name="llama"\} (\d+)$', re.M)


def _pong(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("optimizer")


@pytest.fixture(scope="module")
def redis_url(log_dir: Path) -> Iterator[str]:
    port = free_port()
    proc = Proc(
        f"redis-{port}",
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        log_dir,
    )
    proc.wait_ready(lambda: _pong(port), timeout=15)
    yield f"redis://127.0.0.1:{port}/0"
    proc.stop()


@pytest.fixture(scope="module")
def optimizer(log_dir: Path, redis_url: str) -> Iterator[int]:
    # a100 is 5x faster on short requests, l20 5x faster on long ones, at the same price
    for name, short, long in (("llama-a100", 10, 1), ("llama-l20", 2, 5)):
        (log_dir / f"{name}.json").write_text(json.dumps(dump_profile(profile(name, 1.0, short, long))))
    (log_dir / "optimizer.yaml").write_text(
        yaml.safe_dump(
            {
                "profiles": ["llama-a100.json", "llama-l20.json"],
                "deployments": [
                    {"name": "llama-a100", "model": MODEL, "min_replicas": 1},
                    {"name": "llama-l20", "model": MODEL},
                ],
            }
        )
    )
    port = free_port()
    proc = Proc(
        "optimizer",
        [
            str(VENV_BIN / "extproc"),
            "optimizer",
            "--config",
            str(log_dir / "optimizer.yaml"),
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--interval",
            "0.2",
            "--headroom",
            "0",  # plans on the mean load: the counts below by hand
        ],
        log_dir,
    )
    proc.wait_ready(lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200)
    yield port
    assert proc.stop() == 0, proc.log()  # a clean shutdown on SIGTERM


def replicas(port: int, deployment: str) -> int:
    status, body = http_get(f"http://127.0.0.1:{port}/metrics/default/{deployment}")
    assert status == 200, body
    m = METRIC.search(body.decode())
    assert m is not None, body
    return int(m.group(1))


def put(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="PUT", headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def write_traffic(redis_url: str, short_per_s: int, long_per_s: int) -> str:
    """What the gateway does: arrived/completed into the recorder, then its flusher writes the closed
    window to Redis. The window is the last one closed before now, so the optimizer reads it at once."""
    now = time.time()
    at = math.floor(now / 10) * 10 - 5  # inside the window that ended at the last multiple of 10
    recorder = TraceRecorder()
    for tokens, n in ((SHORT, short_per_s * 10), (LONG, long_per_s * 10)):
        for _ in range(n):
            recorder.arrived(MODEL, at)
            recorder.completed(MODEL, *tokens, at)
    recorder.snapshot(MODEL, pending=3, queueing=0)

    async def flush() -> int:
        client = aioredis.from_url(redis_url)
        try:
            return await TraceFlusher(client, recorder).flush(now)
        finally:
            await client.aclose()

    assert asyncio.run(flush()) == 1
    return f"aibrix:{MODEL}_request_trace_{math.floor(now / 10) * 10}"


def clear_traces(redis_url: str) -> None:
    async def run() -> None:
        client = aioredis.from_url(redis_url)
        try:
            keys = [k async for k in client.scan_iter(match=f"aibrix:{MODEL}_request_trace_*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()

    asyncio.run(run())


def test_no_load_reports_min_replicas(optimizer: int, redis_url: str) -> None:
    clear_traces(redis_url)
    wait_until(lambda: replicas(optimizer, "llama-a100") == 100, 10, "a100 at its min_replicas (1 -> 100)")
    assert replicas(optimizer, "llama-l20") == 0
    status, body = http_get(f"http://127.0.0.1:{optimizer}/metrics")  # its own, beside the autoscalers'
    assert status == 200
    assert 'extproc_optimizer_replicas{deployment="llama-a100",model="llama",namespace="default"} 1.0' \
        in body.decode()


def test_traces_in_redis_change_the_plan(optimizer: int, redis_url: str) -> None:
    clear_traces(redis_url)
    key = write_traffic(redis_url, short_per_s=20, long_per_s=10)

    async def ttl() -> int:
        client = aioredis.from_url(redis_url)
        try:
            return await client.ttl(key)
        finally:
            await client.aclose()

    assert 590 <= asyncio.run(ttl()) <= 600
    # 20 short/s on a100 (10/s each) + 10 long/s on l20 (5/s each): 2 + 2, in hundredths
    wait_until(
        lambda: (replicas(optimizer, "llama-a100"), replicas(optimizer, "llama-l20")) == (200, 200),
        10,
        "the plan for the traced workload",
    )
    clear_traces(redis_url)
    write_traffic(redis_url, short_per_s=0, long_per_s=15)  # long only: l20 x3, a100 to 0 (load ignores min)
    wait_until(
        lambda: (replicas(optimizer, "llama-a100"), replicas(optimizer, "llama-l20")) == (0, 300),
        10,
        "the plan after the workload changed",
    )


def test_override_and_clear(optimizer: int, redis_url: str) -> None:
    clear_traces(redis_url)
    url = f"http://127.0.0.1:{optimizer}/scale/default/llama-l20"
    assert put(url, {"replicas": 4}) == (
        200,
        {"message": "Scaled to 4", "deployment": "default/llama-l20", "model": MODEL},
    )
    assert replicas(optimizer, "llama-l20") == 400
    status, body = put(url, {"replicas": "lots"})
    assert status == 400 and body["error"]["param"] == "replicas"
    assert put(url, {"replicas": -1})[0] == 200
    wait_until(lambda: replicas(optimizer, "llama-l20") == 0, 10, "override cleared")
    status, body = put(f"http://127.0.0.1:{optimizer}/scale/default/missing", {"replicas": 1})
    assert status == 404 and body["error"]["code"] == "deployment_not_monitored"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(log_dir: Path, url: str, *extra: str) -> str:
    """Headless Chromium, loopback only: no background networking, a throwaway profile."""
    assert CHROMIUM is not None
    out = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            f"--user-data-dir={log_dir / 'chromium'}",
            "--window-size=1280,900",
            "--virtual-time-budget=5000",
            *extra,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (make chromium)")
def test_dashboard_renders_the_plan_in_chromium(optimizer: int, redis_url: str, log_dir: Path) -> None:
    clear_traces(redis_url)
    write_traffic(redis_url, short_per_s=20, long_per_s=10)
    wait_until(lambda: replicas(optimizer, "llama-l20") == 200, 10, "the plan")
    url = f"http://127.0.0.1:{optimizer}/dash/{MODEL}?refresh=500"
    dom = chromium(log_dir, url, "--dump-dom")
    rows = dict(re.findall(r'<tr data-deployment="([^"]+)">.*?<td class="replicas">(\d+)', dom))
    assert rows == {"default/llama-a100": "2", "default/llama-l20": "2"}, dom[-3000:]
    assert re.search(r'id="plan-cost">4\.00<', dom) and re.search(r'id="cost">4\.00<', dom)
    assert int(re.search(r'data-refreshes="(\d+)"', dom).group(1)) >= 1  # it refreshed itself from /data
    assert dom.count('class="cell"') == 2  # the heatmap: the short and the long cell
    assert 'class="series"' in dom  # replicas over time
    chromium(log_dir, url, f"--screenshot={log_dir / 'dashboard.png'}", "--hide-scrollbars")
    assert (log_dir / "dashboard.png").stat().st_size > 10_000


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (make chromium)")
def test_dashboard_says_what_the_plan_made_of_a_burst(log_dir: Path) -> None:
    from extproc.optimizer.dashboard import render_page

    base = {"model": MODEL, "now": 0, "updated": 0, "has_load": True, "error": None, "rps": 24.0,
            "heatmap": [], "plan": None, "reported_cost": 0.0, "deployments": [], "history": []}
    for planned, says in ((False, "left to the router"), (True, "planned for")):
        page = log_dir / f"burst-{planned}.html"
        page.write_text(render_page({**base, "burst": {"rps": 24.0, "level": 20.0, "planned": planned}}))
        dom = chromium(log_dir, page.as_uri(), "--dump-dom")
        line = re.search(r'<div class="sub" id="burst" data-planned="(\w+)">([^<]*)<', dom)
        assert line is not None, dom[-3000:]
        assert line.group(1) == str(planned).lower() and says in line.group(2), line.group(0)
        assert "24.00 req/s" in line.group(2) and "20.00 on average" in line.group(2)
    page.write_text(render_page({**base, "burst": None}))  # no burst: no line
    assert re.search(r'<div class="sub" id="burst" data-planned="">\s*</div>',
                     chromium(log_dir, page.as_uri(), "--dump-dom"))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (make chromium)")
def test_dashboard_says_when_an_add_is_held(log_dir: Path) -> None:
    from extproc.optimizer.dashboard import render_page

    base = {"model": MODEL, "now": 0, "updated": 0, "has_load": True, "error": None, "rps": 7.0,
            "burst": None, "heatmap": [], "plan": None, "reported_cost": 0.0, "deployments": [],
            "history": []}
    page = log_dir / "held.html"
    page.write_text(render_page({**base, "held": {"l20": 1, "a10": 4}}))
    line = re.search(r'<div class="sub" id="held">([^<]*)<', chromium(log_dir, page.as_uri(), "--dump-dom"))
    assert line is not None and "held: the plan asks for a10 4, l20 1" in line.group(1), line
    page.write_text(render_page({**base, "held": None}))  # nothing held: no line
    assert re.search(r'<div class="sub" id="held">\s*</div>', chromium(log_dir, page.as_uri(), "--dump-dom"))
