"""No one let in: a client never chooses the upstream or reaches an engine's other endpoints, API keys
are checked and rotate without a restart, and no key or internal address leaks into logs or replies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from extproc.localstack import free_port, wait_until
from tests.support.stack import Stack, running_stack, running_upstreams, upstream_stats

MODEL = "llama2-7b"
CHAT = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
KEY, ROTATED, WRONG = "sk-reliability-one-7f3a", "sk-reliability-two-91bc", "sk-not-a-key-0000"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("security")


@pytest.fixture(scope="module")
def upstreams(log_dir: Path) -> Iterator[dict[str, int]]:
    """`a` is the model's pod; `b` a local port no request may ever reach."""
    with running_upstreams(log_dir) as ports:
        yield ports


@pytest.fixture(scope="module")
def keys_file(log_dir: Path) -> Path:
    path = log_dir / "api-keys"
    path.write_text(f"# client keys\n{KEY}\n")
    return path


@pytest.fixture(scope="module")
def stack(log_dir: Path, upstreams: dict[str, int], keys_file: Path) -> Iterator[Stack]:
    with running_stack(log_dir, {"models": {
            MODEL: {"pods": [{"name": "a", "address": f"127.0.0.1:{upstreams['a']}"}]},
            "dead-model": {"pods": [{"name": "gone", "address": f"127.0.0.1:{free_port()}"}]}},
            "routing": {"default_strategy": "least-request"},
            "gateway": {"api_keys_file": str(keys_file)}}) as s:
        yield s


async def post(stack: Stack, headers: dict[str, str], path: str = "/v1/chat/completions",
               body: dict | None = None, key: str | None = KEY) -> tuple[int, dict[str, str], bytes]:
    auth = {"authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.post(stack.url + path, data=json.dumps(body or CHAT),
                                headers={"content-type": "application/json", **auth, **headers}) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


@pytest.mark.parametrize("header", ["x-gateway-destination-endpoint", "target-pod", "host",
                                    "x-envoy-original-dst-host", "x-forwarded-host",
                                    "x-envoy-upstream-alt-stat-name"])
async def test_a_client_cannot_choose_the_upstream(stack: Stack, upstreams: dict[str, int], header: str):
    elsewhere = f"127.0.0.1:{upstreams['b']}"
    before = upstream_stats(upstreams["b"])["requests"]
    status, headers, _ = await post(stack, {header: elsewhere})
    assert status == 200 and headers["x-upstream"] == "a"
    # Envoy's own admin port is just as unreachable
    status, headers, _ = await post(stack, {header: f"127.0.0.1:{stack.envoy_admin_port}"})
    assert status == 200 and headers["x-upstream"] == "a"
    assert upstream_stats(upstreams["b"])["requests"] == before


@pytest.mark.parametrize("path", ["/sim/faults", "/metrics", "/health", "/v1/../sim/faults",
                                  "/v1/chat/completions/../../sim/faults", "/%2e%2e/sim/faults", "//stats",
                                  "/v1/chat/completions/..%2f..%2fstats"])
async def test_an_engines_other_endpoints_stay_out_of_reach(stack: Stack, upstreams: dict[str, int],
                                                            path: str):
    before = upstream_stats(upstreams["a"])["requests"]
    status, headers, body = await post(stack, {}, path=path)
    assert status in (400, 404), (path, status, body)
    assert "x-upstream" not in headers
    if status == 404:  # answered by the gateway, in the OpenAI shape
        assert json.loads(body)["error"]["code"] == "unknown_route"
    assert upstream_stats(upstreams["a"])["requests"] == before


async def test_api_keys_are_checked_in_the_openai_shape(stack: Stack):
    for key in (None, WRONG):
        status, headers, body = await post(stack, {}, key=key)
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert WRONG.encode() not in body
    status, _, _ = await post(stack, {"authorization": f"Basic {KEY}"}, key=None)
    assert status == 401
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.url + "/v1/models") as r:
            assert r.status == 401
        async with session.get(stack.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200 and MODEL in await r.text()
    assert (await post(stack, {}))[0] == 200


async def test_keys_rotate_without_a_restart(stack: Stack, keys_file: Path):
    keys_file.write_text(f"{ROTATED}\n")
    try:
        wait_until(lambda: _status_sync(stack, ROTATED) == 200, 10, "the rotated key accepted")
        assert (await post(stack, {}, key=KEY))[0] == 401
    finally:
        keys_file.write_text(f"{KEY}\n")
        wait_until(lambda: _status_sync(stack, KEY) == 200, 10, "the first key back")


def _status_sync(stack: Stack, key: str) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        stack.url + "/v1/chat/completions", data=json.dumps(CHAT).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def test_errors_name_no_internal_address_and_logs_hold_no_key(stack: Stack, log_dir: Path):
    status, _, body = await post(stack, {}, body={**CHAT, "model": "dead-model"})
    assert status == 503
    error = json.loads(body)["error"]
    assert "127.0.0.1" not in body.decode() and error["type"]
    await post(stack, {}, key=WRONG)

    def logs() -> str:
        return "".join(p.read_text(errors="replace") for p in log_dir.glob("*.log"))

    wait_until(lambda: '" 401 ' in logs(), 20, "the rejection in Envoy's access log")
    for secret in (KEY, ROTATED, WRONG):  # logged, without the keys
        assert secret not in logs()


def test_every_port_binds_to_loopback_by_default():
    from extproc.cli import build_parser
    from extproc.envoy_bootstrap import BootstrapOptions, bootstrap

    serve = build_parser().parse_args(["serve", "--config", "x.yaml"])
    assert (serve.host, serve.admin_host) == ("127.0.0.1", "127.0.0.1")
    config = bootstrap(BootstrapOptions())
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]["address"]
    admin = config["admin"]["address"]["socket_address"]["address"]
    assert (listener, admin) == ("127.0.0.1", "127.0.0.1")
    assert build_parser().parse_args(["envoy-config"]).listen_address == "127.0.0.1"
