"""A real OpenAI request through real Envoy and the ext_proc gateway to a pod."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from extproc.localstack import wait_until
from tests.integration.conftest import MODEL
from tests.support.http2 import h2_request
from tests.support.stack import Stack, upstream_stats

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say this is a test!"}]}


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0)


async def post(stack: Stack, body: bytes | dict, headers: dict[str, str] | None = None,
               path: str = "/v1/chat/completions") -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.url + path, data=data,
                                headers={"content-type": "application/json", **(headers or {})}) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def test_non_streaming_reaches_the_pod_with_routing_headers(stack: Stack, upstreams):
    before = upstream_stats(upstreams["a"])["requests"]
    raw = await client(stack).chat.completions.with_raw_response.create(max_tokens=4, **CHAT)
    completion = raw.parse()
    assert completion.choices[0].message.content == "a " * 4
    assert raw.headers["target-pod"] == "a100-0"
    assert raw.headers["routing-strategy"] == "least-request"
    assert raw.headers["request-id"]
    assert raw.headers["x-upstream"] == "a"
    assert upstream_stats(upstreams["a"])["requests"] == before + 1


async def test_streaming_reaches_the_pod(stack: Stack):
    stream = await client(stack).chat.completions.create(stream=True, max_tokens=5, **CHAT)
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert pieces == ["a "] * 5


async def test_completions_endpoint_and_explicit_strategy(stack: Stack):
    raw = await client(stack).completions.with_raw_response.create(
        model=MODEL, prompt="hello", max_tokens=2, extra_headers={"routing-strategy": "random"})
    assert raw.headers["routing-strategy"] == "random"
    assert raw.headers["target-pod"] == "a100-0"


async def test_models_are_listed_by_the_gateway(stack: Stack):
    models = await client(stack).models.list()
    assert {m.id for m in models.data} == {MODEL, "no-pods-model"}


@pytest.mark.parametrize("body,headers,status,code", [
    (b"{not json", {}, 400, "invalid_json"),
    ({"messages": [{"role": "user", "content": "x"}]}, {}, 400, "missing_model"),
    ({**CHAT, "model": "gpt-nope"}, {}, 404, "model_not_found"),
    (CHAT, {"routing-strategy": "fastest-please"}, 400, "unknown_routing_strategy"),
    ({**CHAT, "model": "no-pods-model"}, {}, 503, "no_ready_pod"),
    ({**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}, {}, 413, "request_too_large"),
])
async def test_errors_come_back_through_envoy_as_openai_json(stack: Stack, body, headers, status, code):
    got_status, got_headers, raw = await post(stack, body, headers)
    assert got_status == status
    assert got_headers["content-type"] == "application/json"
    error = json.loads(raw)["error"]
    assert error["code"] == code
    assert set(error) == {"message", "type", "param", "code"}
    if code == "unknown_routing_strategy":
        assert "least-request" in error["message"] and "random" in error["message"]


async def test_openai_client_sees_typed_errors(stack: Stack):
    with pytest.raises(openai.NotFoundError) as err:
        await client(stack).chat.completions.create(**{**CHAT, "model": "gpt-nope"})
    assert err.value.body["code"] == "model_not_found"


async def test_client_sent_destination_header_is_ignored(stack: Stack, upstreams):
    other = f"127.0.0.1:{upstreams['b']}"
    before_b = upstream_stats(upstreams["b"])["requests"]
    status, headers, _ = await post(stack, CHAT, {"x-gateway-destination-endpoint": other,
                                                  "target-pod": other})
    assert status == 200
    assert headers["x-upstream"] == "a"
    assert upstream_stats(upstreams["b"])["requests"] == before_b
    seen = upstream_stats(upstreams["a"])["headers"][-1]
    seen = {k.lower(): v for k, v in seen.items()}
    assert seen["x-gateway-destination-endpoint"] == f"127.0.0.1:{upstreams['a']}"


def settled(stack: Stack) -> None:
    """Earlier tests' requests are released by Envoy's access log, batched: wait for them to land."""
    wait_until(lambda: stack.running(MODEL, "a100-0") == 0, what="earlier requests released")


async def test_in_flight_count_returns_to_zero_after_client_aborts(stack: Stack):
    settled(stack)
    aborted_before = stack.sample("extproc_requests_total", code="aborted")
    async with aiohttp.ClientSession() as session:
        async def start_stream() -> aiohttp.ClientResponse:
            resp = await session.post(stack.url + "/v1/chat/completions",
                                      json={**CHAT, "stream": True, "max_tokens": 10_000},
                                      headers={"x-token-delay": "0.05"})
            await resp.content.readline()  # the first token arrived: the request is in flight
            return resp

        streams = await asyncio.gather(*(start_stream() for _ in range(5)))
        assert stack.running(MODEL, "a100-0") == 5
        for resp in streams:
            resp.close()  # drop the connection mid-stream
    wait_until(lambda: stack.running(MODEL, "a100-0") == 0, what="in-flight back to 0")
    assert stack.sample("extproc_requests_total", code="aborted") == aborted_before + 5


async def test_in_flight_count_returns_to_zero_after_upstream_resets(stack: Stack):
    ended_before = stack.sample("extproc_requests_total", pod="a100-0")
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.url + "/v1/chat/completions",
                                json={**CHAT, "stream": True, "max_tokens": 50},
                                headers={"x-reset-after": "3"}) as resp:
            # Envoy answers 502 if the reset beats the response headers downstream; else the body breaks.
            if resp.status == 502:
                assert (await resp.json())["error"]["type"] == "upstream_error"
            else:
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
    wait_until(lambda: stack.running(MODEL, "a100-0") == 0, what="in-flight back to 0")
    assert stack.sample("extproc_requests_total", pod="a100-0") == ended_before + 1


async def test_in_flight_is_counted_while_streaming(stack: Stack):
    settled(stack)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(stack.url + "/v1/chat/completions",
                                  json={**CHAT, "stream": True, "max_tokens": 10_000},
                                  headers={"x-token-delay": "0.05"})
        await resp.content.readline()
        assert stack.running(MODEL, "a100-0") == 1
        resp.close()
    wait_until(lambda: stack.running(MODEL, "a100-0") == 0, what="in-flight back to 0")


def test_http2_request_with_trailers_is_routed_by_the_gateway(stack: Stack, upstreams):
    other = f"127.0.0.1:{upstreams['b']}"
    before_b = upstream_stats(upstreams["b"])["requests"]
    body = json.dumps(CHAT).encode()
    headers, data = h2_request(stack.envoy_port, [
        (":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
        (":authority", "gateway"), ("content-type", "application/json"),
        ("x-gateway-destination-endpoint", other)], body, [("x-checksum", "abc")])
    assert headers[":status"] == "200", data
    assert headers["target-pod"] == "a100-0" and headers["x-upstream"] == "a"
    assert upstream_stats(upstreams["b"])["requests"] == before_b
