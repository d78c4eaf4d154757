"""Each fault flag of engine-sim, observed from a client over a real socket; and the fleet file."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml

from tests.integration.sim_fixtures import free_port, http_status, start_sim

pytestmark = pytest.mark.integration
MODEL = "llama2-7b"
BASE = ["--gpu", "A100", "--model", MODEL, "--time-scale", "100"]


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-sim-faults")


async def stream_tokens(url: str, max_tokens: int = 20) -> tuple[list[float], bool, BaseException | None]:
    """(arrival time of each token chunk, saw [DONE], error) for one raw SSE stream."""
    times: list[float] = []
    done = False
    body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True}
    try:
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    times.append(time.monotonic())
    except (aiohttp.ClientError, asyncio.IncompleteReadError) as e:
        return times, done, e
    return times, done, None


@pytest.mark.parametrize("status", [500, 503])
async def test_error_rate(log_dir: Path, status: int) -> None:
    s = start_sim([*BASE, "--error-rate", "1", "--error-status", str(status)], log_dir)
    try:
        c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            await c.completions.create(model=MODEL, prompt="x", max_tokens=3)
        assert err.value.status_code == status
        assert set(err.value.body) >= {"message", "type", "param", "code"}  # type: ignore[arg-type]
    finally:
        s.stop()


async def test_abort_after_tokens(log_dir: Path) -> None:
    s = start_sim([*BASE, "--abort-after-tokens", "3"], log_dir)
    try:
        times, done, error = await stream_tokens(s.url, 20)
        assert len(times) == 3 and not done and error is not None
        c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError):
            async for _ in await c.completions.create(model=MODEL, prompt="x", max_tokens=20, stream=True):
                pass
    finally:
        s.stop()


async def test_abort_probability(log_dir: Path) -> None:
    s = start_sim([*BASE, "--abort-prob", "1"], log_dir)
    try:
        times, done, error = await stream_tokens(s.url, 20)
        assert len(times) < 20 and not done and error is not None
    finally:
        s.stop()


async def test_stall_mid_stream(log_dir: Path) -> None:
    s = start_sim([*BASE, "--stall-after-tokens", "2", "--stall-seconds", "0.6"], log_dir)
    try:
        times, done, error = await stream_tokens(s.url, 6)
        assert error is None and done and len(times) == 6
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert gaps[1] >= 0.5  # the pause sits between token 2 and token 3 (wall-clock seconds)
    finally:
        s.stop()


async def test_slow_start_health_not_ready_then_ready(log_dir: Path) -> None:
    # Long enough that the first probe lands inside it even on a loaded machine.
    s = start_sim([*BASE, "--slow-start-seconds", "4.0"], log_dir, wait="listening")
    try:
        first = http_status(s.url + "/health")
        s.wait_until(lambda: http_status(s.url + "/health") == 200, "ready after slow start")
        assert first == 503
    finally:
        s.stop()


async def test_refuse_connections(log_dir: Path) -> None:
    s = start_sim([*BASE, "--refuse-connections", "refuse"], log_dir, wait="log")
    try:
        with pytest.raises(aiohttp.ClientConnectorError):
            async with aiohttp.ClientSession() as http:
                await http.get(s.url + "/health")
    finally:
        s.stop()


async def test_reset_connections(log_dir: Path) -> None:
    s = start_sim([*BASE, "--refuse-connections", "reset"], log_dir, wait="listening")
    try:
        c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            await c.completions.create(model=MODEL, prompt="x", max_tokens=3)
    finally:
        s.stop()


async def test_kv_pressure(log_dir: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    free = start_sim(BASE, log_dir)
    pressed = start_sim([*BASE, "--kv-pressure", "0.99"], log_dir)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(pressed.url + "/metrics") as resp:
                fams = {f.name: f for f in text_string_to_metric_families(await resp.text())}
            assert fams["vllm:kv_cache_usage_perc"].samples[0].value >= 0.99
            lens = []
            for s in (free, pressed):
                async with http.get(s.url + "/v1/models") as resp:
                    lens.append((await resp.json())["data"][0]["max_model_len"])
        assert lens[1] < lens[0]  # the capacity is really gone, not just reported
    finally:
        free.stop()
        pressed.stop()


async def test_fleet_serves_replicas_with_their_own_gpus_and_faults(log_dir: Path) -> None:
    ports = [free_port(), free_port(), free_port()]
    fleet = {
        "defaults": {"model": MODEL, "time_scale": 100},
        "replicas": [
            {"name": "a100-0", "gpu": "A100-80GB", "port": ports[0]},
            {
                "name": "v100-0",
                "gpu": "V100",
                "port": ports[1],
                "engine": "sglang",
                "engine_overrides": {"max_num_seqs": 64},
            },
            {
                "name": "a40-bad",
                "gpu": "A40",
                "port": ports[2],
                "faults": {"error_rate": 1.0, "error_status": 503},
            },
        ],
    }
    path = log_dir / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    s = start_sim(["--fleet", str(path)], log_dir, port=ports[0])
    try:
        s.wait_until(
            lambda: all(http_status(f"http://127.0.0.1:{p}/health") == 200 for p in ports), "fleet up"
        )
        async with aiohttp.ClientSession() as http:
            infos = []
            for p in ports:
                async with http.get(f"http://127.0.0.1:{p}/sim/info") as resp:
                    infos.append(await resp.json())
            assert [i["gpu"]["name"] for i in infos] == ["A100-80GB", "V100", "A40"]
            assert infos[1]["max_num_seqs"] == 64 and infos[1]["engine"] == "sglang"
            # A V100 decodes slower than an A100: the simulated per-token time says so.
            assert infos[1]["decode_step_s_batch1"] > 1.8 * infos[0]["decode_step_s_batch1"]
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
            async with http.post(f"http://127.0.0.1:{ports[0]}/v1/completions", json=body) as resp:
                assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 2
            async with http.post(f"http://127.0.0.1:{ports[2]}/v1/completions", json=body) as resp:
                assert resp.status == 503 and "error" in json.loads(await resp.text())
    finally:
        s.stop()


def test_bad_fleet_file_fails_fast(log_dir: Path) -> None:
    path = log_dir / "bad.yaml"
    path.write_text(yaml.safe_dump({"replicas": [{"name": "x", "gpu": "NoSuchGPU", "port": free_port()}]}))
    with pytest.raises(RuntimeError, match="NoSuchGPU"):
        start_sim(["--fleet", str(path)], log_dir)


async def test_faults_change_at_runtime(log_dir: Path) -> None:
    s = start_sim(BASE, log_dir)
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        async with aiohttp.ClientSession() as http:
            async with http.post(
                s.url + "/sim/faults", json={"error_rate": 1.0, "error_status": 503}
            ) as resp:
                assert resp.status == 200 and (await resp.json())["error_rate"] == 1.0
            async with http.post(s.url + "/v1/completions", json=body) as resp:
                assert resp.status == 503
            async with http.post(s.url + "/sim/faults", json={"slow_start_seconds": 30}) as resp:
                assert resp.status == 200
            async with http.get(s.url + "/health") as resp:
                assert resp.status == 503  # slow start counts from the change
            async with http.post(s.url + "/sim/faults", json={"bogus": 1}) as resp:
                assert resp.status == 400
            async with http.post(s.url + "/sim/faults", json={}) as resp:
                assert resp.status == 200
            async with http.post(s.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
            # Long enough that the first probe lands inside it even on a loaded machine.
            async with http.post(
                s.url + "/sim/faults", json={"refuse_connections": "refuse", "outage_seconds": 5.0}
            ):
                pass
        s.wait_until(lambda: http_status(s.url + "/health", 0.5) is None, "outage begins")
        s.wait_until(lambda: http_status(s.url + "/health", 0.5) == 200, "outage over")
    finally:
        s.stop()


async def test_client_disconnect_aborts_the_request_in_the_engine(log_dir: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    s = start_sim(["--gpu", "V100", "--model", MODEL, "--time-scale", "1"], log_dir)  # slow: stays running

    def running() -> float:
        import urllib.request

        with urllib.request.urlopen(s.url + "/metrics", timeout=2) as resp:
            fams = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
        return fams["vllm:num_requests_running"].samples[0].value

    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "stream": True}
        async with aiohttp.ClientSession() as http, http.post(s.url + "/v1/completions", json=body) as resp:
            await resp.content.readline()  # the first token arrived: the request is running
            assert running() == 1
        # leaving the block closed the connection mid-stream
        s.wait_until(lambda: running() == 0, "request aborted in the engine", deadline_s=10)
    finally:
        s.stop()


async def test_sigterm_with_an_open_stream_exits_promptly(log_dir: Path) -> None:
    s = start_sim(["--gpu", "V100", "--model", MODEL, "--time-scale", "1"], log_dir)  # slow: stays open
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "stream": True}
        async with aiohttp.ClientSession() as http, http.post(s.url + "/v1/completions", json=body) as resp:
            await resp.content.readline()  # the first token arrived: the stream is open
            s.proc.popen.send_signal(signal.SIGTERM)
            # A bound on the exit, not a sleep: aiohttp's default shutdown timeout alone would be 60 s.
            code = await asyncio.to_thread(s.proc.popen.wait, 10)
            assert code == 0
            with pytest.raises((aiohttp.ClientError, asyncio.IncompleteReadError)):
                async for _ in resp.content:  # the stream was dropped, not finished
                    pass
                raise AssertionError("stream ended cleanly")
    finally:
        s.stop()
