"""Serving a long-lived stream of requests with pipelining."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")

log = logging.getLogger(__name__)


async def pipelined(
    requests: AsyncIterator[Req],
    handle: Callable[[Req], Awaitable[Resp]],
    write: Callable[[Resp], Awaitable[object]],
    failed: Callable[[Req, Exception], Resp],
) -> None:
    """Handle each request as it arrives, without waiting for earlier ones, and write each
    response as soon as its handler returns it (`write`: the call's `context.write`, one at a
    time). Handlers start in arrival order, and everything a handler does before its first
    await happens in that order too; work past it that must keep the order takes a lock
    there (asyncio's serves its waiters in order: a ProduceStream's appends). The handler
    writes its own answer: no queue and no generator between it and the stream, which would
    each cost a turn of the event loop per response. Returns once every response is written.

    A handler that raises (a bug, not an answer) fails its request alone, as Kafka answers
    an unexpected exception with the request's error response: the error is logged with its
    traceback and `failed(request, error)` is written in its place, and the stream goes on
    serving the others. Cancellation (the client gone, the server stopping) and a failed
    write still end the stream."""
    writing = asyncio.Lock()

    async def respond(request: Req) -> None:
        try:
            response = await handle(request)
        except Exception as e:  # not CancelledError, a BaseException: that ends the stream
            log.exception("a stream request failed; answering it with an error")
            response = failed(request, e)
        async with writing:
            await write(response)

    try:
        async with asyncio.TaskGroup() as handlers:
            async for request in requests:
                handlers.create_task(respond(request))
    except BaseExceptionGroup as e:
        raise e.exceptions[0] from None
