"""OpenAI protocol, pure: request parsing and error bodies. Knows nothing of gRPC or Envoy."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
MODELS_PATH = "/v1/models"

# A rough tokenizer estimate: routing needs prompt size, not exact token ids.
CHARS_PER_TOKEN = 4


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


class OpenAIError(Exception):
    """An error the client should see as an OpenAI-style JSON body with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> bytes:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def parse_request(path: str, body: bytes, header_model: str | None = None) -> Request:
    """Parse a buffered request body. The body's `model` wins over the `model` header."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # absurdly deep nesting: a client error, not a gateway crash
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")

    model = data.get("model", header_model)
    if model is None or model == "":
        raise bad_request("you must provide a model parameter", param="model", code="missing_model")
    if not isinstance(model, str):
        raise bad_request("model must be a string", param="model")

    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", param="stream")
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 0):
        raise bad_request("max_tokens must be a non-negative integer", param="max_tokens")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user must be a string", param="user")

    prompt = _prompt_text(path, data)
    return Request(model=model, path=path, stream=stream, prompt_tokens=estimate_tokens(prompt),
                   max_tokens=max_tokens, user=user, prompt=prompt)


def _prompt_text(path: str, data: dict[str, Any]) -> str:
    if path == CHAT_PATH:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty array", param="messages")
        return "\n".join(_message_text(m) for m in messages)
    if path == COMPLETIONS_PATH:
        prompt = data.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            return " " * (CHARS_PER_TOKEN * len(prompt))  # token ids: only their count matters
        raise bad_request("prompt must be a string or an array of strings", param="prompt")
    return ""  # other model-addressed endpoints (embeddings, ...) are routed on model alone


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        raise bad_request("each message must be an object", param="messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # content parts: keep the text ones
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise bad_request("message content must be a string or an array of parts", param="messages")


def estimate_tokens(text: str) -> int:
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def models_body(names: list[str], created: int = 0) -> bytes:
    return json.dumps({"object": "list", "data": [
        {"id": n, "object": "model", "created": created, "owned_by": "extproc"} for n in names]}).encode()
