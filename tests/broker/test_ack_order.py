"""The order of work on a leader's acks=all path: whatever an event completes answers before
the request that caused it parks (each park is on the ack's critical path otherwise)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from tidewater.broker.fetch_answer import FetchAnswer
from tidewater.local.standin_controller import make_leader
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "acks"
FOLLOWERS = (2, 3)


def follower_fetch(replica_id: int, offset: int, max_wait_ms: int = 10_000) -> pb.FetchRequest:
    request = pb.FetchRequest(
        replica_id=replica_id, max_wait_ms=max_wait_ms, min_bytes=1, max_bytes=1 << 20
    )
    request.partitions.add(
        topic=TOPIC,
        partition=0,
        fetch_offset=offset,
        current_leader_epoch=1,
        last_fetched_epoch=1 if offset else -1,
        partition_max_bytes=1 << 20,
    )
    return request


@pytest.fixture
async def leader(start_broker: Callable[..., Any]) -> Any:
    """The replica manager of a broker leading acks-0 with followers 2 and 3 in its ISR."""
    server, client = await start_broker(1)
    await make_leader(
        client.channel,
        TOPIC,
        0,
        leader=1,
        leader_epoch=1,
        replicas=[1, *FOLLOWERS],
        configs={"min.insync.replicas": "2"},
    )
    return server.replica_manager


async def test_appended_batch_reaches_waiting_followers_before_the_produce_parks(
    leader: Any,
) -> None:
    parked_produces_when_answered: list[int] = []

    async def fetch(replica_id: int) -> FetchAnswer:
        response = await leader.fetch(follower_fetch(replica_id, 0))
        parked_produces_when_answered.append(leader.produce_purgatory.watched)
        return response

    fetches = [asyncio.create_task(fetch(r)) for r in FOLLOWERS]
    await eventually(lambda: leader.fetch_purgatory.watched == 2, 10.0, 0.001)
    data = pb.PartitionProduceData(
        topic=TOPIC, partition=0, record_batch=build_batch([Record(value=b"v")])
    )
    produce = asyncio.create_task(leader.produce(pb.ProduceRequest(acks=-1, partitions=[data])))
    for answer in await asyncio.gather(*fetches):
        _, records = answer.partitions[0]
        assert records
    assert parked_produces_when_answered == [0, 0]
    produce.cancel()


async def test_follower_fetch_that_commits_a_produce_lets_it_answer_before_parking(
    leader: Any,
) -> None:
    for replica_id in FOLLOWERS:
        await leader.fetch(follower_fetch(replica_id, 0, max_wait_ms=0))
    parked_fetches_when_acked: list[int] = []

    async def produce() -> pb.ProduceResponse:
        data = pb.PartitionProduceData(
            topic=TOPIC, partition=0, record_batch=build_batch([Record(value=b"v")])
        )
        response = await leader.produce(pb.ProduceRequest(acks=-1, partitions=[data]))
        parked_fetches_when_acked.append(leader.fetch_purgatory.watched)
        return response

    acked = asyncio.create_task(produce())
    await eventually(lambda: leader.produce_purgatory.watched == 1, 10.0, 0.001)
    waits = [asyncio.create_task(leader.fetch(follower_fetch(FOLLOWERS[0], 1)))]
    await eventually(lambda: leader.fetch_purgatory.watched == 1, 10.0, 0.001)
    # The second follower's copy commits the batch: the produce answers, then its fetch parks.
    waits.append(asyncio.create_task(leader.fetch(follower_fetch(FOLLOWERS[1], 1))))
    result = (await acked).partitions[0]
    assert (result.error_code, result.base_offset) == (ErrorCode.NONE, 0)
    assert parked_fetches_when_acked == [1]
    await eventually(lambda: leader.fetch_purgatory.watched == 2, 10.0, 0.001)
    for wait in waits:
        wait.cancel()
