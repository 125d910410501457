"""A broker applies a topic's changed configs to the partitions it already hosts, from their
next use on (Kafka's rule): sent by the controller in UpdateMetadata (IncrementalAlterConfigs)
or with a LeaderAndIsr of a newer leader epoch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tidewater.broker.partition import HostedPartition
from tidewater.broker.topic_config import TopicConfig
from tidewater.local.standin_controller import make_leader
from tidewater.records.batch import Record, build_batch
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import cluster_pb2, common_pb2
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "events"


async def produce(client: Any, size: int, topic: str = TOPIC) -> pb.PartitionProduceResponse:
    request = pb.ProduceRequest(
        acks=1,
        partitions=[
            pb.PartitionProduceData(
                topic=topic, partition=0, record_batch=build_batch([Record(value=bytes(size))])
            )
        ],
    )
    return (await client.service.Produce(request)).partitions[0]


async def update_configs(
    client: Any, configs: dict[str, dict[str, str]], full: bool = False
) -> None:
    request = cluster_pb2.UpdateMetadataRequest(
        controller_epoch=1,
        type=cluster_pb2.UPDATE_METADATA_TYPE_FULL
        if full
        else cluster_pb2.UPDATE_METADATA_TYPE_DELTA,
        topic_configs=[common_pb2.TopicConfig(topic=t, configs=c) for t, c in configs.items()],
    )
    if full:
        request.partition_states.add(topic=TOPIC, partition=0, replicas=[1])
    assert (await client.control.UpdateMetadata(request)).error_code == ErrorCode.NONE


def segments(log_dir: Path) -> int:
    return len(list((log_dir / f"{TOPIC}-0").glob("*.log")))


async def leader_with_a_segment(start_broker: Callable[..., Any]) -> Any:
    """Broker 1 leads the partition with the default configs, 6 KB in its one segment."""
    _, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    for _ in range(3):
        assert (await produce(client, 2000)).error_code == ErrorCode.NONE
    return client


async def test_an_update_metadata_changes_a_hosted_topics_configs(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    client = await leader_with_a_segment(start_broker)
    log_dir = tmp_path / "broker-1"
    assert segments(log_dir) == 1

    # Other topics' configs are not this partition's.
    await update_configs(client, {"other": {"max.message.bytes": "100"}})
    assert (await produce(client, 2000)).error_code == ErrorCode.NONE

    await update_configs(client, {TOPIC: {"max.message.bytes": "1000", "segment.bytes": "3000"}})
    too_large = await produce(client, 2000)
    assert too_large.error_code == ErrorCode.MESSAGE_TOO_LARGE, too_large.error_message
    assert "1000" in too_large.error_message
    # segment.bytes from the next roll check: the active segment is already past it.
    assert (await produce(client, 500)).error_code == ErrorCode.NONE
    assert segments(log_dir) == 2

    # A FULL view replaces the configs whole: none set, the defaults again.
    await update_configs(client, {TOPIC: {}}, full=True)
    assert (await produce(client, 2000)).error_code == ErrorCode.NONE


async def test_a_newer_leader_and_isr_changes_a_hosted_partitions_log_configs(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    client = await leader_with_a_segment(start_broker)
    await make_leader(
        client.channel,
        TOPIC,
        0,
        leader=1,
        leader_epoch=2,
        replicas=[1],
        configs={"segment.bytes": "3000"},
    )
    assert (await produce(client, 500)).error_code == ErrorCode.NONE
    assert segments(tmp_path / "broker-1") == 2


async def test_a_full_view_parses_and_applies_only_the_configs_that_changed(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, client = await start_broker(1)
    hosted = [("a", 0), ("a", 1), ("b", 0)]
    for topic, partition in hosted:
        await make_leader(
            client.channel,
            topic,
            partition,
            leader=1,
            leader_epoch=1,
            replicas=[1],
            configs={"retention.ms": "1000"},
        )
    manager = server.replica_manager
    parsed: list[dict[str, str]] = []
    reconfigured: list[tuple[str, int]] = []
    parse = manager._topic_config
    reconfigure = HostedPartition.reconfigure

    def counted_parse(props: dict[str, str]) -> TopicConfig:
        parsed.append(props)
        return parse(props)

    def counted_reconfigure(partition: HostedPartition, *args: Any) -> None:
        reconfigured.append(partition.key)
        reconfigure(partition, *args)

    monkeypatch.setattr(manager, "_topic_config", counted_parse)
    monkeypatch.setattr(HostedPartition, "reconfigure", counted_reconfigure)

    async def full_view(b_retention: str) -> tuple[int, list[tuple[str, int]]]:
        """A FULL UpdateMetadata (also naming a topic not hosted here): how many topics' configs
        it parsed, and which partitions it reconfigured."""
        parsed.clear()
        reconfigured.clear()
        configs = {"a": "1000", "b": b_retention, "elsewhere": "5"}
        request = cluster_pb2.UpdateMetadataRequest(
            controller_epoch=1,
            type=cluster_pb2.UPDATE_METADATA_TYPE_FULL,
            topic_configs=[
                common_pb2.TopicConfig(topic=t, configs={"retention.ms": v})
                for t, v in configs.items()
            ],
        )
        for topic, partition in [*hosted, ("elsewhere", 0)]:
            request.partition_states.add(topic=topic, partition=partition, replicas=[1])
        assert (await client.control.UpdateMetadata(request)).error_code == ErrorCode.NONE
        return len(parsed), reconfigured[:]

    # The first view after the LeaderAndIsrs: each hosted topic is parsed once, nothing changes.
    assert await full_view("1000") == (2, [])
    # The same view again (every unfence, every controller failover): nothing is parsed (before:
    # every topic, with a pass over every hosted partition each).
    assert await full_view("1000") == (0, [])
    # b's configs changed: b alone is parsed, and only its partition takes them.
    assert await full_view("2000") == (1, [("b", 0)])
    assert manager.partitions["b", 0].config.log.retention_ms == 2000
    assert manager.partitions["a", 0].config.log.retention_ms == 1000
    # A LeaderAndIsr with other configs than those last applied: the next view parses b again.
    await make_leader(client.channel, "b", 0, leader=1, leader_epoch=2, replicas=[1])
    assert await full_view("2000") == (1, [("b", 0)])
