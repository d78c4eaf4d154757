import json

import pytest

from extproc.openai import CHAT_PATH, COMPLETIONS_PATH, OpenAIError, estimate_tokens, parse_request


def body(**kw) -> bytes:
    return json.dumps(kw).encode()


def test_chat_request_fields():
    r = parse_request(CHAT_PATH, body(model="m", stream=True, max_completion_tokens=7, user="u",
                                      messages=[{"role": "user", "content": "abcdefgh"}]))
    assert (r.model, r.stream, r.max_tokens, r.user) == ("m", True, 7, "u")
    assert r.prompt_tokens == 2


def test_max_completion_tokens_wins_over_max_tokens():
    r = parse_request(COMPLETIONS_PATH, body(model="m", prompt="x", max_tokens=3, max_completion_tokens=9))
    assert r.max_tokens == 9


def test_content_parts_and_token_id_prompts():
    r = parse_request(CHAT_PATH, body(model="m", messages=[
        {"role": "user", "content": [{"type": "text", "text": "abcd"}, {"type": "image_url"}]}]))
    assert r.prompt_tokens == 1
    assert parse_request(COMPLETIONS_PATH, body(model="m", prompt=[1, 2, 3])).prompt_tokens == 3


def test_header_model_used_only_when_body_has_none():
    assert parse_request(CHAT_PATH, body(messages=[{"content": "x"}]), header_model="h").model == "h"
    assert parse_request(CHAT_PATH, body(model="b", messages=[{"content": "x"}]), "h").model == "b"


@pytest.mark.parametrize("raw,param", [
    (b"{", None), (b"[1]", None), (b"\xff", None),
    (body(messages=[{"content": "x"}]), "model"),
    (body(model=3, messages=[{"content": "x"}]), "model"),
    (body(model="m", messages=[]), "messages"),
    (body(model="m", messages=["x"]), "messages"),
    (body(model="m", messages=[{"content": "x"}], stream="maybe"), "stream"),
    (body(model="m", messages=[{"content": "x"}], max_tokens=-1), "max_tokens"),
    (body(model="m", messages=[{"content": "x"}], max_tokens=1.5), "max_tokens"),
])
def test_bad_requests_are_400_with_param(raw, param):
    with pytest.raises(OpenAIError) as err:
        parse_request(CHAT_PATH, raw)
    assert err.value.status == 400
    assert err.value.param == param
    assert set(json.loads(err.value.body())["error"]) == {"message", "type", "param", "code"}


def test_bad_completions_prompt():
    with pytest.raises(OpenAIError):
        parse_request(COMPLETIONS_PATH, body(model="m", prompt={"a": 1}))


def test_estimate_tokens_rounds_up():
    assert [estimate_tokens("x" * n) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]


def test_invalid_utf8_in_a_skipped_member_is_refused():
    """Found by the fuzzer (tests/reliability/fuzz.py body): the typed decoder skipped an unknown key
    with invalid UTF-8, and the usage splice then failed to decode the same body (a 500)."""
    body = b'{"model": "m", "stream": true, "stream_options": {"incl\xff\xffude": false}, "prompt": "x"}'
    with pytest.raises(OpenAIError) as err:
        parse_request("/v1/completions", body)
    assert err.value.status == 400 and err.value.code == "invalid_json"


def test_a_request_keeps_only_the_prompt_routing_reads():
    """An 8 MB prompt is counted whole but kept to ROUTED_PROMPT_CHARS: a request holds it for its
    whole generation (and it crosses from the parser process)."""
    from extproc.openai import ROUTED_PROMPT_CHARS

    text = "y" * (8 * ROUTED_PROMPT_CHARS)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    request = parse_request("/v1/chat/completions", body)
    assert request.prompt_tokens >= estimate_tokens(text)
    assert len(request.prompt) == ROUTED_PROMPT_CHARS


def test_estimate_tokens_counts_a_short_word_as_a_token():
    # AIBrix's synthetic prompt of n tokens is "hi " n times: 3 characters a token, not 4
    assert estimate_tokens("hi " * 512) == 512
    assert estimate_tokens("a prompt of ordinary English words") == 9  # by characters: 34 / 4, up


def test_a_body_with_a_utf8_bom_is_read_as_vllm_reads_it():
    """Python's json (vLLM's server) skips a UTF-8 byte order mark; RFC 8259 lets a parser do so."""
    r = parse_request("/v1/completions", b'\xef\xbb\xbf{"model": "m", "prompt": "hi", "max_tokens": 3}')
    assert r.model == "m" and r.max_tokens == 3
