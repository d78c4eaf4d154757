"""OpenAI wire format: request validation and the exact chunk shapes."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from extproc.sim.protocol import (
    DONE,
    ChunkFormatter,
    RequestError,
    full_response,
    http_chunk,
    parse_request,
    sample_output_len,
)


def events(data: bytes) -> list[dict]:
    return [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]


def test_chat_chunks_match_openai_shape() -> None:
    fmt = ChunkFormatter(True, "chatcmpl-1", "m", 123)
    evs = events(fmt.tokens(0, 3, last=2, finish_reason="length"))
    assert [e["choices"][0]["delta"] for e in evs] == [
        {"role": "assistant", "content": ""},
        {"content": " the"},
        {"content": " of"},
        {"content": " and"},
    ]
    assert [e["choices"][0]["finish_reason"] for e in evs] == [None, None, None, "length"]
    assert all(
        e["id"] == "chatcmpl-1"
        and e["object"] == "chat.completion.chunk"
        and e["created"] == 123
        and e["model"] == "m"
        and e["choices"][0]["index"] == 0
        for e in evs
    )
    (usage,) = events(fmt.usage(10, 3))
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
    }
    assert DONE == b"data: [DONE]\n\n"


def test_completion_chunks_have_text() -> None:
    fmt = ChunkFormatter(False, "cmpl-1", "m", 1)
    evs = events(fmt.tokens(5, 7, last=6, finish_reason="stop"))
    assert [e["choices"][0]["text"] for e in evs] == [" is", " that"]
    assert evs[-1]["choices"][0]["finish_reason"] == "stop" and evs[0]["object"] == "text_completion"


def test_http_chunk_framing() -> None:
    assert http_chunk(b"hello") == b"5\r\nhello\r\n"
    assert http_chunk(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"


def test_parse_valid_requests() -> None:
    chat = parse_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "a" * 40}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        chat=True,
    )
    assert (chat.prompt_tokens, chat.max_tokens, chat.stream, chat.include_usage) == (14, 5, True, True)
    comp = parse_request({"model": "m", "prompt": [1, 2, 3], "max_completion_tokens": 2}, chat=False)
    assert comp.prompt_tokens == 3 and comp.max_tokens == 2 and not comp.stream
    parts = parse_request(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]},
        chat=True,
    )
    assert parts.prompt_tokens == 5 and parts.max_tokens is None


@pytest.mark.parametrize(
    "body, param",
    [
        ([], None),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": ["x"]}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5.5"}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": 2}, "stream"),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": True},
            },
            "stream_options",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ],
)
def test_parse_rejects(body: object, param: str | None) -> None:
    with pytest.raises(RequestError) as err:
        parse_request(body, chat=True)
    assert err.value.param == param and err.value.status == 400


def test_full_response_and_sampled_lengths() -> None:
    r = full_response(True, "chatcmpl-x", "m", 1, 4, 3, "length")
    assert r["choices"][0]["message"] == {"role": "assistant", "content": " the of and"}
    assert r["usage"]["total_tokens"] == 7 and r["object"] == "chat.completion"


def draws(seed: int, n: int = 2000, median: int = 200, limit: int = 100_000) -> list[int]:
    rng = random.Random(seed)
    return [sample_output_len(rng, median, limit) for _ in range(n)]


def test_sampled_lengths_are_seeded_log_normal_around_the_median() -> None:
    assert draws(3, 50) == draws(3, 50)  # one seed, one sequence (each draw advances the generator)
    assert draws(3, 50) != draws(4, 50)
    many = draws(3)
    assert len(set(many)) > 200  # spread, not a constant
    assert 180 <= statistics.median(many) <= 220  # the configured median (standard error ~2 % at n=2000)
    assert max(many) > 3 * 200  # the long tail
    capped = draws(5, 500, limit=300)
    assert min(capped) >= 1 and max(capped) == 300
