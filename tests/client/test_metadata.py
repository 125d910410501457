"""The SDK's metadata cache (ClusterMetadata), fed GetMetadata answers by hand: leader epochs
only move forward within one life of a topic, and a topic created again under a deleted one's
name (a new topic id, epochs from 0) replaces what was cached of the old one (KIP-516), and
that alone: a topic a metadata service does not know keeps its epochs."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from tidewater.client import metadata as metadata_module
from tidewater.client.errors import MetadataUnavailable
from tidewater.client.metadata import ClusterMetadata
from tidewater.local.wait import eventually
from tidewater.v1 import common_pb2, metadata_pb2
from tidewater.v1.errors_pb2 import ErrorCode

OLD_ID = uuid.uuid4().bytes
NEW_ID = uuid.uuid4().bytes
TP = ("orders", 0)


def answer(
    leader: int, leader_epoch: int, topic_id: bytes = OLD_ID, partition_epoch: int = 0
) -> metadata_pb2.GetMetadataResponse:
    """Brokers 1-3; "orders" with one partition led by `leader` (its state at etcd revision
    `partition_epoch`; 0: unknown, from a version without it)."""
    response = metadata_pb2.GetMetadataResponse()
    for b in (1, 2, 3):
        response.brokers.add(
            broker_id=b, endpoint=common_pb2.Endpoint(host="127.0.0.1", port=9000 + b)
        )
    topic = response.topics.add(topic="orders", topic_id=topic_id)
    topic.partitions.add(
        partition=0,
        leader=leader,
        leader_epoch=leader_epoch,
        replicas=[1, 2, 3],
        isr=[1, 2, 3],
        partition_epoch=partition_epoch,
    )
    return response


def no_such_topic() -> metadata_pb2.GetMetadataResponse:
    response = answer(1, 0)
    del response.topics[:]
    response.topics.add(
        topic="orders",
        error_code=ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        error_message="topic 'orders' does not exist in this cluster view",
    )
    return response


@pytest.fixture
async def metadata() -> AsyncIterator[ClusterMetadata]:
    cache = ClusterMetadata(["127.0.0.1:1"])
    yield cache
    await cache.close()


def leader(metadata: ClusterMetadata) -> tuple[int, int] | None:
    found = metadata.leader(TP)
    return None if found is None else (found[0], found[2])


async def test_a_topic_created_again_replaces_the_deleted_ones_leaders(
    metadata: ClusterMetadata,
) -> None:
    """Before, its leader epochs (from 0) were taken for a lagging view of the old topic's
    (4): the client kept the old leader until it restarted."""
    metadata._apply(answer(leader=1, leader_epoch=4))
    # A lagging metadata service's older view of the same topic is ignored, as before.
    metadata._apply(answer(leader=3, leader_epoch=3))
    metadata.update_leader(TP, 3, 3)
    assert leader(metadata) == (1, 4)
    metadata._apply(answer(leader=2, leader_epoch=0, topic_id=NEW_ID))
    assert leader(metadata) == (2, 0)
    assert metadata.topics["orders"].topic_id == NEW_ID
    # From then on, the new topic's epochs move forward as any topic's do.
    metadata.update_leader(TP, 3, 1)
    metadata._apply(answer(leader=2, leader_epoch=0, topic_id=NEW_ID))
    assert leader(metadata) == (3, 1)


async def test_a_lagging_service_does_not_take_the_cache_back_to_the_deleted_topic(
    metadata: ClusterMetadata,
) -> None:
    """Review 18 M2: after the topic was created again, a metadata service that had not
    applied that yet answered with the deleted topic's id, and the cache went back to it and
    its leaders (the consumer reset its positions twice, skipping or re-reading records). A
    topic id is never used again: an answer naming a retired one is a lagging view."""
    metadata._apply(answer(leader=1, leader_epoch=7))
    metadata._apply(answer(leader=2, leader_epoch=0, topic_id=NEW_ID))
    metadata._apply(answer(leader=1, leader_epoch=7))
    assert metadata.topics["orders"].topic_id == NEW_ID
    assert leader(metadata) == (2, 0)


async def test_a_lagging_answer_seen_after_the_new_topics_does_not_retire_the_new_id(
    metadata: ClusterMetadata,
) -> None:
    """Review 29 #1: a client whose first answer named the new topic (id B) took a lagging
    service's later answer naming the deleted one (A) for the newer, retired B, and skipped
    every answer naming it from then on: its requests named A, brokers answered
    UNKNOWN_TOPIC_ID, for good. The partition epochs (etcd revisions, which only grow) tell
    which life of the topic an answer is of."""
    metadata._apply(answer(leader=2, leader_epoch=0, topic_id=NEW_ID, partition_epoch=40))
    metadata._apply(answer(leader=1, leader_epoch=7, topic_id=OLD_ID, partition_epoch=30))
    assert metadata.topics["orders"].topic_id == NEW_ID
    assert leader(metadata) == (2, 0)
    metadata._apply(answer(leader=3, leader_epoch=1, topic_id=NEW_ID, partition_epoch=41))
    assert leader(metadata) == (3, 1)
    # The old id is the retired one: named again, it is skipped.
    metadata._apply(answer(leader=1, leader_epoch=8, topic_id=OLD_ID, partition_epoch=50))
    assert metadata.topics["orders"].topic_id == NEW_ID


async def test_a_topic_that_no_longer_exists_leaves_no_leader_behind(
    metadata: ClusterMetadata,
) -> None:
    """Before, the deleted topic's partitions stayed cached with their leader epochs: once
    created again, the new topic's leaders (epoch 0) were ignored, and a broker's
    NOT_LEADER_OR_FOLLOWER naming one too."""
    metadata._apply(answer(leader=1, leader_epoch=4))
    metadata._apply(no_such_topic())
    assert metadata.leader(TP) is None
    assert metadata.topics["orders"].error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    metadata._apply(answer(leader=2, leader_epoch=0, topic_id=NEW_ID))
    assert leader(metadata) == (2, 0)


async def test_a_metadata_service_that_does_not_know_the_topic_yet_leaves_its_epochs(
    metadata: ClusterMetadata,
) -> None:
    """Its "unknown" answer takes the leader, not the epoch: before, the epochs were dropped
    with it, and another lagging service's older leader was taken (as Kafka, the cache starts
    a topic again on a topic id change only)."""
    metadata._apply(answer(leader=1, leader_epoch=4))
    metadata._apply(no_such_topic())
    assert metadata.leader(TP) is None
    metadata._apply(answer(leader=3, leader_epoch=3))
    assert metadata.leader(TP) is None
    metadata._apply(answer(leader=1, leader_epoch=4))
    assert leader(metadata) == (1, 4)


async def test_a_refused_connection_is_not_reported_as_the_deadline_running_out() -> None:
    """A closed port fails at once: the error says what happened, not "within 10s"."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    metadata = ClusterMetadata([address], request_timeout_s=10)
    try:
        with pytest.raises(MetadataUnavailable) as raised:
            await metadata.refresh(["orders"])
    finally:
        await metadata.close()
    assert str(raised.value) == f"no metadata service answered: {address}: UNAVAILABLE"


