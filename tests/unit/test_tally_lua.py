"""The Envoy tally script (extproc/envoy/tally.lua) run under LuaJIT/Lua via lupa: the SSE reader must
give the same answer however the body is split into chunks, and strip exactly the usage event."""

from __future__ import annotations

import json
from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

lupa = pytest.importorskip("lupa")

SCRIPT = resources.files("extproc.envoy").joinpath("tally.lua").read_text()


@pytest.fixture(scope="module")
def tally():
    return lupa.LuaRuntime(encoding=None).execute(SCRIPT)


def event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def chat_stream(words: list[str], usage: tuple[int, int] | None) -> tuple[bytes, bytes]:
    """(full stream, the usage event alone)."""
    parts = [event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    parts += [event({"choices": [{"index": 0, "delta": {"content": w}}]}) for w in words]
    parts.append(event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    usage_event = b""
    if usage is not None:
        usage_event = event({"choices": [], "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                                      "total_tokens": sum(usage)}})
        parts.append(usage_event)
    parts.append(event("[DONE]"))
    return b"".join(parts), usage_event


def run(tally, body: bytes, cuts: list[int], strip: bool):
    sse = tally.Sse.new(strip)
    out = []
    edges = [0, *sorted(set(c for c in cuts if 0 < c < len(body))), len(body)]
    for a, b in zip(edges, edges[1:]):
        out.append(sse.feed(sse, body[a:b]))
    out.append(sse.finish(sse))
    return b"".join(out), sse.counted, sse.prompt, sse.output


WORDS = st.lists(st.text(alphabet=st.characters(codec="utf-8", exclude_characters='\x00'), min_size=1,
                         max_size=6), min_size=0, max_size=30)


@settings(max_examples=300, deadline=None)
@given(words=WORDS, cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=40),
       usage=st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.integers(0, 10**6))),
       strip=st.booleans())
def test_any_split_gives_the_unsplit_answer(tally, words, cuts, usage, strip):
    body, usage_event = chat_stream(words, usage)
    whole = run(tally, body, [], strip)
    split = run(tally, body, cuts, strip)
    assert split == whole
    out, counted, prompt, output = split
    assert counted == len(words)
    if usage is None:
        assert (prompt, output) == (None, None) and out == body
    else:
        assert (prompt, output) == usage
        assert out == (body.replace(usage_event, b"") if strip else body)


def test_crlf_lines_and_a_last_line_without_newline(tally):
    body = b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\ndata: {"choices":[],"usage":{"completion_tokens":3}}'
    out, counted, _, output = run(tally, body, [7, 30], strip=False)
    assert (out, counted, output) == (body, 1, 3)


def test_usage_inside_generated_text_is_not_usage(tally):
    text = 'he wrote "usage": {"completion_tokens": 99}'
    body = event({"choices": [{"delta": {"content": text}}]}) + event("[DONE]")
    _, counted, _, output = run(tally, body, [], strip=True)
    assert counted == 1 and output is None


def test_responses_api_usage_and_deltas(tally):
    body = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"Hi"}\n\n'
            b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":'
            b'{"input_tokens":12,"output_tokens":34,"output_tokens_details":{"reasoning_tokens":0}}}}\n\n')
    _, counted, prompt, output = run(tally, body, [50, 51], strip=False)
    assert (counted, prompt, output) == (1, 12, 34)


def test_find_usage_in_a_json_body(tally):
    body = json.dumps({"choices": [{"message": {"content": '"usage": {"completion_tokens": 5}'}}],
                      "usage": {"prompt_tokens": 7, "completion_tokens": 11,
                                "completion_tokens_details": {"reasoning_tokens": 2}}}).encode()
    assert tuple(tally.find_usage(body)) == (7, 11)
    assert tally.find_usage(b'{"usage": null}') is None
