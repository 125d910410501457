"""Serving a long-lived stream of requests with pipelining."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")

log = logging.getLogger(__name__)

# Requests one stream has in hand at once. Kafka's broker reads a connection's next request
# only after answering the one before; a stream here pipelines up to this many and reads the
# next once one is answered, so HTTP/2 flow control holds back a client that sends more
# (before, a client could make a broker hold any number of fetch answers or batches).
MAX_IN_FLIGHT_PER_STREAM = 64


async def pipelined(
    requests: AsyncIterator[Req],
    handle: Callable[[Req], Awaitable[Resp]],
    write: Callable[[Resp], Awaitable[object]],
    failed: Callable[[Req, Exception], Resp],
    max_in_flight: int = MAX_IN_FLIGHT_PER_STREAM,
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
    write still end the stream.

    At most `max_in_flight` requests are in hand (read, not yet answered) at once."""
    writing = asyncio.Lock()
    slots = asyncio.Semaphore(max_in_flight)

    async def respond(request: Req) -> None:
        try:
            try:
                response = await handle(request)
            except Exception as e:  # not CancelledError, a BaseException: that ends the stream
                log.exception("a stream request failed; answering it with an error")
                response = failed(request, e)
            async with writing:
                await write(response)
        finally:
            slots.release()

    try:
        async with asyncio.TaskGroup() as handlers:
            incoming = aiter(requests)
            while True:
                await slots.acquire()
                try:
                    request = await anext(incoming)
                except StopAsyncIteration:
                    break
                handlers.create_task(respond(request))
    except BaseExceptionGroup as e:
        raise e.exceptions[0] from None
