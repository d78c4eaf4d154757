"""Config reload, graceful drain on SIGTERM, the gRPC health service, and the Envoy bootstrap."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.envoy_bootstrap import BootstrapOptions, render
from extproc.localstack import VENV_BIN, bootstrap_without_ext_proc, free_port, start_envoy, wait_until
from tests.support.stack import Stack, http_get, upstream_stats

REPO = Path(__file__).resolve().parents[2]


def pods_config(*pods: tuple[str, int], model: str = "m") -> dict:
    return {"models": {model: {"pods": [{"name": n, "address": f"127.0.0.1:{p}"} for n, p in pods]}}}


@pytest.fixture
def fresh_stack(tmp_path: Path, upstreams: dict[str, int]) -> Iterator[Stack]:
    s = Stack(config_path=tmp_path / "gateway.yaml", log_dir=tmp_path,
              env={"EXTPROC_DRAIN_TIMEOUT_SECONDS": "20", "EXTPROC_DRAIN_NOTICE_SECONDS": "1"})
    s.write_config(pods_config(("a", upstreams["a"])))
    s.start_gateway()
    s.start_envoy()
    yield s
    s.stop()


def health_status(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2).status


async def test_config_change_is_reloaded_and_invalid_one_rejected(fresh_stack: Stack, upstreams):
    client = openai.AsyncOpenAI(base_url=fresh_stack.url + "/v1", api_key="x", max_retries=0)

    async def model_ids() -> set[str]:
        return {m.id for m in (await client.models.list()).data}

    reloaded = asyncio.Event()

    async def load() -> list[int]:  # requests for `m` keep flowing until the reload has been seen
        codes = []
        async with aiohttp.ClientSession() as session:
            while not reloaded.is_set():
                async with session.post(fresh_stack.url + "/v1/chat/completions", json={
                        "model": "m", "messages": [{"role": "user", "content": "x"}]}) as resp:
                    codes.append(resp.status)
        return codes

    traffic = asyncio.gather(*(load() for _ in range(4)))
    fresh_stack.write_config({"models": {**pods_config(("a", upstreams["a"]))["models"],
                                         **pods_config(("b", upstreams["b"]), model="m2")["models"]}})
    deadline = asyncio.get_running_loop().time() + 10
    while await model_ids() != {"m", "m2"}:
        assert asyncio.get_running_loop().time() < deadline, "reload not seen"
        await asyncio.sleep(0.05)
    reloaded.set()
    assert {code for codes in await traffic for code in codes} == {200}
    before = upstream_stats(upstreams["b"])["requests"]
    await client.chat.completions.create(model="m2", messages=[{"role": "user", "content": "x"}])
    assert upstream_stats(upstreams["b"])["requests"] == before + 1

    fresh_stack.config_path.write_text("models: [this is: not, valid")
    wait_until(lambda: "rejected, keeping the previous one" in fresh_stack.gateway.log(),
               what="invalid config rejected")
    assert await model_ids() == {"m", "m2"}  # the old config still serves


async def test_sigterm_exits_at_once_and_running_streams_outlive_the_gateway(fresh_stack: Stack):
    assert health_status(fresh_stack.extproc_port, "") == health_pb2.HealthCheckResponse.SERVING
    assert health_status(fresh_stack.extproc_port, "envoy.service.ext_proc.v3.ExternalProcessor") \
        == health_pb2.HealthCheckResponse.SERVING
    async with aiohttp.ClientSession() as session:
        # 3 s of tokens: the stream is still running when the gateway has gone.
        resp = await session.post(fresh_stack.url + "/v1/chat/completions", json={
            "model": "m", "stream": True, "max_tokens": 100,
            "messages": [{"role": "user", "content": "x"}]}, headers={"x-token-delay": "0.03"})
        await resp.content.readline()
        fresh_stack.gateway.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: http_get(fresh_stack.admin_url + "/healthz")[0] == 503, what="draining")
        wait_until(lambda: health_status(fresh_stack.extproc_port, "")
                   == health_pb2.HealthCheckResponse.NOT_SERVING, what="gRPC health NOT_SERVING")
        # No routing stream is open (the response does not pass through the gateway): it exits now.
        assert await asyncio.to_thread(fresh_stack.gateway.popen.wait, 10) == 0
        # While no gateway answers, new requests fail fast with a retryable 503.
        started = asyncio.get_running_loop().time()
        async with session.post(fresh_stack.url + "/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "x"}]}) as refused:
            assert refused.status == 503
            assert refused.headers["retry-after"] == "1"
            assert (await refused.json())["error"]["code"] == "gateway_unavailable"
        assert asyncio.get_running_loop().time() - started < 5
        rest = await resp.content.read()  # the generation already streaming completes
    assert rest.count(b"data: {") == 99 and rest.endswith(b"data: [DONE]\n\n")


async def test_a_restarted_gateway_credits_streams_routed_by_its_predecessor(fresh_stack: Stack):
    async with aiohttp.ClientSession() as session:
        resp = await session.post(fresh_stack.url + "/v1/chat/completions", json={
            "model": "m", "stream": True, "max_tokens": 60,
            "messages": [{"role": "user", "content": "x"}]}, headers={"x-token-delay": "0.05"})
        await resp.content.readline()
        # The gateway closes its side once it has routed; a crash before Envoy has that close would
        # (rightly) fail the request, so the crash comes after it.
        wait_until(lambda: fresh_stack.envoy_stat("ext_proc.streams_closed") >= 1, 10, "routing stream closed")
        fresh_stack.gateway.popen.send_signal(signal.SIGKILL)  # a crash, not a drain
        fresh_stack.gateway.popen.wait(10)
        fresh_stack.start_gateway()
        body = await resp.content.read()
    assert body.endswith(b"data: [DONE]\n\n")
    wait_until(lambda: fresh_stack.sample("extproc_unmatched_access_logs_total") == 1, 10,
               "the new gateway received the stream's record")
    assert fresh_stack.sample("extproc_output_tokens_total", pod="a") == 60
    assert fresh_stack.running("m", "a") == 0


def test_envoy_config_is_valid_and_checked_in():
    out = subprocess.run([str(VENV_BIN / "extproc"), "envoy-config"], capture_output=True, text=True,
                         check=True).stdout
    assert out == (REPO / "envoy" / "envoy.yaml").read_text(), "run `make envoy-config`"
    check = subprocess.run([str(VENV_BIN / "envoy"), "--mode", "validate", "-c",
                            str(REPO / "envoy" / "envoy.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_custom_destination_header_validates(tmp_path: Path):
    path = tmp_path / "envoy.yaml"
    path.write_text(render(BootstrapOptions(destination_header="target-pod", admin_port=free_port())))
    check = subprocess.run([str(VENV_BIN / "envoy"), "--mode", "validate", "-c", str(path)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    config = yaml.safe_load(path.read_text())
    pods = next(c for c in config["static_resources"]["clusters"] if c["name"] == "model_pods")
    assert pods["original_dst_lb_config"]["metadata_key"]["path"] == [{"key": "target-pod"}]
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    to_pods = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    assert to_pods["request_headers_to_add"][0]["header"]["key"] == "target-pod"


async def test_unreachable_pod_gives_503_and_balances_counts(tmp_path: Path):
    dead_port = free_port()  # nothing listens here
    s = Stack(config_path=tmp_path / "gateway.yaml", log_dir=tmp_path)
    s.write_config(pods_config(("dead", dead_port)))
    s.start_gateway()
    s.start_envoy()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(s.url + "/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "x"}]}) as resp:
                assert resp.status == 503
                assert resp.headers["target-pod"] == "dead"
                assert (await resp.json())["error"]["type"] == "upstream_error"
        wait_until(lambda: 'code="503",model="m",pod="dead"' in s.metrics(), what="503 counted")
        assert s.running("m", "dead") == 0
        wait_until(lambda: s.sample("extproc_pod_healthy", pod="dead") == 0, what="dead pod marked down")
    finally:
        s.stop()


def test_gateway_refuses_a_taken_port(tmp_path: Path):
    s = Stack(config_path=tmp_path / "gateway.yaml", log_dir=tmp_path)
    s.write_config(pods_config(("a", 1)))
    s.start_gateway()
    try:
        clash = subprocess.run([str(VENV_BIN / "extproc"), "serve", "--config", str(s.config_path),
                                "--port", str(s.extproc_port), "--admin-port", str(free_port())],
                               capture_output=True, text=True, timeout=30)
        assert clash.returncode != 0
    finally:
        s.stop()


@pytest.mark.parametrize("megabytes,status,limit", [(5, 200, None), (12, 413, 8 << 20), (20, 413, 16 << 20)])
async def test_long_prompts_route_and_oversize_bodies_get_openai_413(fresh_stack: Stack, megabytes, status,
                                                                     limit):
    prompt = "a" * (megabytes << 20)  # 12 MiB: over the gateway's limit; 20 MiB: over Envoy's buffer
    async with aiohttp.ClientSession() as session:
        async with session.post(fresh_stack.url + "/v1/chat/completions", json={
                "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": prompt}]}) as resp:
            assert resp.status == status
            if status == 413:
                error = (await resp.json())["error"]
                assert error["code"] == "request_too_large"
                assert str(limit) in error["message"]  # who answered: the gateway, or Envoy's mapper
            else:
                assert resp.headers["target-pod"] == "a"


async def test_envoy_own_failures_are_openai_json(tmp_path: Path):
    """Gateway unreachable: fail closed with a retryable JSON 503. No destination header: the route
    guard's 503."""
    listen, probe = free_port(), free_port()
    closed = start_envoy("envoy-closed", render(BootstrapOptions(
        listen_port=listen, listen_address="127.0.0.1", extproc_port=free_port(), admin_port=free_port())),
        tmp_path)
    guard = start_envoy("envoy-guard", bootstrap_without_ext_proc(BootstrapOptions(
        listen_port=probe, listen_address="127.0.0.1", admin_port=free_port())), tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            for port, status, type_ in ((listen, 503, "service_unavailable"), (probe, 503, "gateway_error")):
                async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                        "model": "m", "messages": [{"role": "user", "content": "x"}]}) as resp:
                    assert resp.status == status
                    assert resp.headers["content-type"] == "application/json"
                    assert (await resp.json())["error"]["type"] == type_
    finally:
        closed.stop()
        guard.stop()
