"""Deleting a topic while one of its replicas' brokers is down, and reusing its name."""

from __future__ import annotations

from typing import Any

from tests.controller.cluster import Cluster, Eventually
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode


async def create(cluster: Cluster, name: str) -> cpb.CreatableTopicResult:
    """Create `name` with its partition on brokers 3, 1, 2 (3 leading)."""
    topic = cpb.CreatableTopic(name=name)
    topic.assignments.add(partition=0, broker_ids=[3, 1, 2])
    response = await cluster.call_controller(
        "CreateTopics", cpb.CreateTopicsRequest(topics=[topic])
    )
    return response.topics[0]


async def pending_deletions(cluster: Cluster, expected: dict[str, Any]) -> bool:
    return await cluster.store.load_deletions() == expected


async def test_a_deleted_topics_name_is_free_only_once_every_replica_deleted_its_log(
    cluster: Cluster, eventually: Eventually
) -> None:
    assert (await create(cluster, "reborn")).error_code == ErrorCode.NONE
    for i in range(3):
        await eventually(lambda i=i: cluster.produced("reborn", 0, f"old-{i}".encode()), 20)
    old_log = cluster.root / "broker-3" / "reborn-0"
    cluster.brokers[3].kill()
    response = await cluster.call_controller(
        "DeleteTopics", cpb.DeleteTopicsRequest(topic_names=["reborn"])
    )
    assert response.topics[0].error_code == ErrorCode.NONE, response.topics[0].error_message
    assert "reborn" not in await cluster.store.load_topics()
    # Brokers 1 and 2 delete their logs; broker 3 still holds its log, and a new "reborn" led
    # by it would serve the old records.
    pending = {"reborn": {"partitions": 1, "pending": [3]}}
    await eventually(lambda: pending_deletions(cluster, pending), 20)
    refused = await create(cluster, "reborn")
    assert refused.error_code == ErrorCode.TOPIC_DELETION_IN_PROGRESS, refused.error_message
    assert "[3]" in refused.error_message
    assert old_log.exists()

    await cluster.start_broker(3)
    await eventually(lambda: not old_log.exists(), 20)
    await eventually(lambda: pending_deletions(cluster, {}), 20)
    # Its StopReplica(delete) deleted the log: the FULL view before it names the deletion
    # waiting on broker 3, so the log was not taken for a stray one (renamed, deleted later).
    broker_log = cluster.brokers[3].log_file.read_text(errors="replace")
    assert "deleted log reborn-0" in broker_log
    assert "stray log reborn-0" not in broker_log

    async def created() -> bool:
        return (await create(cluster, "reborn")).error_code == ErrorCode.NONE

    await eventually(created, 20)
    await eventually(lambda: cluster.produced("reborn", 0, b"new"), 20)
    await eventually(lambda: cluster.replica_sees(3, "reborn", 0, 3, 0), 20)
    assert await cluster.read(3, "reborn", 0) == {b"new": 0}
