"""Requests accepted as vLLM accepts them: pydantic's lax mode on the fields the gateway and engine-sim
read. Each case names a JSON value and what vLLM's field type makes of it (REFUSED: a 400). The table
is held against pydantic itself, then the gateway's parser and engine-sim's are held against the table.
"""

import json
from typing import Optional

import pydantic
import pytest

from extproc import openai
from extproc.sim import protocol

REFUSED = object()

BOOLS = [  # Optional[bool]: stream, stream_options.include_usage
    (True, True), (False, False), (1, True), (0, False), (1.0, True), (0.0, False),
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True), ("t", True), ("y", True),
    ("false", False), ("0", False), ("no", False), ("off", False), ("f", False), ("n", False),
    (2, REFUSED), (-1, REFUSED), (1.5, REFUSED), ("maybe", REFUSED), (" true", REFUSED), ("1.0", REFUSED),
    ([], REFUSED), ({}, REFUSED),
]
INTS = [  # Optional[int]: max_tokens, max_completion_tokens, n
    (16, 16), (16.0, 16), ("16", 16), (" 16 ", 16), ("+16", 16), ("1_6", 16), ("16.0", 16), (True, 1),
    (16.5, REFUSED), ("16.5", REFUSED), ("1e3", REFUSED), ("sixteen", REFUSED), ("0x10", REFUSED),
    (1e20, REFUSED), ([16], REFUSED), ({}, REFUSED),
]
STRS = [("u", "u"), (1, REFUSED), (True, REFUSED), (1.0, REFUSED), (["u"], REFUSED)]  # Optional[str]: user


class VllmFields(pydantic.BaseModel):
    """The types vLLM's ChatCompletionRequest gives the fields read here (Optional, lax mode)."""

    b: Optional[bool] = None  # noqa: UP045 -- vLLM's spelling
    i: Optional[int] = None  # noqa: UP045
    s: Optional[str] = None  # noqa: UP045


def pydantic_reads(field: str, value: object) -> object:
    try:  # vLLM's FastAPI route validates the decoded JSON (python mode)
        return getattr(VllmFields.model_validate(json.loads(json.dumps({field: value}))), field)
    except pydantic.ValidationError:
        return REFUSED


def ids(cases):
    return [f"{value!r}->{'refused' if want is REFUSED else repr(want)}" for value, want in cases]


@pytest.mark.parametrize("field,cases", [("b", BOOLS), ("i", INTS), ("s", STRS)])
def test_the_table_is_what_pydantic_does(field, cases):
    assert [pydantic_reads(field, v) for v, _ in cases] == [want for _, want in cases]


def gateway(**fields) -> openai.Request | type[openai.OpenAIError]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}).encode()
    try:
        return openai.parse_request(openai.CHAT_PATH, body)
    except openai.OpenAIError as err:
        assert err.status == 400 and json.loads(err.body())["error"]["type"] == "invalid_request_error"
        return err


def engine_sim(**fields) -> protocol.ParsedRequest | protocol.RequestError:
    try:
        return protocol.parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                       **fields}, chat=True)
    except protocol.RequestError as err:
        assert err.status == 400
        return err


@pytest.mark.parametrize("value,want", BOOLS, ids=ids(BOOLS))
def test_stream(value, want):
    for read in (gateway(stream=value), engine_sim(stream=value)):
        if want is REFUSED:
            assert read.param == "stream"
        else:
            assert read.stream is want


@pytest.mark.parametrize("value,want", BOOLS, ids=ids(BOOLS))
def test_include_usage(value, want):
    options = {"stream_options": {"include_usage": value}}
    for read in (gateway(stream=True, **options), engine_sim(stream=True, **options)):
        if want is REFUSED:
            assert read.param == "stream_options"
        else:
            assert read.include_usage is want


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value,want", INTS, ids=ids(INTS))
def test_max_tokens(field, value, want):
    for read in (gateway(**{field: value}), engine_sim(**{field: value})):
        if want is REFUSED:
            assert read.param in ("max_tokens", field)
        else:
            assert read.max_tokens == want


@pytest.mark.parametrize("value,want", INTS, ids=ids(INTS))
def test_n_at_engine_sim(value, want):
    read = engine_sim(n=value)
    if want == 1:
        assert isinstance(read, protocol.ParsedRequest)
    else:  # refused as vLLM would, or an n the simulator does not serve
        assert read.param == "n"


@pytest.mark.parametrize("value,want", STRS, ids=ids(STRS))
def test_user_at_the_gateway(value, want):
    read = gateway(user=value)
    if want is REFUSED:
        assert read.param == "user"
    else:
        assert read.user == want


def test_stream_options_default_to_usage_as_vllm_does():
    """vLLM's StreamOptions.include_usage defaults to true: `{}` asks for the usage chunk."""
    assert gateway(stream=1, stream_options={}).include_usage
    assert engine_sim(stream=1, stream_options={}).include_usage
    assert not gateway(stream=1).include_usage and not engine_sim(stream=1).include_usage


@pytest.mark.parametrize("value", [0, -1, "0"])
def test_token_limits_below_one_are_refused_at_the_engine(value):
    assert engine_sim(max_tokens=value).param == "max_tokens"  # vLLM: "max_tokens must be at least 1"
