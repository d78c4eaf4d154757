"""Every request body mode a gateway may configure, through real Envoy (`extproc envoy-config` with only the
body mode changed): bodies that arrive in pieces, apart in time, are routed whole and reach the pod as
sent; past max_body_bytes the same 413; every count balances.

Before the gateway knew the streamed modes: FULL_DUPLEX_STREAMED answered every request 503 ("spurious
message"), STREAMED took each 2 KB piece for the whole body (400, truncated), BUFFERED_PARTIAL tripped
Envoy's route-cache check (503)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.localstack import LocalStack, wait_until
from tests.support.pieces import post_in_pieces
from tests.support.stack import running_upstreams, upstream_stats

MODEL = "m"
PATH = "/v1/chat/completions"
MODES = ("FULL_DUPLEX_STREAMED", "STREAMED", "BUFFERED_PARTIAL", "BUFFERED")


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    with running_upstreams(tmp_path_factory.mktemp("body-modes"), names=("a",)) as ports:
        yield ports


@pytest.fixture(scope="module", params=MODES)
def stack(request, upstreams: dict[str, int],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    log_dir: Path = tmp_path_factory.mktemp(request.param.lower())
    s = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
    s.write_config({"models": {MODEL: {"pods": [{"name": "a", "address": f"127.0.0.1:{upstreams['a']}"}]}},
                    "gateway": {"max_body_bytes": 64 * 1024}})
    s.start_gateway()
    s.start_envoy(request_body_mode=request.param)
    s.mode = request.param  # type: ignore[attr-defined]
    yield s
    s.stop()


def chat(words: int, stream: bool = False) -> bytes:
    return json.dumps({"model": MODEL, "stream": stream, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "word " * words}]}).encode()


def arrived(port: int) -> tuple[int, bytes]:
    stats = upstream_stats(port)
    return stats["requests"], stats["bodies"][0].encode() if stats["bodies"] else b""


def balanced(s: LocalStack) -> None:
    wait_until(lambda: s.sample("extproc_pod_local_running_requests", model=MODEL, pod="a") == 0,
               what="every count released")


@pytest.mark.parametrize("content_length", [True, False], ids=["content-length", "chunked"])
def test_a_body_in_pieces_reaches_the_pod_whole_and_unchanged(stack, upstreams, content_length):
    body = chat(3000)  # ~15 KB: eight pieces, 5 ms apart
    before, _ = arrived(upstreams["a"])
    reply = post_in_pieces(stack.envoy_port, PATH, body, content_length=content_length)
    assert reply.status == 200, reply.body
    assert json.loads(reply.body)["choices"][0]["message"]["content"].startswith("a ")
    count, seen = arrived(upstreams["a"])
    assert count == before + 1 and seen == body
    balanced(stack)


def test_a_streaming_request_in_pieces_gets_usage_asked_for_or_passes_unchanged(stack, upstreams):
    body = chat(2000, stream=True)
    reply = post_in_pieces(stack.envoy_port, PATH, body)
    assert reply.status == 200 and b"data: [DONE]" in reply.body
    _, seen = arrived(upstreams["a"])
    sent, got = json.loads(body), json.loads(seen)
    if stack.mode == "STREAMED":  # its pieces go on as they came (server/body.py)
        assert seen == body
    else:  # the buffered path's rewrite, applied the same way
        assert got.pop("stream_options") == {"include_usage": True} and got == sent
    # the usage chunk the gateway asked for is not shown to a client that did not ask
    assert b'"usage"' not in reply.body
    balanced(stack)


def test_a_body_over_the_limit_is_the_same_413_and_leaves_no_count(stack, upstreams):
    before, _ = arrived(upstreams["a"])
    reply = post_in_pieces(stack.envoy_port, PATH, chat(20_000), piece=8192)  # ~100 KB > 64 KiB
    assert reply.status == 413
    assert json.loads(reply.body)["error"]["code"] == "request_too_large"
    assert arrived(upstreams["a"])[0] == before
    balanced(stack)


def test_a_client_gone_mid_body_leaves_no_count(stack, upstreams):
    """Half a body, then the client closes: nothing routed, nothing counted, the next request served."""
    aborted = stack.sample("extproc_requests_total", code="aborted")
    before, _ = arrived(upstreams["a"])
    body = chat(3000)
    with socket.create_connection(("127.0.0.1", stack.envoy_port), timeout=5) as sock:
        sock.sendall((f"POST {PATH} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      f"content-length: {len(body)}\r\n\r\n").encode() + body[:len(body) // 2])
        if stack.mode != "BUFFERED":  # the gateway has the stream open: it sees the client go
            wait_until(lambda: stack.envoy_stat("ext_proc.streams_started") > 0, what="stream opened")
    if stack.mode != "BUFFERED":
        wait_until(lambda: stack.sample("extproc_requests_total", code="aborted") > aborted,
                   what="the stream's end counted as an abort")
    assert arrived(upstreams["a"])[0] == before
    balanced(stack)
    assert post_in_pieces(stack.envoy_port, PATH, chat(10)).status == 200
    balanced(stack)
