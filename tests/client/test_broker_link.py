"""The producer's link to one broker (_BrokerLink): one ProduceStream, a deadline per request.
Against a fake stream whose broker answers each request a set time after it came."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tidewater.client import producer as producer_mod
from tidewater.client.accumulator import RecordAccumulator
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
            ],
        )

    def cancel(self) -> None:
        self.task.cancel()


class FakeStub:
    def __init__(self) -> None:
        self.delay_s = 0.0

    def ProduceStream(self, requests: Any, metadata: Any = None) -> FakeCall:
        return FakeCall(requests, self)


async def test_a_request_sent_late_in_an_idle_wait_gets_its_whole_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 18 M1: the link read with the deadline it computed when its wait began; idle,
    that was request timeout + grace from then. A request sent near its end met that old
    deadline, and the link failed it (and every request in flight to that broker) as
    timed out, though its answer was on the way: a spurious retry, and without idempotence a
    duplicate."""
    monkeypatch.setattr(producer_mod, "ANSWER_GRACE_S", 1.0)
    producer = producer_mod.Producer(
        ["127.0.0.1:1"], request_timeout_ms=100, acks=1, enable_idempotence=False
    )
    producer._accumulator = RecordAccumulator(1, asyncio.get_running_loop())
    failures: list[str] = []
    monkeypatch.setattr(producer, "_transport_failed", lambda _, reason: failures.append(reason))
    link = producer_mod._BrokerLink(producer, "broker:1")
    stub = FakeStub()
    monkeypatch.setattr(link, "_stub", stub)
    loop = asyncio.get_running_loop()

    def send() -> None:
        batch = producer._accumulator.append(TP, Record(None, b"v", (), None), 10, loop.time())[1]
        batch.build(producer.config.compression, 0)
        producer._in_flight.setdefault(TP, []).append(batch)
        link.send([batch])

    try:
        send()  # answered at once; then the link waits idle, 1.1 s
        await asyncio.sleep(1.0)
        stub.delay_s = 0.3
        send()
        async with asyncio.timeout(5):
            while producer._in_flight[TP] and not failures:
                await asyncio.sleep(0.01)
        assert failures == []
        assert not producer._in_flight[TP]  # answered
    finally:
        await link.close()
        await producer.metadata.close()
