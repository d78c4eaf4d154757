"""OpenAI wire format for the simulator: request validation and response bodies. Pure, no I/O."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from extproc.field_coercion import LaxError, as_bool, as_int
from extproc.sim.prefix import block_hashes, token_block_hashes
from extproc.tokens import CHARS_PER_TOKEN
from extproc.tokens import estimate_tokens as _count

T = TypeVar("T")

CHAT_TOKENS_PER_MESSAGE = 4  # role markers and separators a chat template adds per message

# Tokens the simulator "generates": short words so streamed text looks like text and costs little to encode.
WORDS = tuple(
    f" {w}"
    for w in (
        "the of and to in is that for it as was with be by on not he this are or his from at which but "
        "have an they you were her she there one all we can their has been if more when will would who so no"
    ).split()
)


class RequestError(ValueError):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    chat: bool
    model: str
    prompt_tokens: int
    max_tokens: int | None  # None: the client set no limit (length is sampled, finish_reason "stop")
    stream: bool
    include_usage: bool
    block_hashes: tuple[int, ...] = ()  # prompt's full KV blocks, for prefix caching


def estimate_tokens(text: str) -> int:
    return max(1, _count(text))  # the gateway's estimate (extproc/tokens.py), at least one token


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise RequestError("message content must be a string or a list of content parts", "messages")


def parse_request(body: Any, chat: bool, block_size: int = 16) -> ParsedRequest:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is a required string", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list", "messages")
        tokens = 0
        rendered = []  # what a chat template would produce, near enough: role markers and contents
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError("each message must be an object with a 'role'", "messages")
            text = _content_text(m.get("content"))
            tokens += CHAT_TOKENS_PER_MESSAGE + estimate_tokens(text)
            rendered.append(f"<|{m['role']}|>\n{text}\n")
        prompt_tokens = tokens
        hashes = block_hashes("".join(rendered), int(block_size * CHARS_PER_TOKEN))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_tokens = estimate_tokens(prompt)
            hashes = block_hashes(prompt, int(block_size * CHARS_PER_TOKEN))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_tokens = len(prompt)  # token ids: exact
            hashes = token_block_hashes(prompt, block_size)
        else:
            raise RequestError(
                "'prompt' must be a string, a list of token ids, or a one-element list", "prompt"
            )
    max_tokens = _lax(as_int, body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _lax(as_int, body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise RequestError("max_tokens must be a positive integer", "max_tokens")
    stream = bool(_lax(as_bool, body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    if opts and not stream:
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    # vLLM's StreamOptions defaults include_usage to true: `"stream_options": {}` asks for usage
    include_usage = opts is not None and _lax(as_bool, opts, "include_usage", True, "stream_options") is True
    n = _lax(as_int, body, "n", 1)
    if n != 1:
        raise RequestError("the simulator supports n=1 only", "n")
    return ParsedRequest(chat, model, prompt_tokens, max_tokens, stream, include_usage, hashes)


def _lax(coerce: Callable[[object], T], fields: dict[str, Any], name: str, default: T | None = None,
         param: str | None = None) -> T | None:
    """A field coerced as vLLM's pydantic models coerce it in lax mode (`"stream": 1`, `"n": 1.0`)."""
    value = fields.get(name, default)
    if value is None:
        return None
    try:
        return coerce(value)
    except LaxError as exc:
        raise RequestError(f"{name}: {exc}", param or name) from None


def sample_output_len(rng: random.Random, median: int, limit: int) -> int:
    """Log-normal lengths (sigma 0.8): most answers near the median, a long tail, as in chat traces."""
    return max(1, min(limit, int(round(rng.lognormvariate(math.log(max(1, median)), 0.8)))))


def token_text(i: int) -> str:
    return WORDS[i % len(WORDS)]


# JSON-encoded token texts, rendered once: a token chunk is then a bytes join.
_WORD_JSON = tuple(json.dumps(w).encode() for w in WORDS)


class ChunkFormatter:
    """Pre-renders the constant part of a stream's SSE events (bytes), so one event per token is cheap."""

    __slots__ = ("chat", "_head", "_tail", "_base")

    def __init__(self, chat: bool, request_id: str, model: str, created: int) -> None:
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._base = {"id": request_id, "object": obj, "created": created, "model": model}
        head = "data: " + json.dumps(self._base)[:-1]
        if chat:
            self._head = (head + ', "choices": [{"index": 0, "delta": {"content": ').encode()
            self._tail = b'}, "logprobs": null, "finish_reason": null}]}\n\n'
        else:
            self._head = (head + ', "choices": [{"index": 0, "text": ').encode()
            self._tail = b', "logprobs": null, "finish_reason": null}]}\n\n'

    def role(self) -> bytes:
        delta = {"role": "assistant", "content": ""}
        return self._event(
            {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
        )

    def token(self, i: int) -> bytes:
        return self._head + _WORD_JSON[i % len(_WORD_JSON)] + self._tail

    def last_token(self, i: int, finish_reason: str) -> bytes:
        text = token_text(i)
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": text}} if self.chat else {"index": 0, "text": text}
        )
        choice.update(logprobs=None, finish_reason=finish_reason)
        return self._event({"choices": [choice]})

    def tokens(self, start: int, stop: int, last: int, finish_reason: str) -> bytes:
        """Events for tokens [start, stop); the role event first for chat; finish_reason on token `last`."""
        parts = [self.role()] if self.chat and start == 0 and stop > 0 else []
        for i in range(start, stop):
            parts.append(self.last_token(i, finish_reason) if i == last else self.token(i))
        return b"".join(parts)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._event({"choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    def _event(self, fields: dict[str, Any]) -> bytes:
        return ("data: " + json.dumps({**self._base, **fields}) + "\n\n").encode()


def http_chunk(data: bytes) -> bytes:
    """HTTP/1.1 chunked transfer framing of one chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data)


DONE = b"data: [DONE]\n\n"


def error_event(message: str, type_: str, code: int) -> bytes:
    """An SSE event carrying an OpenAI error object: how a stream that already sent 200 reports failure
    (the openai client raises APIError on it)."""
    return ("data: " + json.dumps(error_body(message, type_, None, code)) + "\n\n").encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(
    chat: bool,
    request_id: str,
    model: str,
    created: int,
    prompt_tokens: int,
    completion_tokens: int,
    finish_reason: str,
) -> dict[str, Any]:
    text = "".join(token_text(i) for i in range(completion_tokens))
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }
