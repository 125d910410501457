"""Topic ids (KIP-516) on a real cluster: given at CreateTopics, stored in etcd, kept across a
controller failover, served by the metadata service; and what they are for: an SDK client
that outlives a topic writes to the topic created again under its name, and a consumer
holding a position in the old topic reads the new one from its reset position, never on from
the old position (its fetch names the old id, which the broker no longer holds)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from tests.controller.cluster import Cluster, Eventually
from tidewater.client.consumer import Consumer
from tidewater.client.producer import Producer
from tidewater.controller.model import TopicState
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1 import metadata_pb2, metadata_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

MakeCluster = Callable[..., Awaitable["Cluster"]]
TP = ("orders", 0)


async def create(cluster: Cluster, name: str, *replicas: int) -> cpb.CreatableTopicResult:
    """One partition on `replicas`, the first leading."""
    topic = cpb.CreatableTopic(name=name)
    topic.assignments.add(partition=0, broker_ids=list(replicas))
    response = await cluster.call_controller(
        "CreateTopics", cpb.CreateTopicsRequest(topics=[topic])
    )
    return response.topics[0]


async def stored_id(cluster: Cluster, name: str) -> str | None:
    return (await cluster.store.load_topics())[name].get("topic_id")


async def served(cluster: Cluster, name: str) -> metadata_pb2.TopicMetadata:
    assert cluster.metadata is not None
    stub = metadata_pb2_grpc.MetadataServiceStub(cluster._channel(cluster.metadata.address))
    response = await stub.GetMetadata(metadata_pb2.GetMetadataRequest(topics=[name]), timeout=5)
    return response.topics[0]


async def fail_over(cluster: Cluster, eventually: Eventually) -> None:
    """Kill -9 the active controller; return once the other is active and every broker alive
    (heartbeating to it)."""
    active = await cluster.store.active_controller()
    assert active is not None
    cluster.controllers[active[0]].kill()

    async def new_controller() -> bool:
        now = await cluster.store.active_controller()
        return now is not None and now[0] != active[0]

    await eventually(new_controller, cluster.lease_ttl_s + 2)
    await eventually(lambda: cluster.has_alive_brokers({1, 2, 3}), 20)


async def test_a_topic_keeps_its_id_in_etcd_in_metadata_and_across_a_failover(
    make_cluster: MakeCluster, eventually: Eventually
) -> None:
    cluster = await make_cluster(metadata=True)
    result = await create(cluster, "orders", 1, 2, 3)
    assert result.error_code == ErrorCode.NONE, result.error_message
    topic_id = uuid.UUID(bytes=result.topic_id)
    assert await stored_id(cluster, "orders") == str(topic_id)
    other = await create(cluster, "audit", 1, 2, 3)
    assert other.topic_id not in (b"", topic_id.bytes)

    async def served_with(partitions: int) -> bool:
        topic = await served(cluster, "orders")
        return topic.topic_id == topic_id.bytes and len(topic.partitions) == partitions

    await eventually(lambda: served_with(1), 20)
    await fail_over(cluster, eventually)
    # The new controller rewrites the topic's record when it grows.
    response = await cluster.call_controller(
        "CreatePartitions",
        cpb.CreatePartitionsRequest(topics=[cpb.CreatePartitionsTopic(name="orders", count=2)]),
    )
    assert response.topics[0].error_code == ErrorCode.NONE, response.topics[0].error_message
    assert await stored_id(cluster, "orders") == str(topic_id)
    await eventually(lambda: served_with(2), 20)


async def test_a_topic_stored_without_an_id_gets_one_and_keeps_it(
    cluster: Cluster, eventually: Eventually
) -> None:
    """A topic created by a version without topic ids: the controller that loads it gives it
    one and stores it, and the next controller loads that one."""
    legacy = TopicState("legacy", {}, {0: (1, 2, 3)}).to_json()
    del legacy["topic_id"]
    await cluster.crash_controllers_after(
        lambda epoch: cluster.store.put_topic(epoch, "legacy", legacy)
    )
    topic_id = await eventually(lambda: stored_id(cluster, "legacy"), 20)
    uuid.UUID(topic_id)
    await eventually(lambda: cluster.partitions("legacy"), 20)
    await eventually(lambda: cluster.produced("legacy", 0, b"x"), 20)
    await cluster.crash_controllers_after(lambda epoch: cluster.store.load_topics())
    # Active (it answers) once it has loaded the topics.
    await eventually(
        lambda: cluster.call_controller("DescribeCluster", cpb.DescribeClusterRequest()), 20
    )
    assert await stored_id(cluster, "legacy") == topic_id


async def test_a_long_lived_producer_writes_to_a_topic_created_again_under_its_name(
    make_cluster: MakeCluster, eventually: Eventually
) -> None:
    """The producer has seen the old topic's partition led by broker 2 at leader epoch 2; the
    new topic's is led by broker 1 at epoch 0. Before, the producer took every answer about
    the new topic for a lagging view of the old one and sent to broker 2 until the delivery
    timeout, for every record, until it was restarted."""
    cluster = await make_cluster(metadata=True)
    assert (await create(cluster, "orders", 1, 2, 3)).error_code == ErrorCode.NONE
    async with Producer(
        cluster.bootstrap, acks=-1, request_timeout_ms=5_000, delivery_timeout_ms=20_000
    ) as producer:
        assert await sent(producer, b"old-0") == 0
        # Leadership moves to broker 2, two leader epochs on: a reassignment to [2, 3] (one
        # epoch to start it, one to complete it, which moves leadership off broker 1).
        partition = cpb.ReassignablePartition(topic="orders", partition=0, replicas=[2, 3])
        await cluster.call_controller(
            "AlterPartitionReassignments",
            cpb.AlterPartitionReassignmentsRequest(partitions=[partition]),
        )

        async def reassigned() -> bool:
            state = (await cluster.partitions("orders"))[0]
            return (state["leader"], state["leader_epoch"]) == (2, 2)

        await eventually(reassigned, 20)
        assert await sent(producer, b"old-1") == 1
        leader = producer.metadata.leader(TP)
        assert leader is not None and leader[0] == 2 and leader[2] >= 1, leader

        await create_again(cluster, eventually)

        assert await sent(producer, b"new-0") == 0
    assert await cluster.read(1, "orders", 0) == {b"new-0": 0}


async def test_a_consumer_never_reads_a_topic_created_again_from_the_old_position(
    make_cluster: MakeCluster, eventually: Eventually
) -> None:
    """The new topic has the old one's leader at the same epoch (0), and a record at the
    consumer's position; the consumer's metadata still holds the old id (no refresh by age
    in the test's time). Its next fetch names the old id: UNKNOWN_TOPIC_ID, new metadata,
    the new id, its position reset by auto_offset_reset. Before, the fetch carried no id and
    the broker served the new topic from the old position, skipping its first records."""
    cluster = await make_cluster(metadata=True)
    assert (await create(cluster, "orders", 1, 2, 3)).error_code == ErrorCode.NONE
    async with (
        Producer(cluster.bootstrap, acks=-1) as producer,
        Consumer(
            cluster.bootstrap,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=0,  # no fetch left waiting once a poll has returned records
            metadata_max_age_ms=600_000,
        ) as consumer,
    ):
        for value in (b"old-0", b"old-1"):
            await sent(producer, value)
        consumer.assign([TP])
        assert await polled(consumer) == [b"old-0", b"old-1"]
        old_id = consumer.metadata.topics["orders"].topic_id

        await create_again(cluster, eventually)
        for value in (b"new-0", b"new-1", b"new-2"):
            await sent(producer, value)

        assert consumer.metadata.topics["orders"].topic_id == old_id
        values = await polled(consumer)
        assert values[0] == b"new-0", values  # before: b"new-2", read from the old position
        while len(values) < 3:
            values += await polled(consumer)
        assert values == [b"new-0", b"new-1", b"new-2"]
        assert consumer.metadata.topics["orders"].topic_id != old_id


async def create_again(cluster: Cluster, eventually: Eventually) -> None:
    """Delete "orders" and create it again on brokers 1, 2, 3: broker 1 leads at epoch 0."""
    response = await cluster.call_controller(
        "DeleteTopics", cpb.DeleteTopicsRequest(topic_names=["orders"])
    )
    assert response.topics[0].error_code == ErrorCode.NONE
    await eventually(lambda: _no_deletions(cluster), 20)
    assert (await create(cluster, "orders", 1, 2, 3)).error_code == ErrorCode.NONE
    assert (await cluster.partitions("orders"))[0]["leader_epoch"] == 0


async def polled(consumer: Consumer) -> list[bytes | None]:
    """The values of the next poll that returns records, within 30 s."""
    async with asyncio.timeout(30):
        while True:
            records = await consumer.poll(1000)
            if records:
                return [record.value for record in records]


async def sent(producer: Producer, value: bytes) -> int:
    """The offset of `value`, sent to partition 0 of "orders"."""
    return (await (await producer.send("orders", value, partition=0))).offset


async def _no_deletions(cluster: Cluster) -> bool:
    return not await cluster.store.load_deletions()
