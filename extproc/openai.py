"""OpenAI protocol, pure: request parsing and error bodies. Knows nothing of gRPC or Envoy."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from extproc.field_coercion import LaxError, as_bool, as_int
from extproc.tokens import CHARS_PER_TOKEN, estimate_tokens  # routing needs prompt size, not token ids

T = TypeVar("T")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
MODELS_PATH = "/v1/models"

# Of a prompt, routing keeps what it reads (prefix hashing takes the first 32k tokens by default,
# ~128 K characters): a request holds this much for its whole generation, not an 8 MB prompt.
ROUTED_PROMPT_CHARS = 1 << 20


@dataclass(slots=True, frozen=True)
class Request:
    """What routing needs to know about one OpenAI request."""

    model: str
    path: str
    stream: bool = False
    prompt_tokens: int = 0
    max_tokens: int | None = None
    user: str | None = None
    prompt: str = ""
    include_usage: bool = False       # the client asked for the usage chunk itself
    has_stream_options: bool = False
    session_key: str | None = None    # x-aibrix-session-key: session-affinity routing
    traceparent: str | None = None    # the client's W3C traceparent: the gateway's span is its child
    # The data plane's subset hint (the endpoint-picker protocol): only these endpoints ("ip:port", or an
    # ip for any of its ports) may be picked, now or when the request leaves a waiting room. None: any.
    endpoint_subset: frozenset[str] | None = None


class OpenAIError(Exception):
    """An error the client should see as an OpenAI-style JSON body with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # sent with the error: Retry-After, WWW-Authenticate, x-ratelimit-*

    def __reduce__(self):  # crosses process boundaries when large bodies are parsed in a worker
        return (_rebuild_error, (self.status, self.message, self.type, self.param, self.code, self.headers))

    def body(self) -> bytes:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def _rebuild_error(status: int, message: str, type: str, param: str | None, code: str | None,
                   headers: tuple[tuple[str, str], ...]) -> OpenAIError:
    return OpenAIError(status, message, type=type, param=param, code=code, headers=headers)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


ECHO_CHARS = 256  # of a client's value that an error message repeats


def quoted(value: str) -> str:
    """A client's value in an error message: quoted, and cut to ECHO_CHARS characters, saying so."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}... (cut: {len(value)} characters)"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# A scalar as JSON gave it: booleans and integers are coerced after decoding as vLLM's pydantic models
# coerce them in lax mode (`"stream": 1`, `"max_tokens": 16.0`), so the gateway accepts what vLLM accepts.
_Scalar = bool | int | float | str


class _StreamOptions(msgspec.Struct):
    include_usage: _Scalar | None | msgspec.UnsetType = msgspec.UNSET


class _Part(msgspec.Struct):
    text: str | None = None


class _Message(msgspec.Struct):
    content: str | list[_Part] | None = None


class _Body(msgspec.Struct):
    """The fields routing reads; everything else is skipped by the decoder without building objects,
    which is what keeps an 8 MB prompt from stalling the event loop."""

    model: str | None = None
    stream: _Scalar | None = False
    max_tokens: _Scalar | None = None
    max_completion_tokens: _Scalar | None = None
    user: str | None = None
    stream_options: _StreamOptions | None = None
    messages: list[_Message] | msgspec.UnsetType = msgspec.UNSET
    # str, [str], [int] (token ids) or [[int]]: validated below, after decoding
    prompt: str | list[str | int | list[int]] | msgspec.UnsetType = msgspec.UNSET


_DECODER = msgspec.json.Decoder(_Body)
UTF8_BOM = b"\xef\xbb\xbf"
_PATH_PARAM = re.compile(r"`\$\.([A-Za-z_]+)")


def parse_request(path: str, body: bytes, header_model: str | None = None) -> Request:
    """Parse a buffered request body. The body's `model` wins over the `model` header."""
    if body.startswith(UTF8_BOM):  # RFC 8259 lets a parser ignore it, and vLLM's (Python's json) does
        body = body[len(UTF8_BOM):]
    try:
        data = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        found = _PATH_PARAM.search(str(exc))
        param = found.group(1) if found else None
        if param == "max_completion_tokens":
            param = "max_tokens"
        # No field path: the body itself is not a JSON object.
        raise bad_request(f"invalid request: {exc}", param=param,
                          code=None if found else "invalid_json") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        # JSON on the wire is UTF-8 (RFC 8259): other encodings are malformed here, as they would
        # be at the engine.
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    try:  # the typed decoder skips unknown members without checking their bytes
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})",
                          code="invalid_json") from None

    model = data.model if data.model is not None else header_model
    if not model:
        raise bad_request("you must provide a model parameter", param="model", code="missing_model")
    max_tokens = _tokens("max_completion_tokens", data.max_completion_tokens)
    if max_tokens is None:
        max_tokens = _tokens("max_tokens", data.max_tokens)
    stream = _lax(as_bool, "stream", data.stream) or False
    prompt = _prompt_text(path, data)
    options = data.stream_options
    return Request(model=model, path=path, stream=stream, prompt_tokens=estimate_tokens(prompt),
                   max_tokens=max_tokens, user=data.user, prompt=prompt[:ROUTED_PROMPT_CHARS],
                   include_usage=options is not None and _include_usage(options),
                   has_stream_options=options is not None)


