"""Serving a long-lived stream of requests with pipelining."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def pipelined(
    requests: AsyncIterator[Req], handle: Callable[[Req], Awaitable[Resp]]
) -> AsyncIterator[Resp]:
    """Handle each request as it arrives, without waiting for earlier ones, and yield
    responses as they complete. Handlers start in arrival order, and everything a handler
    does before its first await (a produce's append) happens in that order too."""
    done: asyncio.Queue[asyncio.Task[Resp] | None] = asyncio.Queue()
    pending: set[asyncio.Task[Resp]] = set()

    def finished(task: asyncio.Task[Resp]) -> None:
        pending.discard(task)
        done.put_nowait(task)

    async def read_all() -> None:
        async for request in requests:
            task = asyncio.ensure_future(handle(request))
            pending.add(task)
            task.add_done_callback(finished)
        while pending:
            await asyncio.wait(set(pending))
        done.put_nowait(None)

    reader = asyncio.create_task(read_all())
    try:
        while (task := await done.get()) is not None:
            yield task.result()
        await reader
    finally:
        reader.cancel()
        for task in pending:
            task.cancel()