class HeldService:
    """A metadata service whose answers wait for `release`; `asked` holds each request's
    topics. It knows every topic asked for (one partition, led by broker 1)."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []
        self.release = asyncio.Event()

    def __call__(self, channel: object) -> HeldService:
        return self

    async def GetMetadata(
        self, request: metadata_pb2.GetMetadataRequest, timeout: float
    ) -> metadata_pb2.GetMetadataResponse:
        self.asked.append(list(request.topics))
        await self.release.wait()
        response = metadata_pb2.GetMetadataResponse()
        response.brokers.add(broker_id=1, endpoint=common_pb2.Endpoint(host="b", port=1))
        for name in request.topics:
            topic = response.topics.add(topic=name, topic_id=name.encode().ljust(16, b"_"))
            topic.partitions.add(partition=0, leader=1, leader_epoch=0, replicas=[1], isr=[1])
        return response


async def test_a_refresh_for_a_new_topic_does_not_settle_for_a_fetch_that_did_not_ask_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 29 #5: a refresh of topic b while one asked for a only was under way waited for
    that one and returned without b (the consumer's seek then raised LEADER_NOT_AVAILABLE,
    the producer lost a retry backoff)."""
    service = HeldService()
    monkeypatch.setattr(metadata_module.metadata_pb2_grpc, "MetadataServiceStub", service)
    cache = ClusterMetadata(["127.0.0.1:1"])
    try:
        first = asyncio.ensure_future(cache.refresh(["a"]))
        await eventually(lambda: service.asked == [["a"]], 10)
        second = asyncio.ensure_future(cache.refresh(["b"]))
        service.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert service.asked == [["a"], ["a", "b"]]
        assert cache.leader(("b", 0)) is not None
    finally:
        await cache.close()


class ByAddress:
    """Metadata services by address: `lagging:1` has not heard of topic t yet, `fresh:1`
    has. `asked` holds the address of each request."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def channel(self, address: str, options: object) -> Any:
        return SimpleNamespace(address=address, close=self._close)

    async def _close(self) -> None:
        pass

    def __call__(self, channel: Any) -> Any:
        service = self

        class Stub:
            async def GetMetadata(
                self, request: metadata_pb2.GetMetadataRequest, timeout: float
            ) -> metadata_pb2.GetMetadataResponse:
                service.asked.append(channel.address)
                response = metadata_pb2.GetMetadataResponse()
                response.brokers.add(broker_id=1, endpoint=common_pb2.Endpoint(host="b", port=1))
                topic = response.topics.add(topic="t")
                if channel.address == "lagging:1":
                    topic.error_code = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
                else:
                    topic.topic_id = b"t" * 16
                    topic.partitions.add(partition=0, leader=1, replicas=[1], isr=[1])
                return response

        return Stub()


async def test_a_refresh_that_leaves_its_topic_unknown_asks_another_service_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 29 #4: only a broker's "stale" hint moved the client to another metadata
    service; a producer waiting for a topic just created asked the lagging one for all of
    max_block_ms, though the other knew it."""
    services = ByAddress()
    monkeypatch.setattr(metadata_module.metadata_pb2_grpc, "MetadataServiceStub", services)
    monkeypatch.setattr(metadata_module.tracing, "insecure_channel", services.channel)
    cache = ClusterMetadata(["lagging:1", "fresh:1"])
    try:
        await cache.refresh(["t"])
        assert cache.leader(("t", 0)) is None
        await cache.refresh(["t"])
        assert cache.leader(("t", 0)) is not None
        assert services.asked == ["lagging:1", "fresh:1"]
    finally:
        await cache.close()
