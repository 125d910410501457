"""Pipelined stream serving: answers as soon as ready, in one stream, one write at a time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from tidewater.rpc.streams import pipelined


class Stream:
    """A call's two directions: requests pushed by the test, responses as written."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[str | None] = asyncio.Queue()
        self.written: list[str] = []
        self.writing = False

    async def requests(self) -> AsyncIterator[str]:
        while (request := await self.incoming.get()) is not None:
            yield request

    async def write(self, response: str) -> None:
        assert not self.writing, "two writes at once"
        self.writing = True
        await asyncio.sleep(0)  # a write takes a turn of the loop or more
        self.written.append(response)
        self.writing = False


async def test_each_answer_is_written_when_ready_and_a_slow_one_holds_up_none() -> None:
    stream = Stream()
    release = {"slow": asyncio.Event(), "fast": asyncio.Event(), "other": asyncio.Event()}
    started: list[str] = []

    async def handle(request: str) -> str:
        started.append(request)
        await release[request].wait()
        return f"answer to {request}"

    serving = asyncio.create_task(pipelined(stream.requests(), handle, stream.write, never_fails))
    for request in ("slow", "fast", "other"):
        stream.incoming.put_nowait(request)
    stream.incoming.put_nowait(None)
    while len(started) < 3:
        await asyncio.sleep(0)
    assert started == ["slow", "fast", "other"]
    release["fast"].set()
    release["other"].set()
    while len(stream.written) < 2:
        await asyncio.sleep(0)
    assert stream.written == ["answer to fast", "answer to other"]
    assert not serving.done()  # the stream ends only once every answer is written
    release["slow"].set()
    await serving
    assert stream.written == ["answer to fast", "answer to other", "answer to slow"]


async def test_answers_ready_together_are_written_one_at_a_time() -> None:
    stream = Stream()

    async def handle(request: str) -> str:
        return request.upper()

    for request in ("a", "b", "c", "d"):
        stream.incoming.put_nowait(request)
    stream.incoming.put_nowait(None)
    await pipelined(stream.requests(), handle, stream.write, never_fails)
    assert stream.written == ["A", "B", "C", "D"]


async def test_a_failed_handler_answers_its_request_alone_and_the_stream_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler that raises (a bug) has `failed` answer its request; the requests before
    and after it on the stream are answered as usual, and the error is logged once with its
    traceback. Before, the error failed the stream and cancelled the waiting handlers."""
    stream = Stream()
    release = asyncio.Event()

    async def handle(request: str) -> str:
        if request == "bad":
            raise ValueError("cannot answer bad")
        await release.wait()
        return request.upper()

    def failed(request: str, error: Exception) -> str:
        return f"{request} failed: {error}"

    for request in ("before", "bad", "after"):
        stream.incoming.put_nowait(request)
    stream.incoming.put_nowait(None)
    serving = asyncio.create_task(pipelined(stream.requests(), handle, stream.write, failed))
    while not stream.written:
        await asyncio.sleep(0)
    assert stream.written == ["bad failed: cannot answer bad"]
    release.set()
    await serving
    assert stream.written == ["bad failed: cannot answer bad", "BEFORE", "AFTER"]
    [logged] = [r for r in caplog.records if r.exc_info]
    assert logged.levelno == logging.ERROR
    assert isinstance(logged.exc_info[1], ValueError)  # type: ignore[index]


async def test_cancelling_the_stream_cancels_its_handlers_and_answers_nothing() -> None:
    """The client gone or the server stopping cancels the call: that ends the stream as
    before, every waiting handler cancelled, none answered by `failed`."""
    stream = Stream()
    started: list[str] = []
    cancelled: list[str] = []

    async def handle(request: str) -> str:
        started.append(request)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(request)
            raise
        return request

    for request in ("a", "b"):
        stream.incoming.put_nowait(request)
    serving = asyncio.create_task(pipelined(stream.requests(), handle, stream.write, never_fails))
    while len(started) < 2:
        await asyncio.sleep(0)
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
    assert sorted(cancelled) == ["a", "b"]
    assert stream.written == []


async def test_a_failed_write_ends_the_stream() -> None:
    stream = Stream()

    async def handle(request: str) -> str:
        return request

    async def write(response: str) -> None:
        raise ConnectionError("the client has gone")

    stream.incoming.put_nowait("a")
    with pytest.raises(ConnectionError):
        await pipelined(stream.requests(), handle, write, never_fails)


def never_fails(request: str, error: Exception) -> str:
    raise AssertionError(f"no request should fail here: {request} raised {error!r}")


async def test_a_stream_holds_at_most_its_bound_of_requests_and_reads_on_as_they_are_answered() -> (
    None
):
    """Review 19 #6: a client pipelining without end made the broker hold every request (and
    each fetch's answer) at once. Past the bound the stream reads nothing more, so HTTP/2 flow
    control holds the client back, until an answer frees a place."""
    stream = Stream()
    gate = asyncio.Event()
    started: list[str] = []

    async def handle(request: str) -> str:
        started.append(request)
        await gate.wait()
        return request

    for i in range(10):
        stream.incoming.put_nowait(str(i))
    stream.incoming.put_nowait(None)
    serving = asyncio.create_task(
        pipelined(stream.requests(), handle, stream.write, never_fails, max_in_flight=4)
    )
    while len(started) < 4:
        await asyncio.sleep(0)
    for _ in range(10):
        await asyncio.sleep(0)
    assert started == ["0", "1", "2", "3"]
    assert stream.incoming.qsize() == 7  # six requests and the end, not read
    gate.set()
    await serving
    assert sorted(stream.written, key=int) == [str(i) for i in range(10)]
