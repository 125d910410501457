"""The producer's link to one broker (_BrokerLink): one ProduceStream, a deadline per request.
Against a fake stream whose broker answers each request a set time after it came."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from tidewater.client import producer as producer_mod
from tidewater.client.accumulator import ProducerBatch, RecordAccumulator
from tidewater.client.errors import SenderFailed
from tidewater.records.batch import Record
from tidewater.v1 import broker_pb2 as pb

TP = ("t", 0)


class FakeCall:
    def __init__(self, requests: Any, stub: FakeStub) -> None:
        self.answers: asyncio.Queue[pb.ProduceRequest] = asyncio.Queue()
        self.stub = stub
        self.task = asyncio.ensure_future(self._serve(requests))

    async def _serve(self, requests: Any) -> None:
        loop = asyncio.get_running_loop()
        async for request in requests:
            loop.call_later(self.stub.delay_s, self.answers.put_nowait, request)

    async def read(self) -> pb.ProduceResponse:
        request = await self.answers.get()
        return pb.ProduceResponse(
            correlation_id=request.correlation_id,
            partitions=[
                pb.PartitionProduceResponse(topic=p.topic, partition=p.partition, base_offset=0)
                for p in request.partitions
                if not self.stub.leaves_out_partitions
            ],
        )

    def cancel(self) -> None:
        self.task.cancel()


class FakeStub:
    def __init__(self) -> None:
        self.delay_s = 0.0
        self.leaves_out_partitions = False

    def ProduceStream(self, requests: Any, metadata: Any = None) -> FakeCall:
        return FakeCall(requests, self)


def linked_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[producer_mod.Producer, producer_mod._BrokerLink, FakeStub, Callable[[], ProducerBatch]]:
    """A producer (acks=1, request_timeout_ms=100) with one link over a fake stream, and how
    to send it a batch: appended, built and in flight, as the sender does."""
    producer = producer_mod.Producer(
        ["127.0.0.1:1"], request_timeout_ms=100, acks=1, enable_idempotence=False
    )
    producer._accumulator = RecordAccumulator(1, asyncio.get_running_loop())
    monkeypatch.setattr(producer.metadata, "leader", lambda tp: None)
    monkeypatch.setattr(producer.metadata, "request_refresh", lambda: None)
    link = producer_mod._BrokerLink(producer, "broker:1")
    stub = FakeStub()
    monkeypatch.setattr(link, "_stub", stub)
    loop = asyncio.get_running_loop()

    def send() -> ProducerBatch:
        accumulator = producer._accumulator
        assert accumulator is not None
        batch = accumulator.append(TP, Record(None, b"v", (), None), 10, loop.time())[1]
        accumulator.queues[TP].remove(batch)
        batch.build(producer.config.compression, 0)
        producer._in_flight.setdefault(TP, []).append(batch)
        link.send([batch])
        return batch

    return producer, link, stub, send


async def test_a_request_sent_late_in_an_idle_wait_gets_its_whole_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 18 M1: the link read with the deadline it computed when its wait began; idle,
    that was request timeout + grace from then. A request sent near its end met that old
    deadline, and the link failed it (and every request in flight to that broker) as
    timed out, though its answer was on the way: a spurious retry, and without idempotence a
    duplicate."""
    monkeypatch.setattr(producer_mod, "ANSWER_GRACE_S", 2.0)
    producer, link, stub, send = linked_producer(monkeypatch)
    failures: list[str] = []
    monkeypatch.setattr(producer, "_transport_failed", lambda _, reason: failures.append(reason))
    try:
        send()  # answered at once; then the link waits idle, 2.1 s
        # Late in that wait (a stall of up to 0.6 s still lands in it), answered after its end.
        await asyncio.sleep(1.5)
        stub.delay_s = 1.0
        send()
        async with asyncio.timeout(5):
            while producer._in_flight[TP] and not failures:
                await asyncio.sleep(0.01)
        assert failures == []
        assert not producer._in_flight[TP]  # answered
    finally:
        await link.close()
        await producer.metadata.close()


async def test_an_error_in_a_link_fails_the_producer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 18 L2: an uncaught error in a link (here an answer that leaves out a partition
    it was asked about) ended its task only, unseen: the answer's batches stayed in flight
    for good, and their partition with them. It fails the producer, as the sender's own."""
    producer, link, stub, send = linked_producer(monkeypatch)
    stub.leaves_out_partitions = True
    sender = asyncio.create_task(producer._run())
    try:
        batch = send()
        async with asyncio.timeout(5):
            await batch.done
        assert isinstance(batch.error, SenderFailed)
        assert "KeyError" in str(batch.error)
        with pytest.raises(SenderFailed):
            producer._check_open()
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        await link.close()
        await producer.metadata.close()