def _lax(coerce: Callable[[object], T], field: str, value: object, param: str | None = None) -> T | None:
    if value is None:
        return None
    try:
        return coerce(value)
    except LaxError as exc:
        raise bad_request(f"invalid request: {exc} - at `$.{field}`", param=param or field) from None


def _tokens(field: str, value: object) -> int | None:
    tokens = _lax(as_int, field, value, param="max_tokens")
    if tokens is not None and tokens < 0:
        raise bad_request(f"invalid request: Expected `int` >= 0 - at `$.{field}`", param="max_tokens")
    return tokens


def _include_usage(options: _StreamOptions) -> bool:
    """vLLM's StreamOptions defaults include_usage to true: `"stream_options": {}` asks for usage."""
    if options.include_usage is msgspec.UNSET:
        return True
    return bool(_lax(as_bool, "stream_options.include_usage", options.include_usage, param="stream_options"))


def _prompt_text(path: str, data: _Body) -> str:
    if path == CHAT_PATH:
        messages = data.messages
        if not messages:
            raise bad_request("messages must be a non-empty array", param="messages")
        return "\n".join(_message_text(m.content) for m in messages)
    if path == COMPLETIONS_PATH:
        prompt = data.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        # token ids, or a batch of them: only their count matters (a stand-in text that many tokens long)
        if prompt and all(isinstance(p, int) for p in prompt):
            return "-" * (CHARS_PER_TOKEN * len(prompt))
        if prompt and all(isinstance(p, list) for p in prompt):
            return "-" * (CHARS_PER_TOKEN * sum(len(p) for p in prompt))
        raise bad_request("prompt must be a string, an array of strings or of token ids", param="prompt")
    return ""  # other model-addressed endpoints (embeddings, ...) are routed on model alone


def _message_text(content: str | list[_Part] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(p.text for p in content if p.text is not None)  # text parts; images etc. skipped


def with_usage_requested(body: bytes, request: Request) -> bytes | None:
    """The body with `stream_options.include_usage: true`, or None when it needs no change.

    Asking every engine for its usage chunk makes the tally exact whatever the engine. Without a
    `stream_options` key the new key is spliced in after the opening brace (no re-encoding of a long
    prompt); with one, the client's other options are kept and the body is re-encoded.
    """
    if not request.stream or request.include_usage:
        return None
    if not request.has_stream_options:
        brace = body.index(b"{")
        return body[:brace + 1] + _USAGE_MEMBER + (b"," if body[brace + 1:].strip() != b"}" else b"") \
            + body[brace + 1:]
    data = msgspec.json.decode(body)
    options = data.get("stream_options")
    data["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return msgspec.json.encode(data)


_USAGE_MEMBER = b'"stream_options":{"include_usage":true}'


def models_body(names: list[str], created: int = 0) -> bytes:
    return json.dumps({"object": "list", "data": [
        {"id": n, "object": "model", "created": created, "owned_by": "extproc"} for n in names]}).encode()
