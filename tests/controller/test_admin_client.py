"""The SDK's Admin client against a real cluster (controllers, brokers, metadata service)."""

from __future__ import annotations

import pytest

from tests.controller.cluster import Cluster, Eventually
from tidewater.client.admin import Admin
from tidewater.errors import TidewaterError
from tidewater.v1.errors_pb2 import ErrorCode


async def test_admin_creates_grows_describes_and_deletes(
    cluster: Cluster, eventually: Eventually
) -> None:
    controllers = [p.address for p in cluster.controllers.values()]
    async with Admin(controllers) as admin:
        await admin.create_topic(
            "admin-made", partitions=2, replication_factor=3, configs={"min.insync.replicas": "2"}
        )
        with pytest.raises(TidewaterError) as info:
            await admin.create_topic("admin-made", partitions=1, replication_factor=1)
        assert info.value.code == ErrorCode.TOPIC_ALREADY_EXISTS
        with pytest.raises(TidewaterError) as info:
            await admin.create_topic("too-big", partitions=1, replication_factor=9)
        assert info.value.code == ErrorCode.INVALID_REPLICATION_FACTOR
        # No replication factor: the controllers' default (3 brokers registered: 3).
        await admin.create_topic("defaulted")
        assert [len(p["isr"]) for p in (await cluster.partitions("defaulted")).values()] == [3]
        await admin.create_partitions("admin-made", 4)
        assert sorted(await cluster.partitions("admin-made")) == [0, 1, 2, 3]
        described = await admin.describe_cluster()
        assert {b.broker.broker_id for b in described.brokers} == {1, 2, 3}
        assert (await admin.elect_leaders(partitions=[("admin-made", 0)])) == {
            ("admin-made", 0): ErrorCode.ELECTION_NOT_NEEDED
        }
        await admin.delete_topics(["admin-made"])
        assert await cluster.partitions("admin-made") == {}
        with pytest.raises(TidewaterError) as info:
            await admin.delete_topics(["admin-made"])
        assert info.value.code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
