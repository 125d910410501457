"""A produce whose client goes away (its deadline, a disconnect) while its batch is written on
a worker thread: the batch lands all the same, and what waits on the partition hears of it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tidewater.broker.log import log as log_module
from tidewater.broker.log import segment as segment_module
from tidewater.local.standin_controller import make_leader
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch
from tidewater.v1 import broker_pb2 as pb

TOPIC = "t"


def consumer_fetch(session: tuple[int, int], *, named: bool) -> pb.FetchRequest:
    request = pb.FetchRequest(replica_id=-1, min_bytes=1, max_bytes=1 << 20)
    request.session.id, request.session.epoch = session
    if named:
        request.partitions.add(topic=TOPIC, partition=0, fetch_offset=0, current_leader_epoch=-1)
    return request


async def test_a_produce_cancelled_while_its_batch_is_written_still_reaches_fetch_sessions(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 19 #1: the wake-up of the partition's waiters ran after the append returned, so
    a cancelled produce's batch entered the log (and, an ISR of one, moved the HW) with
    nobody told: a consumer fetch session where the partition had gone quiet left it out of
    every incremental answer until something else touched it."""
    monkeypatch.setattr(log_module, "OFF_LOOP_WRITE_BYTES", 0)  # every batch off the loop
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    manager = server.replica_manager
    session = (await manager.fetch(consumer_fetch((0, 0), named=True))).header.session_id
    quiet = await manager.fetch(consumer_fetch((session, 1), named=False))
    assert list(quiet.partitions) == []  # caught up: the partition is quiet in the session

    writing, release = threading.Event(), threading.Event()
    write = segment_module.LogSegment.write

    def held_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        writing.set()
        release.wait(10)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(segment_module.LogSegment, "write", held_write)
    data = pb.PartitionProduceData(
        topic=TOPIC, partition=0, record_batch=build_batch([Record(value=b"x")])
    )
    produce = asyncio.ensure_future(manager.produce(pb.ProduceRequest(acks=1, partitions=[data])))
    await eventually(writing.is_set, 10)
    produce.cancel()
    release.set()
    hosted = manager.partitions[(TOPIC, 0)]
    await eventually(lambda: hosted.state.high_watermark == 1, 10)
    answer = await manager.fetch(consumer_fetch((session, 2), named=False))
    assert [p.partition for p, _ in answer.partitions] == [0]


async def test_the_retry_of_a_produce_cancelled_while_its_batch_is_written_is_a_duplicate(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 31 #1: the cancelled produce let go of the partition's append turn while its
    idempotent batch was still being written; the producer's retry (on a new stream) was
    checked against a producer state without it, and appended a second time, acknowledged at
    the copy's offsets. The turn is kept until the batch is in the log: the retry is answered
    as the duplicate it is, at the first copy's offset."""
    monkeypatch.setattr(log_module, "OFF_LOOP_WRITE_BYTES", 0)
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    manager = server.replica_manager
    writing, release = threading.Event(), threading.Event()
    write = segment_module.LogSegment.write

    def held_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not writing.is_set():  # the first write only
            writing.set()
            release.wait(10)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(segment_module.LogSegment, "write", held_write)
    batch = build_batch([Record(value=b"x")] * 3, producer_id=7, producer_epoch=0, base_sequence=0)
    data = pb.PartitionProduceData(topic=TOPIC, partition=0, record_batch=batch)
    first = asyncio.ensure_future(manager.produce(pb.ProduceRequest(acks=1, partitions=[data])))
    await eventually(writing.is_set, 10)
    first.cancel()  # the client's stream broke
    retry = asyncio.ensure_future(manager.produce(pb.ProduceRequest(acks=1, partitions=[data])))
    for _ in range(10):  # both run as far as they can while the write is held
        await asyncio.sleep(0)
    release.set()
    answer = await asyncio.wait_for(retry, 10)
    with pytest.raises(asyncio.CancelledError):
        await first
    assert answer.partitions[0].error_code == 0
    assert answer.partitions[0].base_offset == 0
    assert manager.partitions[(TOPIC, 0)].log.log_end_offset == 3
