"""Topic ids on brokers (KIP-516) through their real gRPC API: requests naming another id
than the partition's answer UNKNOWN_TOPIC_ID, a LeaderAndIsr naming another id than the log's
answers INCONSISTENT_TOPIC_ID and changes nothing, followers fetch with their id, and a
restarted broker keeps each log's id."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tidewater.broker.topic_ids import read_partition_metadata
from tidewater.local.fetch import consumer_fetch, list_offsets
from tidewater.local.standin_controller import StandinController, leader_and_isr_request
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "events"
TP = (TOPIC, 0)
OLD = uuid.uuid4().bytes
NEW = uuid.uuid4().bytes
WAIT_S = 20.0


async def lead(
    client: Any, topic_id: bytes, leader_epoch: int = 1, replicas: tuple[int, ...] = (1,)
) -> int:
    """LeaderAndIsr making broker 1 lead events-0, naming `topic_id`; the partition's error
    code."""
    request = leader_and_isr_request(
        TOPIC, 0, leader=1, leader_epoch=leader_epoch, replicas=replicas, isr=[1], topic_id=topic_id
    )
    response = await client.control.LeaderAndIsr(request)
    assert response.error_code == ErrorCode.NONE, response.error_message
    return response.partition_errors[0].error_code


async def produce(client: Any, value: bytes, topic_id: bytes) -> pb.PartitionProduceResponse:
    response = await client.service.Produce(
        pb.ProduceRequest(
            acks=1,
            partitions=[
                pb.PartitionProduceData(
                    topic=TOPIC,
                    partition=0,
                    record_batch=build_batch([Record(value=value)]),
                    topic_id=topic_id,
                )
            ],
        )
    )
    return response.partitions[0]


async def fetch(client: Any, topic_id: bytes) -> pb.FetchPartitionResponse:
    request = consumer_fetch(TOPIC, 0, 0)
    request.partitions[0].topic_id = topic_id
    return (await client.service.Fetch(request)).partitions[0]


async def test_requests_naming_another_topic_id_answer_unknown_topic_id(
    start_broker: Callable[..., Any],
) -> None:
    server, client = await start_broker(1)
    assert await lead(client, OLD) == ErrorCode.NONE
    hosted = server.replica_manager.partitions[TP]
    assert read_partition_metadata(hosted.log.dir) == OLD

    # The partition's own id, or none (an older client), is served as before.
    assert (await produce(client, b"named", OLD)).error_code == ErrorCode.NONE
    assert (await produce(client, b"unnamed", b"")).error_code == ErrorCode.NONE
    wrong = await produce(client, b"other topic", NEW)
    assert wrong.error_code == ErrorCode.UNKNOWN_TOPIC_ID, wrong.error_message
    assert (wrong.base_offset, wrong.current_leader.leader_id) == (-1, -1)
    assert hosted.log.log_end_offset == 2  # nothing appended

    for topic_id in (OLD, b""):
        result = await fetch(client, topic_id)
        assert result.error_code == ErrorCode.NONE, result.error_message
        assert [r.value for r in decode_batches(result.record_batches)] == [b"named", b"unnamed"]
    result = await fetch(client, NEW)
    assert result.error_code == ErrorCode.UNKNOWN_TOPIC_ID, result.error_message
    assert result.record_batches == b""

    offsets = list_offsets(TOPIC, 0, pb.OFFSET_SPEC_LATEST)
    assert (await client.service.ListOffsets(offsets)).partitions[0].offset == 2
    offsets.partitions[0].topic_id = NEW
    answer = (await client.service.ListOffsets(offsets)).partitions[0]
    assert (answer.error_code, answer.offset) == (ErrorCode.UNKNOWN_TOPIC_ID, -1)

    epochs = pb.OffsetForLeaderEpochRequest(
        replica_id=-1,
        partitions=[
            pb.OffsetForLeaderEpochPartition(
                topic=TOPIC, partition=0, current_leader_epoch=1, leader_epoch=1, topic_id=OLD
            )
        ],
    )
    assert (await client.service.OffsetForLeaderEpoch(epochs)).partitions[0].end_offset == 2
    epochs.partitions[0].topic_id = NEW
    answer = (await client.service.OffsetForLeaderEpoch(epochs)).partitions[0]
    assert answer.error_code == ErrorCode.UNKNOWN_TOPIC_ID


async def test_leader_and_isr_naming_another_topic_id_changes_nothing(
    start_broker: Callable[..., Any],
) -> None:
    """Kafka's INCONSISTENT_TOPIC_ID: the log is another topic's; the partition stays as it
    was, its log, id and epoch. A restarted broker knows the log's id from its
    partition.metadata and refuses the same."""
    server, client = await start_broker(1)
    assert await lead(client, OLD) == ErrorCode.NONE
    assert (await produce(client, b"kept", OLD)).error_code == ErrorCode.NONE

    assert await lead(client, NEW, leader_epoch=2) == ErrorCode.INCONSISTENT_TOPIC_ID
    hosted = server.replica_manager.partitions[TP]
    assert (hosted.state.leader_epoch, hosted.log.topic_id) == (1, OLD)
    assert read_partition_metadata(hosted.log.dir) == OLD
    assert (await produce(client, b"still served", OLD)).error_code == ErrorCode.NONE

    await server.stop(grace_s=0)
    server, client = await start_broker(1)
    assert await lead(client, NEW, leader_epoch=2) == ErrorCode.INCONSISTENT_TOPIC_ID
    assert TP not in server.replica_manager.partitions
    assert await lead(client, OLD, leader_epoch=2) == ErrorCode.NONE
    result = await fetch(client, OLD)
    values = [r.value for r in decode_batches(result.record_batches)]
    assert values == [b"kept", b"still served"]
    assert (await fetch(client, NEW)).error_code == ErrorCode.UNKNOWN_TOPIC_ID


async def test_a_log_without_an_id_adopts_the_first_one_named(
    start_broker: Callable[..., Any],
) -> None:
    """A log written before topic ids (or under a controller without them) checks nothing
    until a LeaderAndIsr names an id, which it keeps from then on."""
    server, client = await start_broker(1)
    assert await lead(client, b"") == ErrorCode.NONE
    hosted = server.replica_manager.partitions[TP]
    assert not (hosted.log.dir / "partition.metadata").exists()
    assert (await produce(client, b"any id", NEW)).error_code == ErrorCode.NONE
    assert await lead(client, OLD, leader_epoch=2) == ErrorCode.NONE
    assert read_partition_metadata(hosted.log.dir) == OLD
    assert (await produce(client, b"other", NEW)).error_code == ErrorCode.UNKNOWN_TOPIC_ID
    # A later LeaderAndIsr without an id keeps it.
    assert await lead(client, b"", leader_epoch=3) == ErrorCode.NONE
    assert hosted.log.topic_id == OLD


async def test_followers_fetch_with_the_id_their_log_holds(
    standin: tuple[StandinController, str],
    start_broker: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Broker 2 follows with the same id as the leader's and replicates; broker 3 holds
    another topic's log under that name (left with another id) and is answered
    UNKNOWN_TOPIC_ID, copying nothing of the new topic into the old log."""
    caplog.set_level(logging.INFO, logger="tidewater.broker.fetcher")
    _, controller = standin
    props = {"controllers": controller, "replica.fetch.backoff.ms": 50}
    leader, leader_client = await start_broker(1, **props)
    assert await lead(leader_client, NEW, replicas=(1, 2, 3)) == ErrorCode.NONE
    assert (await produce(leader_client, b"new topic", NEW)).error_code == ErrorCode.NONE
    followers = {}
    for broker_id, held in ((2, NEW), (3, OLD)):
        server, client = await start_broker(broker_id, **props)
        followers[broker_id] = server
        # Broker 3 first holds the old topic's log, then is told to follow without an id
        # (which keeps the one its log holds).
        first = leader_and_isr_request(
            TOPIC, 0, leader=broker_id, leader_epoch=0, replicas=[broker_id], topic_id=held
        )
        assert (await client.control.LeaderAndIsr(first)).partition_errors[0].error_code == 0
        follow = leader_and_isr_request(
            TOPIC,
            0,
            leader=1,
            leader_epoch=1,
            replicas=[1, 2, 3],
            isr=[1],
            leaders={1: leader.address},
            topic_id=NEW if broker_id == 2 else b"",
        )
        assert (await client.control.LeaderAndIsr(follow)).partition_errors[0].error_code == 0

    def refused() -> bool:
        return "events-0: fetch error UNKNOWN_TOPIC_ID" in caplog.text

    await eventually(
        lambda: followers[2].replica_manager.partitions[TP].log.log_end_offset == 1, WAIT_S
    )
    await eventually(refused, WAIT_S)
    stale = followers[3].replica_manager.partitions[TP]
    assert (stale.log.log_end_offset, stale.log.topic_id) == (0, OLD)
