"""ReplicaServer in this process over real sockets: how streams end when the engine cannot finish them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from extproc.sim.replica import ReplicaSpec
from extproc.sim.server import ReplicaServer

pytestmark = pytest.mark.integration
MODEL = "llama2-7b"
DEADLINE_S = 10.0


@pytest.fixture
async def server() -> AsyncIterator[ReplicaServer]:
    # A V100 in real time: a 2000-token request stays running for tens of seconds.
    s = ReplicaServer(ReplicaSpec(gpu="V100", model=MODEL, port=0, time_scale=1.0))
    await s.start()
    yield s
    await asyncio.wait_for(s.stop(), DEADLINE_S)


async def until(predicate: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.005)


def url(s: ReplicaServer, path: str) -> str:
    return f"http://127.0.0.1:{s.port}{path}"


async def first_token(resp: aiohttp.ClientResponse) -> None:
    assert resp.status == 200
    line = await asyncio.wait_for(resp.content.readline(), DEADLINE_S)
    assert line.startswith(b"data: {")


async def rest_of_stream(resp: aiohttp.ClientResponse) -> list[bytes]:
    """The remaining SSE data lines, until the server ends the response (bounded by a deadline)."""

    async def read() -> list[bytes]:
        return [line.strip() async for line in resp.content if line.startswith(b"data: ")]

    return await asyncio.wait_for(read(), DEADLINE_S)


def stream_body(max_tokens: int = 2000) -> dict[str, object]:
    return {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True}


async def test_kv_pressure_raised_mid_stream_ends_requests_that_no_longer_fit(server: ReplicaServer) -> None:
    plain = {"model": MODEL, "prompt": "x", "max_tokens": 2000}
    async with aiohttp.ClientSession() as http:
        async with http.post(url(server, "/v1/completions"), json=stream_body()) as resp:
            await first_token(resp)
            waiting = asyncio.create_task(http.post(url(server, "/v1/completions"), json=plain))
            await until(lambda: len(server.streams) == 2, "second request in the engine")
            async with http.post(url(server, "/sim/faults"), json={"kv_pressure": 0.99}) as r:
                assert r.status == 200
            lines = await rest_of_stream(resp)
        assert lines[-1] == b"data: [DONE]"
        error = json.loads(lines[-2][len(b"data: "):])["error"]
        assert error["code"] == 503 and "KV cache" in error["message"]
        answer = await asyncio.wait_for(waiting, DEADLINE_S)
        assert answer.status == 503 and "error" in await answer.json()
        # A request that still fits is served as usual.
        async with http.post(url(server, "/v1/completions"), json={**plain, "max_tokens": 3}) as r:
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3
    assert not server.engine.has_work()


async def test_a_dead_engine_loop_fails_open_streams_and_health(server: ReplicaServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(url(server, "/v1/completions"), json=stream_body()) as resp:
            await first_token(resp)

            def boom(now: float) -> None:
                raise RuntimeError("simulated bug in the engine model")

            server.engine.step = boom  # type: ignore[method-assign]
            lines = await rest_of_stream(resp)
        assert lines[-1] == b"data: [DONE]"
        assert json.loads(lines[-2][len(b"data: "):])["error"]["code"] == 500
        async with http.get(url(server, "/health")) as r:
            assert r.status == 500
        async with http.post(url(server, "/v1/completions"), json={**stream_body(3), "stream": False}) as r:
            assert r.status == 500 and "error" in await r.json()


async def test_one_broken_transport_does_not_stop_the_engine_loop(server: ReplicaServer) -> None:
    class Broken:
        def is_closing(self) -> bool:
            return False

        def get_write_buffer_size(self) -> int:
            raise RuntimeError("simulated transport bug")

    async with aiohttp.ClientSession() as http:
        async with (
            http.post(url(server, "/v1/completions"), json=stream_body()) as bad,
            http.post(url(server, "/v1/completions"), json=stream_body(20)) as good,
        ):
            await first_token(bad)
            await first_token(good)
            victim = next(s for s in server.streams.values() if s.seq is None and s.sink is not None
                          and s.sink.last == 1999)
            assert victim.sink is not None
            victim.sink.transport = Broken()
            lines = await rest_of_stream(good)
            assert lines[-1] == b"data: [DONE]"
            with pytest.raises((aiohttp.ClientError, asyncio.IncompleteReadError)):
                await rest_of_stream(bad)  # dropped, not finished
    assert server._task is not None and not server._task.done()
    await until(lambda: not server.engine.has_work(), "the broken stream's request left the engine")


async def _raw_post(port: int, header_value: str) -> tuple[bytes, bytes]:
    """(status line and headers, body) of a chat request carrying one `x-big` header."""
    body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
                 f"x-big: {header_value}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}"
                 .encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), DEADLINE_S)
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


async def test_header_limits_the_simulator_takes_and_refuses_in_json(server: ReplicaServer) -> None:
    # Up to 16 KiB a line (aiohttp's default is 8 KiB): anything Envoy lets through (12 KiB in all).
    head, _ = await _raw_post(server.port, "a" * 12_000)
    assert head.startswith(b"HTTP/1.1 200"), head
    # Over it: a 400 in the OpenAI JSON shape that repeats nothing of the header, not aiohttp's text.
    head, body = await _raw_post(server.port, "secret" * 5_000)
    assert b" 400 " in head.split(b"\r\n")[0] and b"application/json" in head, head
    error = json.loads(body)["error"]
    assert error["code"] == 400 and "secret" not in body.decode(), body
