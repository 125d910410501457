"""Pipelined stream serving: answers as soon as ready, in one stream, one write at a time."""

from __future__ import annotations

import asyncio
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

    serving = asyncio.create_task(pipelined(stream.requests(), handle, stream.write))
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
    await pipelined(stream.requests(), handle, stream.write)
    assert stream.written == ["A", "B", "C", "D"]


async def test_a_failed_handler_fails_the_stream_with_its_error() -> None:
    stream = Stream()
    waiting = asyncio.Event()

    async def handle(request: str) -> str:
        if request == "bad":
            raise ValueError("cannot answer bad")
        await waiting.wait()  # never set: cancelled when the stream fails
        return request

    stream.incoming.put_nowait("good")
    stream.incoming.put_nowait("bad")
    with pytest.raises(ValueError, match="cannot answer bad"):
        await pipelined(stream.requests(), handle, stream.write)
    assert stream.written == []
