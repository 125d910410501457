"""Serving a long-lived stream of requests with pipelining."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def pipelined(
    requests: AsyncIterator[Req],
    handle: Callable[[Req], Awaitable[Resp]],
    write: Callable[[Resp], Awaitable[object]],
) -> None:
    """Handle each request as it arrives, without waiting for earlier ones, and write each
    response as soon as its handler returns it (`write`: the call's `context.write`, one at a
    time). Handlers start in arrival order, and everything a handler does before its first
    await happens in that order too; work past it that must keep the order takes a lock
    there (asyncio's serves its waiters in order: a ProduceStream's appends). The handler
    writes its own answer: no queue and no generator between it and the stream, which would
    each cost a turn of the event loop per response. Returns once every response is written;
    a failed handler fails the stream with its exception."""
    writing = asyncio.Lock()

    async def respond(request: Req) -> None:
        response = await handle(request)
        async with writing:
            await write(response)

    try:
        async with asyncio.TaskGroup() as handlers:
            async for request in requests:
                handlers.create_task(respond(request))
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
