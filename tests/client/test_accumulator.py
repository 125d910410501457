"""The accumulator's batches and the per-record futures that share their batch's outcome."""

from __future__ import annotations

import asyncio

import pytest

from tidewater.client.accumulator import RecordAccumulator, RecordFuture, RecordMetadata
from tidewater.errors import MessageTooLarge
from tidewater.records.batch import Record
from tidewater.records.header import Compression

TP = ("t", 0)


@pytest.fixture
async def accumulator() -> RecordAccumulator:
    return RecordAccumulator(batch_size=100, loop=asyncio.get_running_loop())


async def test_records_fill_a_batch_until_it_is_full(accumulator: RecordAccumulator) -> None:
    appended = [accumulator.append(TP, Record(value=b"v"), 40, 0.0) for _ in range(3)]
    [first, _, third] = [batch for _, batch in appended]
    assert first is appended[1][1] and first.closed and len(first.records) == 2
    assert third is not first and not third.closed


async def test_each_record_future_resolves_with_its_own_offset_and_timestamp(
    accumulator: RecordAccumulator,
) -> None:
    stamped, unstamped = (
        accumulator.append(TP, Record(value=b"a", timestamp_ms=5), 10, 0.0)[0],
        accumulator.append(TP, Record(value=b"b"), 10, 0.0)[0],
    )
    [batch] = accumulator.queues[TP]
    seen: list[RecordMetadata] = []
    unstamped.add_done_callback(lambda f: seen.append(f.result()))
    assert not stamped.done()
    with pytest.raises(asyncio.InvalidStateError):
        stamped.result()

    batch.build(Compression.NONE, now_ms=1000)
    batch.complete(base_offset=40, log_append_time_ms=-1)
    assert await stamped == RecordMetadata("t", 0, 40, 5)
    assert await unstamped == RecordMetadata("t", 0, 41, 1000)
    await asyncio.sleep(0)  # callbacks run on the loop, as an asyncio.Future's do
    assert seen == [RecordMetadata("t", 0, 41, 1000)]
    assert stamped.exception() is None and not stamped.cancelled()


async def test_a_failed_batch_fails_every_record(accumulator: RecordAccumulator) -> None:
    futures = [accumulator.append(TP, Record(value=b"v"), 10, 0.0)[0] for _ in range(2)]
    accumulator.queues[TP][0].fail(MessageTooLarge("too big"))
    for future in futures:
        assert isinstance(future.exception(), MessageTooLarge)
        with pytest.raises(MessageTooLarge):
            await future


async def test_a_cancelled_waiter_leaves_the_other_records_alone(
    accumulator: RecordAccumulator,
) -> None:
    first, second = (accumulator.append(TP, Record(value=b"v"), 10, 0.0)[0] for _ in range(2))
    waiting = asyncio.create_task(_await(first))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    accumulator.queues[TP][0].complete(base_offset=0, log_append_time_ms=7)
    assert await first == RecordMetadata("t", 0, 0, 7)
    assert await second == RecordMetadata("t", 0, 1, 7)


async def _await(future: RecordFuture) -> RecordMetadata:
    return await future
