"""Drive the gateway's ext_proc stream in process, as gRPC does (`Processor.serve` with read and write),
over a message sequence a test writes as an async generator."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from extproc.server.processor import Processor


async def stream_replies(processor: Processor,
                  messages: AsyncIterable[ProcessingRequest]) -> AsyncIterator[ProcessingResponse]:
    """The stream's replies, each as it writes it. Cancelling the consumer cancels the stream, as
    Envoy's reset does."""
    it = messages.__aiter__()
    written: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def read() -> Any:
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            return grpc.aio.EOF

    async def run() -> None:
        try:
            await processor.serve(read, written.put)
        finally:
            written.put_nowait(ended)

    task = asyncio.create_task(run())
    try:
        while (reply := await written.get()) is not ended:
            yield reply
        await task  # its error, if it failed
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
