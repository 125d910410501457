"""The SDK's metadata by age (Kafka's metadata.max.age.ms) on a real cluster: what no error
tells a client — partitions added to its topic, its topic deleted and created again while it
was idle — it learns within metadata_max_age_ms."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from tests.controller.cluster import Cluster, Eventually
from tidewater.client.admin import Admin
from tidewater.client.consumer import Consumer
from tidewater.client.producer import Producer
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

MakeCluster = Callable[..., Awaitable["Cluster"]]
MAX_AGE_MS = 500
DEADLINE_S = 30


async def test_a_producer_sends_keyless_records_to_partitions_added_under_it(
    make_cluster: MakeCluster,
) -> None:
    """CreatePartitions answers no request of the producer's with an error: before, it sent
    to the partitions it knew at its first send for good."""
    cluster = await make_cluster(metadata=True)
    await cluster.create_topic("growing", assignments=[[1, 2, 3]])
    controllers = [p.address for p in cluster.controllers.values()]
    async with (
        asyncio.timeout(DEADLINE_S),
        Admin(controllers) as admin,
        Producer(cluster.bootstrap, linger_ms=0, metadata_max_age_ms=MAX_AGE_MS) as producer,
    ):
        assert (await producer.send_and_wait("growing", b"one partition")).partition == 0
        await admin.create_partitions("growing", 2)
        # Sticky partitioning draws a partition anew for every batch, among those it knows.
        while (await producer.send_and_wait("growing", b"two partitions")).partition != 1:
            pass


async def test_an_idle_consumer_sees_its_topic_created_again_under_its_name(
    make_cluster: MakeCluster, eventually: Eventually, caplog: pytest.LogCaptureFixture
) -> None:
    """The new topic has the old one's leader at the same epoch (0) and a record at the
    consumer's position: no answer is an error. Before, the consumer never refreshed its
    metadata and read the new topic on from its old offset, skipping its first records."""
    caplog.set_level(logging.WARNING, logger="tidewater.client.consumer")
    cluster = await make_cluster(metadata=True)
    await cluster.create_topic("reborn", assignments=[[1, 2, 3]])
    tp = ("reborn", 0)
    async with (
        asyncio.timeout(DEADLINE_S),
        Consumer(
            cluster.bootstrap,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=0,  # no fetch left waiting once a poll has returned records
            metadata_max_age_ms=MAX_AGE_MS,
        ) as consumer,
    ):
        await produce(cluster, b"old-0", b"old-1")
        consumer.assign([tp])
        assert await poll_values(consumer, 2) == [b"old-0", b"old-1"]
        old_id = consumer.metadata.topics["reborn"].topic_id
        # Not polled from here on: nothing it sends can answer with an error.
        response = await cluster.call_controller(
            "DeleteTopics", cpb.DeleteTopicsRequest(topic_names=["reborn"])
        )
        assert response.topics[0].error_code == ErrorCode.NONE
        await eventually(lambda: no_deletions(cluster), 20)
        await cluster.create_topic("reborn", assignments=[[1, 2, 3]])
        await produce(cluster, b"new-0", b"new-1", b"new-2")
        await eventually(lambda: consumer.metadata.topics["reborn"].topic_id != old_id, 20)
        assert await poll_values(consumer, 3) == [b"new-0", b"new-1", b"new-2"]
    assert "reborn-0: the topic was deleted and created again (new topic id)" in caplog.text


async def produce(cluster: Cluster, *values: bytes) -> None:
    async with Producer(cluster.bootstrap) as producer:
        for value in values:
            await producer.send_and_wait("reborn", value, partition=0)


async def poll_values(consumer: Consumer, count: int) -> list[bytes | None]:
    values: list[bytes | None] = []
    while len(values) < count:
        values += [record.value for record in await consumer.poll(1000)]
    return values


async def no_deletions(cluster: Cluster) -> bool:
    return not await cluster.store.load_deletions()
