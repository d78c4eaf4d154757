"""A minimal OpenAI-shaped upstream for gateway tests: names itself in every answer.

    python -m tests.support.upstream --port 8001 --name a100-0
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web


def make_app(name: str) -> web.Application:
    seen: list[dict[str, str]] = []
    bodies: list[str] = []  # what arrived, as it arrived: a body passed through must be the one sent

    async def generate(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        seen.append(dict(request.headers))
        bodies.append(raw.decode("utf-8", "replace"))
        body = json.loads(raw)  # bytes, as vLLM (Starlette) reads them: a BOM is skipped
        tokens = int(body.get("max_tokens") or 3)
        headers = {"x-upstream": name}
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": f"{name} " * tokens}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1},
            }, headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        delay = float(request.headers.get("x-token-delay", "0"))
        reset_after = int(request.headers.get("x-reset-after", "-1"))  # simulate an engine crash
        for i in range(tokens):
            if i == reset_after:
                request.transport.abort()
                return resp
            chunk = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 0,
                     "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": f"{name} "}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if delay:
                await asyncio.sleep(delay)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"name": name, "requests": len(seen), "headers": seen[-1:],
                                  "bodies": bodies[-1:]})

    app = web.Application(client_max_size=64 << 20)  # long prompts are part of what we test
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/stats", stats)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    web.run_app(make_app(args.name), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
