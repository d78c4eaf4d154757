"""`extproc serve --workers 2` behind real Envoy, on three simulated engines: the workers route a
burst as one process would (exact shared counts, no herding), every record releases its count
whichever worker Envoy's access log reaches, one /metrics is the sum, a dead worker comes back, and
SIGTERM stops them all."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from extproc.localstack import LocalStack, free_port, http_get, wait_until
from tests.integration.sim_fixtures import SimProcess, start_sim

MODEL = "llama2-7b"
PODS = ("p0", "p1", "p2")
LIMITED, LIMITED_RPM = "sk-limited", 6  # the one key with a limit: without Redis, shared by the workers


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="module")
def fleet(log_dir: Path) -> Iterator[dict[str, int]]:
    ports = {name: free_port() for name in PODS}
    path = log_dir / "fleet.yaml"
    path.write_text(yaml.safe_dump({"defaults": {"model": MODEL, "time_scale": 1},
                                    "replicas": [{"name": n, "gpu": "A100-80GB", "port": p}
                                                 for n, p in ports.items()]}))
    sim: SimProcess = start_sim(["--fleet", str(path)], log_dir, port=ports["p0"])
    yield ports
    sim.stop()


@pytest.fixture(scope="module")
def stack(log_dir: Path, fleet: dict[str, int]) -> Iterator[LocalStack]:
    s = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir, workers=2)
    s.write_config({"models": {MODEL: {"pods": [{"name": n, "address": f"127.0.0.1:{p}"}
                                                for n, p in fleet.items()]}},
                    "routing": {"default_strategy": "least-request"},
                    "rate_limits": {"overrides": [{
                        "api_key_sha256": hashlib.sha256(LIMITED.encode()).hexdigest(),
                        "requests_per_minute": LIMITED_RPM}]}})
    s.start_gateway()
    s.start_envoy()
    yield s
    s.stop()


def per_pod(stack: LocalStack, metric: str) -> dict[str, float]:
    return {pod: stack.sample(metric, model=MODEL, pod=pod) for pod in PODS}


def streams_per_worker(stack: LocalStack) -> list[int]:
    """Envoy's count of routing streams opened to each worker's port."""
    text = http_get(f"http://127.0.0.1:{stack.envoy_admin_port}/clusters")[1].decode()
    return [int(m.group(1)) for port in (stack.extproc_port, stack.extproc_port + 1)
            for m in [re.search(rf"^extproc::127\.0\.0\.1:{port}::rq_total::(\d+)$", text, re.M)] if m]


async def test_a_burst_split_over_two_workers_is_spread_as_one_process_would(stack: LocalStack):
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0)
    tokens: list[int] = []

    async def one() -> None:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=400, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                tokens.append(chunk.usage.completion_tokens)

    burst = [asyncio.create_task(one()) for _ in range(12)]
    # while all twelve stream: the workers' shared count is exact and least-request spread them 4/4/4
    # (two workers routing on their own counts would each put their six 2/2/2 only by luck)
    seen: list[dict[str, float]] = []

    def all_in_flight() -> bool:
        seen.append(per_pod(stack, "extproc_pod_running_requests"))
        return sum(seen[-1].values()) == 12

    await asyncio.to_thread(wait_until, all_in_flight, 20, "12 requests in flight")
    assert max(seen[-1].values()) - min(seen[-1].values()) <= 1, seen[-1]
    assert sum(per_pod(stack, "extproc_pod_local_running_requests").values()) == 12
    assert all(n > 0 for n in streams_per_worker(stack)), "Envoy used both workers"
    await asyncio.gather(*burst)

    await asyncio.to_thread(wait_until, lambda: sum(per_pod(stack, "extproc_pod_running_requests").values())
                            == 0, 10, "every count released")
    assert sum(per_pod(stack, "extproc_pod_local_running_requests").values()) == 0
    assert sum(per_pod(stack, "extproc_output_tokens_total").values()) == sum(tokens)
    assert stack.sample("extproc_requests_total", code="200") == 12
    # Envoy's one access-log stream reached one worker: the other's records were passed on, none lost
    sent = stack.sample("extproc_peer_access_logs_total", direction="sent")
    assert sent > 0 and stack.sample("extproc_peer_access_logs_total", direction="released") == sent
    assert stack.sample("extproc_released_requests_total") == 0


async def test_a_keys_limit_holds_across_the_workers_without_redis(stack: LocalStack):
    """Each worker keeping its own budgets would admit the key twice its limit; they share one."""
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=LIMITED, max_retries=0)
    streams_before = streams_per_worker(stack)

    async def one() -> int:
        try:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            return 200
        except openai.RateLimitError:
            return 429

    statuses = await asyncio.gather(*(one() for _ in range(4 * LIMITED_RPM)))
    # within one: the budget refills one request every 10 s while the burst runs
    assert LIMITED_RPM <= statuses.count(200) <= LIMITED_RPM + 1, statuses
    assert statuses.count(200) + statuses.count(429) == len(statuses)
    assert all(after > before for after, before in zip(streams_per_worker(stack), streams_before,
                                                       strict=True)), "Envoy used both workers"
    assert stack.sample("extproc_rate_limited_requests_total", key_class="override") == statuses.count(429)


def test_a_worker_that_dies_is_started_again(stack: LocalStack):
    pids = [int(p) for p in os.popen(f"pgrep -P {stack.gateway.popen.pid}").read().split()]  # type: ignore[union-attr]
    workers = [p for p in pids if "--worker" in open(f"/proc/{p}/cmdline").read()]
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    wait_until(lambda: http_get(stack.admin_url + "/healthz")[0] == 503, 5, "the supervisor notices")
    wait_until(lambda: http_get(stack.admin_url + "/healthz")[0] == 200, 30, "the worker is back")


def test_sigterm_stops_every_worker(log_dir: Path, fleet: dict[str, int]):
    d = log_dir / "stop"
    d.mkdir()
    s = LocalStack(config_path=d / "gateway.yaml", log_dir=d, workers=2)
    s.write_config({"models": {MODEL: {"pods": [{"name": "p0", "address": f"127.0.0.1:{fleet['p0']}"}]}},
                    "gateway": {"drain_notice_seconds": 0}})
    s.start_gateway()
    proc = s.gateway.popen  # type: ignore[union-attr]
    children = [int(p) for p in os.popen(f"pgrep -P {proc.pid}").read().split()]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in children), 10, "workers gone")


def test_a_killed_supervisor_takes_its_workers_along(log_dir: Path, fleet: dict[str, int]):
    d = log_dir / "kill"
    d.mkdir()
    s = LocalStack(config_path=d / "gateway.yaml", log_dir=d, workers=2)
    s.write_config({"models": {MODEL: {"pods": [{"name": "p0", "address": f"127.0.0.1:{fleet['p0']}"}]}}})
    s.start_gateway()
    proc = s.gateway.popen  # type: ignore[union-attr]
    children = [int(p) for p in os.popen(f"pgrep -P {proc.pid}").read().split()]
    assert len(children) == 2
    proc.kill()  # SIGKILL: no handler runs, the kernel ends the workers (PR_SET_PDEATHSIG)
    proc.wait(timeout=10)
    wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in children), 10, "workers gone")
    s.stop()
