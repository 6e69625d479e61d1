"""Streaming and in-flight plumbing of the generation endpoints: server-sent events, the merge of
several engine streams, and the cancellation of work whose client went away.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

T = TypeVar("T")


async def run_until_disconnect(work: Awaitable[T], raw_request: Request) -> T | None:
    """Runs `work`, cancelling it when the client disconnects first (then returns None). The
    cancellation reaches the generation loop, whose finally aborts the engine requests."""
    task = asyncio.ensure_future(work)

    async def _listen() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(_listen())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    logger.info("Client disconnected; request aborted")
    return None


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Yields (iterator index, item) as items arrive from any iterator."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()




def sse(payload: BaseModel, **dump_kwargs: Any) -> str:
    return f"data: {payload.model_dump_json(**dump_kwargs)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
