"""The producer's futures around start(), close(), flush() and the delivery timeout: a send()
racing close(), a close() racing the first send()s, a failed start, a dead sender, a close()
that times out, a cancelled flush(), and a batch in flight past delivery_timeout_ms. The real
producer, its sender driven by hand (or its own) against a fake link that never answers
(conftest's `sent`): every future must resolve, and with its real outcome."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from tidewater.client.accumulator import ProducerBatch
from tidewater.client.errors import (
    DeliveryTimeout,
    MetadataUnavailable,
    ProducerClosed,
    SenderFailed,
    error_for,
)
from tidewater.client.metadata import TopicInfo
from tidewater.client.producer import Producer
from tidewater.errors import TidewaterError
from tidewater.records.batch import Record
from tidewater.records.header import NO_PRODUCER_EPOCH, NO_PRODUCER_ID
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

TP = ("t", 0)
NOT_LEADER = pb.PartitionProduceResponse(
    topic="t", partition=0, error_code=ErrorCode.NOT_LEADER_OR_FOLLOWER
)


def acknowledged(offset: int) -> pb.PartitionProduceResponse:
    return pb.PartitionProduceResponse(
        topic="t", partition=0, error_code=ErrorCode.NONE, base_offset=offset
    )


def knows_topic(producer: Producer) -> Producer:
    producer.metadata.topics["t"] = TopicInfo(ErrorCode.NONE, "", 1)
    return producer


def append(producer: Producer, value: bytes, created: float) -> ProducerBatch:
    assert producer._accumulator is not None
    return producer._accumulator.append(TP, Record(None, value, (), None), 100, created)[1]


async def test_a_send_whose_metadata_comes_after_close_raises_producer_closed(
    hand_driven_producer: Callable[..., Producer],
) -> None:
    """Before, it appended after close() had flushed and stopped the sender: its future hung."""
    async with asyncio.timeout(10):
        producer = hand_driven_producer()
        asked, answer = asyncio.Event(), asyncio.Event()

        async def slow_refresh(topics: Any = ()) -> None:
            asked.set()
            await answer.wait()
            knows_topic(producer)

        producer.metadata.refresh = slow_refresh  # type: ignore[method-assign]
        sending = asyncio.create_task(producer.send("t", b"x"))
        await asked.wait()
        await producer.close()
        answer.set()
        with pytest.raises(ProducerClosed):
            await sending
        assert producer._accumulator is not None and not producer._accumulator.incomplete


async def test_a_send_waiting_on_a_refresh_close_cancels_raises_producer_closed(
    hand_driven_producer: Callable[..., Producer],
) -> None:
    """close() cancels the metadata refresh the send() shares: before, the send() raised
    that CancelledError, as if the application had cancelled it."""
    async with asyncio.timeout(10):
        producer = hand_driven_producer()
        asked = asyncio.Event()

        async def silent_service(topics: list[str]) -> None:
            asked.set()
            await asyncio.Event().wait()  # a metadata service that never answers

        producer.metadata._fetch = silent_service  # type: ignore[method-assign,assignment]
        sending = asyncio.create_task(producer.send("t", b"x"))
        await asked.wait()
        await producer.close()
        with pytest.raises(ProducerClosed):
            await sending


def slow_producer_id(producer: Producer) -> tuple[asyncio.Event, asyncio.Event]:
    """InitProducerId waits for the test (a cluster starting): (asked, answer)."""
    asked, answer = asyncio.Event(), asyncio.Event()

    async def init_producer_id() -> None:
        asked.set()
        await answer.wait()
        producer._sequences.set_producer_id(4242, 0)

    producer._init_producer_id = init_producer_id  # type: ignore[method-assign]
    return asked, answer


@pytest.mark.parametrize("answered", [True, False], ids=["id-after-close", "no-id"])
async def test_a_close_racing_the_first_sends_returns_and_they_raise_producer_closed(
    sent: list[ProducerBatch], answered: bool
) -> None:
    """Before, the second send() appended while the first one's start() waited for a producer
    id, with no sender yet; close() then waited for that record forever, as start() refused
    to start the sender after close(). Now every send() waits for the one start()."""
    async with asyncio.timeout(10):
        producer = knows_topic(Producer(["127.0.0.1:1"]))
        asked, answer = slow_producer_id(producer)
        first = asyncio.create_task(producer.send("t", b"a", partition=0))
        await asked.wait()
        second = asyncio.create_task(producer.send("t", b"b", partition=0))
        closing = asyncio.create_task(producer.close())
        while not producer._closed:
            await asyncio.sleep(0)
        if answered:
            answer.set()
        await closing
        for sending in (first, second):
            with pytest.raises(ProducerClosed):
                await sending
        assert producer._sender is None and sent == []


async def test_a_failed_start_leaves_the_producer_unstarted_and_the_next_send_starts_it(
    sent: list[ProducerBatch],
) -> None:
    """Before, a start() whose InitProducerId failed left the accumulator with no sender:
    every later send() appended records nothing would send, and close() waited for them."""
    async with asyncio.timeout(10):
        producer = knows_topic(Producer(["127.0.0.1:1"], max_block_ms=0))
        producer.metadata.leader = lambda tp: (1, "leader:1", 5)  # type: ignore[method-assign]

        async def no_broker_answers() -> None:
            raise error_for(ErrorCode.PRODUCER_ID_ALLOCATION_FAILED, "no broker answered")

        async def an_id() -> None:
            producer._sequences.set_producer_id(4242, 0)

        producer._init_producer_id = no_broker_answers  # type: ignore[method-assign]
        first = asyncio.create_task(producer.send("t", b"a", partition=0))
        second = asyncio.create_task(producer.send("t", b"b", partition=0))
        for sending in (first, second):
            with pytest.raises(TidewaterError, match="no broker answered"):
                await sending
        producer._init_producer_id = an_id  # type: ignore[method-assign]
        future = await producer.send("t", b"c", partition=0)
        while not sent:  # the sender drains the record (linger_ms passes)
            await asyncio.sleep(0.01)
        producer._completed(sent[0], acknowledged(0))
        assert (await future).offset == 0
        await producer.close()


async def test_a_send_and_a_close_after_the_sender_died_return(
    sent: list[ProducerBatch],
) -> None:
    """A sender stopped by a bug would never send a record: send() raises SenderFailed at
    once, and close() returns (before, send() queued the record and close() failed it)."""
    async with asyncio.timeout(10):
        producer = knows_topic(Producer(["127.0.0.1:1"], enable_idempotence=False))

        def bug(now: float) -> float:
            raise RuntimeError("a bug in the sender")

        producer._drain = bug  # type: ignore[method-assign]
        await producer.start()
        assert producer._sender is not None
        await asyncio.wait([producer._sender])
        with pytest.raises(SenderFailed, match="a bug in the sender"):
            await producer.send("t", b"x", partition=0)
        await producer.close()


async def test_a_close_that_times_out_fails_every_future_and_the_send_waiting_for_memory(
    hand_driven_producer: Callable[..., Producer], sent: list[ProducerBatch]
) -> None:
    """Before, the timed-out close() cancelled the queued futures (awaiting one raised
    CancelledError, result() gave offset -1) and the send() waiting for memory hung."""
    async with asyncio.timeout(10):
        # Two records of 121 bytes (100 and the record overhead) fill buffer_memory.
        producer = knows_topic(hand_driven_producer(buffer_memory=250))
        in_flight = await producer.send("t", bytes(100))
        producer._drain(time.monotonic())
        assert len(sent) == 1  # its answer never comes
        queued = await producer.send("t", bytes(100))
        # _wait_for_memory clears the event: then the send() waits for memory.
        producer._memory_freed.set()
        waiting = asyncio.create_task(producer.send("t", bytes(100)))
        while producer._memory_freed.is_set():
            await asyncio.sleep(0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):  # never met: the answer never comes
                await producer.close()
        for future in (in_flight, queued):
            with pytest.raises(ProducerClosed):
                await future
        assert "may be in the log" in str(in_flight.exception())
        assert "may be in the log" not in str(queued.exception())
        with pytest.raises(ProducerClosed):
            await waiting
        # The batch sent has an unresolved sequence; nothing is left open.
        assert not producer._sequences._entries
        assert producer._used_memory == 0


async def test_a_cancelled_flush_leaves_the_futures_to_their_outcome(
    hand_driven_producer: Callable[..., Producer], sent: list[ProducerBatch]
) -> None:
    """Before, cancelling flush() cancelled the batches' futures: the record was written, but
    awaiting its future raised CancelledError."""
    async with asyncio.timeout(10):
        producer = knows_topic(hand_driven_producer())
        future = await producer.send("t", b"x")
        producer._drain(time.monotonic())
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):  # never met: the answer has not come
                await producer.flush()
        assert not future.done()
        producer._completed(sent[0], acknowledged(7))
        assert (await future).offset == 7


async def test_a_batch_in_flight_expires_at_the_delivery_timeout(
    hand_driven_producer: Callable[..., Producer], sent: list[ProducerBatch]
) -> None:
    """As in Kafka, delivery_timeout_ms bounds a batch in flight too: its future fails at the
    deadline, without waiting for the answer (request_timeout_ms, and the link's own timeout,
    after the send). Its request may still append it: its sequence is unresolved, new batches
    wait for its answer, and then go on in the same epoch when it was appended."""
    producer = hand_driven_producer(delivery_timeout_ms=120_000, request_timeout_ms=30_000)
    t0 = time.monotonic()
    a = append(producer, b"A", t0)
    producer._drain(t0)
    assert sent == [a]
    # The sender wakes up at its deadline, before request_timeout_ms.
    assert producer._drain(t0 + 100) == pytest.approx(20)
    producer._drain(t0 + 120)
    assert isinstance(a.error, DeliveryTimeout)
    assert "may be in the log" in str(a.error)
    assert producer._accumulator is not None and not producer._accumulator.incomplete
    assert producer._sequences.settle() == []  # no bump while it may yet be appended
    b = append(producer, b"B", t0 + 120)
    producer._drain(t0 + 120)
    assert sent == [a]  # B waits for A's answer
    producer._completed(a, acknowledged(0))  # it was appended
    producer._drain(t0 + 121)
    assert sent == [a, b]
    producer._completed(b, acknowledged(1))
    assert isinstance(a.error, DeliveryTimeout)
    assert b.error is None and b.base_offset == 1
    assert (b.producer_epoch, b.base_sequence, producer._sequences.bumps) == (0, 1, 0)


async def test_a_delivery_timeout_names_the_retriable_error_it_was_last_answered_with(
    hand_driven_producer: Callable[..., Producer], sent: list[ProducerBatch]
) -> None:
    """Retried on NOT_ENOUGH_REPLICAS until delivery_timeout_ms (as in Kafka); the timeout
    says which error kept it from being written, and carries it as `last_error`."""
    producer = hand_driven_producer(delivery_timeout_ms=120_000, request_timeout_ms=30_000)
    t0 = time.monotonic()
    a = append(producer, b"A", t0)
    producer._drain(t0)
    reason = "t-0: ISR [1, 2] is smaller than min.insync.replicas=3"
    producer._completed(
        a,
        pb.PartitionProduceResponse(
            topic="t",
            partition=0,
            error_code=ErrorCode.NOT_ENOUGH_REPLICAS,
            error_message=reason,
        ),
    )
    assert a.error is None  # queued again, to be retried
    producer._drain(t0 + 121)
    assert isinstance(a.error, DeliveryTimeout)
    assert a.error.last_error is not None
    assert a.error.last_error.code == ErrorCode.NOT_ENOUGH_REPLICAS
    assert a.error.last_error.message == reason  # the partition named once
    assert str(a.error) == (
        "REQUEST_TIMED_OUT: t-0: not acknowledged within delivery_timeout_ms (120000 ms); "
        "last error NOT_ENOUGH_REPLICAS: ISR [1, 2] is smaller than min.insync.replicas=3"
    )


async def test_a_batch_expired_in_flight_is_not_sent_again_after_its_answer(
    hand_driven_producer: Callable[..., Producer], sent: list[ProducerBatch]
) -> None:
    producer = hand_driven_producer(delivery_timeout_ms=120_000, request_timeout_ms=30_000)
    t0 = time.monotonic()
    a = append(producer, b"A", t0)
    producer._drain(t0)
    producer._drain(t0 + 120)
    assert isinstance(a.error, DeliveryTimeout)
    sent.clear()
    producer._completed(a, NOT_LEADER)
    producer._sequences.settle()
    producer._drain(t0 + 130)
    assert sent == [] and not producer._in_flight[TP]
    # Its sequence was unresolved: the partition moved on in a new epoch.
    assert producer._sequences.bumps == 1


async def test_batches_expire_while_no_new_producer_id_comes(
    hand_driven_producer: Callable[..., Producer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 18 L1: once the epoch ran out, the sender looped asking for a new producer id
    and expired nothing: while InitProducerId kept failing, flush() and close() hung."""
    producer = hand_driven_producer(
        delivery_timeout_ms=300, request_timeout_ms=200, retry_backoff_ms=20
    )
    producer._sequences.set_producer_id(NO_PRODUCER_ID, NO_PRODUCER_EPOCH)

    async def no_producer_id() -> None:
        raise MetadataUnavailable("no metadata service answers")

    monkeypatch.setattr(producer, "_init_producer_id", no_producer_id)
    a = append(producer, b"A", time.monotonic())
    sender = asyncio.create_task(producer._send_forever())
    try:
        async with asyncio.timeout(10):
            await a.done
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    assert isinstance(a.error, DeliveryTimeout)
