"""Admin operations of ControllerService on a real cluster: each error a client can see, and
what each operation does to etcd and the brokers."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from itertools import pairwise

from tests.controller.cluster import Cluster, Eventually
from tidewater.controller.model import TopicState
from tidewater.controller.service import PRODUCER_ID_BLOCK
from tidewater.v1 import common_pb2
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode


async def create(cluster: Cluster, **topic: object) -> cpb.CreatableTopicResult:
    response = await cluster.call_controller(
        "CreateTopics", cpb.CreateTopicsRequest(topics=[cpb.CreatableTopic(**topic)])
    )
    return response.topics[0]


async def test_create_topics_validation(cluster: Cluster) -> None:
    cases = [
        (
            {"name": "bad/name", "num_partitions": 1, "replication_factor": 1},
            ErrorCode.INVALID_TOPIC,
        ),
        (
            {"name": "big", "num_partitions": 1, "replication_factor": 4},
            ErrorCode.INVALID_REPLICATION_FACTOR,
        ),
        (
            {
                "name": "cfg",
                "num_partitions": 1,
                "replication_factor": 1,
                "configs": {"retention.ms": "soon"},
            },
            ErrorCode.INVALID_CONFIG,
        ),
        (
            {
                "name": "cfg2",
                "num_partitions": 1,
                "replication_factor": 1,
                "configs": {"no.such.config": "1"},
            },
            ErrorCode.INVALID_CONFIG,
        ),
    ]
    for topic, code in cases:
        result = await create(cluster, **topic)
        assert result.error_code == code, (topic, result.error_message)
        assert result.error_message
    assert (
        await create(cluster, name="once", num_partitions=2, replication_factor=2)
    ).error_code == (ErrorCode.NONE)
    again = await create(cluster, name="once", num_partitions=2, replication_factor=2)
    assert again.error_code == ErrorCode.TOPIC_ALREADY_EXISTS
    dry = await cluster.call_controller(
        "CreateTopics",
        cpb.CreateTopicsRequest(
            validate_only=True,
            topics=[cpb.CreatableTopic(name="dry", num_partitions=3, replication_factor=3)],
        ),
    )
    assert (dry.topics[0].error_code, dry.topics[0].num_partitions) == (ErrorCode.NONE, 3)
    assert "dry" not in await cluster.store.load_topics()


async def test_create_partitions(cluster: Cluster, eventually: Eventually) -> None:
    await cluster.create_topic("growing", 2, 2)
    response = await cluster.call_controller(
        "CreatePartitions",
        cpb.CreatePartitionsRequest(topics=[cpb.CreatePartitionsTopic(name="growing", count=5)]),
    )
    assert response.topics[0].error_code == ErrorCode.NONE, response.topics[0].error_message
    states = await cluster.partitions("growing")
    assert sorted(states) == [0, 1, 2, 3, 4]
    assert all(len(s["isr"]) == 2 for s in states.values())
    await eventually(lambda: cluster.produced("growing", 4, b"new partition"), 20)
    for count, code in ((3, ErrorCode.INVALID_PARTITIONS), (6, ErrorCode.NONE)):
        response = await cluster.call_controller(
            "CreatePartitions",
            cpb.CreatePartitionsRequest(
                topics=[cpb.CreatePartitionsTopic(name="growing", count=count)]
            ),
        )
        assert response.topics[0].error_code == code
    response = await cluster.call_controller(
        "CreatePartitions",
        cpb.CreatePartitionsRequest(topics=[cpb.CreatePartitionsTopic(name="missing", count=3)]),
    )
    assert response.topics[0].error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION


async def test_a_topic_cut_short_by_a_controller_failover_gets_its_partitions(
    cluster: Cluster, eventually: Eventually
) -> None:
    # The active controller dies between the two writes of CreateTopics: it stored the topic's
    # assignment, not its partitions' LeaderAndIsr.
    topic = TopicState("half-made", {}, {0: (1, 2), 1: (2, 3)})
    await cluster.crash_controllers_after(
        lambda epoch: cluster.store.put_topic(epoch, topic.name, topic.to_json())
    )

    async def stored() -> bool:
        return sorted(await cluster.partitions(topic.name)) == [0, 1]

    await eventually(stored, 30)
    for partition in (0, 1):
        await eventually(functools.partial(cluster.produced, topic.name, partition, b"x"), 20)
    await eventually(lambda: cluster.settled([topic.name]), 20)


async def test_delete_topics_removes_state_and_logs(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("doomed", 2, 3)
    await eventually(lambda: cluster.produced("doomed", 0, b"x"), 20)
    response = await cluster.call_controller(
        "DeleteTopics", cpb.DeleteTopicsRequest(topic_names=["doomed", "never-was"])
    )
    codes = {t.topic: t.error_code for t in response.topics}
    assert codes == {"doomed": ErrorCode.NONE, "never-was": ErrorCode.UNKNOWN_TOPIC_OR_PARTITION}
    assert "doomed" not in await cluster.store.load_topics()
    assert await cluster.partitions("doomed") == {}
    await eventually(
        lambda: (
            not any(
                (cluster.root / f"broker-{b}" / f"doomed-{p}").exists()
                for b in (1, 2, 3)
                for p in (0, 1)
            )
        ),
        20,
    )


async def test_elect_leaders_preferred_and_unclean(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("prefer", assignments=[[1, 2, 3]])
    response = await cluster.call_controller(
        "ElectLeaders",
        cpb.ElectLeadersRequest(
            election_type=cpb.ELECTION_TYPE_PREFERRED,
            partitions=[common_pb2.TopicPartition(topic="prefer", partition=0)],
        ),
    )
    assert response.partitions[0].error_code == ErrorCode.ELECTION_NOT_NEEDED
    # Move leadership off broker 1 with a controlled shutdown, then bring 1 back.
    await asyncio.to_thread(cluster.brokers[1].stop)
    await eventually(lambda: _leader_is_not(cluster, "prefer", 1), 20)
    await cluster.start_broker(1)
    await eventually(lambda: cluster.has_alive_brokers({1, 2, 3}), 20)
    await eventually(lambda: _in_isr(cluster, "prefer", 1), 20)
    response = await cluster.call_controller(
        "ElectLeaders", cpb.ElectLeadersRequest(election_type=cpb.ELECTION_TYPE_PREFERRED)
    )
    by_tp = {(p.topic, p.partition): p.error_code for p in response.partitions}
    assert by_tp[("prefer", 0)] == ErrorCode.NONE
    assert (await cluster.partitions("prefer"))[0]["leader"] == 1
    response = await cluster.call_controller(
        "ElectLeaders",
        cpb.ElectLeadersRequest(
            election_type=cpb.ELECTION_TYPE_UNCLEAN,
            partitions=[common_pb2.TopicPartition(topic="prefer", partition=0)],
        ),
    )
    assert response.partitions[0].error_code == ErrorCode.ELECTION_NOT_NEEDED


async def test_producer_id_blocks_never_repeat(cluster: Cluster) -> None:
    statuses = await cluster.call_controller("DescribeCluster", cpb.DescribeClusterRequest())
    broker = next(b for b in statuses.brokers if b.status == cpb.BROKER_STATUS_ALIVE)
    firsts = []
    for _ in range(3):
        response = await cluster.call_controller(
            "AllocateProducerIds",
            cpb.AllocateProducerIdsRequest(
                broker_id=broker.broker.broker_id, broker_epoch=broker.broker_epoch
            ),
        )
        assert response.error_code == ErrorCode.NONE
        assert response.producer_id_count == PRODUCER_ID_BLOCK
        firsts.append(response.first_producer_id)
    # Each block is the count it says: the store reserved exactly that many ids.
    assert [b - a for a, b in pairwise(firsts)] == [PRODUCER_ID_BLOCK] * 2
    stale = await cluster.call_controller(
        "AllocateProducerIds",
        cpb.AllocateProducerIdsRequest(
            broker_id=broker.broker.broker_id, broker_epoch=broker.broker_epoch - 1
        ),
    )
    assert stale.error_code == ErrorCode.STALE_BROKER_EPOCH


async def _leader_is_not(cluster: Cluster, topic: str, broker_id: int) -> bool:
    return (await cluster.partitions(topic))[0]["leader"] not in (broker_id, -1)


async def _in_isr(cluster: Cluster, topic: str, broker_id: int) -> bool:
    return broker_id in (await cluster.partitions(topic))[0]["isr"]


async def test_preferred_leaders_come_back_by_themselves(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    cluster = await make_cluster(leader_imbalance_check_interval_s=0.5)
    await cluster.create_topic("home", assignments=[[1, 2, 3]])
    await asyncio.to_thread(cluster.brokers[1].stop)  # controlled shutdown: 2 leads
    await eventually(lambda: _leader_is_not(cluster, "home", 1), 20)
    await cluster.start_broker(1)
    await eventually(lambda: _in_isr(cluster, "home", 1), 20)
    await eventually(lambda: _leader_is(cluster, "home", 1), 20)
    assert "preferred leader rebalance" in await cluster.active_controller_log()


async def _leader_is(cluster: Cluster, topic: str, broker_id: int) -> bool:
    return (await cluster.partitions(topic))[0]["leader"] == broker_id
