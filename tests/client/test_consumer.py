"""The consumer's fetches against real in-process brokers: one in flight per leader, outliving
the poll that sent it, as in Kafka's consumer."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import pytest

from tests.client.cluster import Cluster
from tidewater.client.consumer import Consumer
from tidewater.client.errors import ConsumerClosed, NoOffsetForPartition
from tidewater.client.metadata import PartitionInfo, TopicInfo
from tidewater.client.positions import FetchPosition
from tidewater.client.producer import Producer
from tidewater.errors import CorruptMessage, OffsetOutOfRange, TidewaterError
from tidewater.local.tcp_proxy import LinkMode, TcpProxy
from tidewater.local.wait import eventually
from tidewater.metadata.server import MetadataServer
from tidewater.records.batch import Record, build_batch
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

# Longer than any test here may take: a poll that waited for an idle leader's long poll
# would run into the test's deadline.
LONG_POLL_MS = 120_000
DEADLINE_S = 30


async def poll_until(consumer: Consumer, count: int) -> list[tuple[int, bytes | None]]:
    """(partition, value) of the records polled until `count` came, within DEADLINE_S."""
    got: list[tuple[int, bytes | None]] = []
    async with asyncio.timeout(DEADLINE_S):
        while len(got) < count:
            fetched = await consumer.poll_partitions(LONG_POLL_MS)
            got += [(tp[1], r.value) for tp, records in fetched.items() for r in records]
    return got


async def test_a_poll_returns_the_records_of_one_leader_without_waiting_for_the_others(
    cluster: Cluster,
) -> None:
    # Partition p is led by broker p + 1: three leaders, each long-polled.
    await cluster.create_topic("spread", partitions=3)
    tps = [("spread", p) for p in range(3)]
    async with (
        Producer(cluster.bootstrap) as producer,
        Consumer(cluster.bootstrap, fetch_max_wait_ms=LONG_POLL_MS) as consumer,
    ):
        consumer.assign(tps)
        for tp in tps:
            await consumer.seek_to_end(tp)
        await producer.send_and_wait("spread", b"a", partition=1)
        assert await poll_until(consumer, 1) == [(1, b"a")]
        # The fetches to the other two leaders are still waiting; each answer counts once.
        await producer.send_and_wait("spread", b"b", partition=2)
        assert await poll_until(consumer, 1) == [(2, b"b")]
        await producer.send_and_wait("spread", b"c", partition=1)
        await producer.send_and_wait("spread", b"d", partition=0)
        assert sorted(await poll_until(consumer, 2)) == [(0, b"d"), (1, b"c")]
        assert [consumer.position(tp) for tp in tps] == [1, 2, 1]


async def test_the_first_poll_after_assign_waits_for_the_records(cluster: Cluster) -> None:
    """No leader is known right after assign(): the poll waits for the metadata and the
    reset, up to its timeout, instead of returning nothing after the retry backoff."""
    await cluster.create_topic("first")
    async with Producer(cluster.bootstrap) as producer:
        await producer.send_and_wait("first", b"x", partition=0)
    async with Consumer(cluster.bootstrap, auto_offset_reset="earliest") as consumer:
        consumer.assign([("first", 0)])
        async with asyncio.timeout(DEADLINE_S):
            records = await consumer.poll(LONG_POLL_MS)
    assert [(r.offset, r.value) for r in records] == [(0, b"x")]


async def test_a_poll_of_an_empty_topic_returns_nothing_at_its_timeout(cluster: Cluster) -> None:
    await cluster.create_topic("empty")
    async with Consumer(cluster.bootstrap, fetch_max_wait_ms=LONG_POLL_MS) as consumer:
        consumer.assign([("empty", 0)])
        async with asyncio.timeout(DEADLINE_S):
            assert await consumer.poll(500) == []
            assert await consumer.poll(500) == []
        assert consumer.position(("empty", 0)) == 0


async def test_a_seek_while_a_fetch_is_in_flight_wins_over_its_answer(cluster: Cluster) -> None:
    await cluster.create_topic("seek")
    tp = ("seek", 0)
    async with (
        Producer(cluster.bootstrap) as producer,
        Consumer(cluster.bootstrap, fetch_max_wait_ms=LONG_POLL_MS) as consumer,
    ):
        for value in (b"x", b"y"):
            await producer.send_and_wait("seek", value, partition=0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        # Sends a fetch from offset 2, which waits for records.
        assert await consumer.poll(0) == []
        consumer.seek(tp, 0)
        await producer.send_and_wait("seek", b"z", partition=0)
        # The fetch from 2 answers [z]; the consumer was sought to 0 meanwhile and reads on
        # from there: nothing skipped, nothing twice.
        got = await poll_until(consumer, 3)
        assert [value for _, value in got] == [b"x", b"y", b"z"]
        assert consumer.position(tp) == 3


async def test_a_partition_error_comes_after_the_records_of_the_same_answer() -> None:
    consumer = Consumer(["127.0.0.1:1"])
    good, bad = ("t", 0), ("t", 1)
    consumer.assign([good, bad])
    consumer.seek(good, 0)
    consumer.seek(bad, 0)
    answer = pb.FetchResponse(
        partitions=[
            pb.FetchPartitionResponse(
                topic="t",
                partition=0,
                high_watermark=1,
                record_batches=build_batch([Record(value=b"v")]),
            ),
            pb.FetchPartitionResponse(
                topic="t", partition=1, error_code=ErrorCode.CORRUPT_MESSAGE, error_message="crc"
            ),
        ]
    )
    try:
        consumer._apply({good: FetchPosition(0), bad: FetchPosition(0)}, answer)
        fetched = consumer._hand_out()
        assert [r.value for r in fetched[good]] == [b"v"]
        assert (consumer.position(good), consumer.position(bad)) == (1, 0)
        with pytest.raises(CorruptMessage, match="t-1: crc"):
            await consumer.poll(0)
    finally:
        await consumer.close()


async def test_a_poll_returns_at_most_max_poll_records_and_the_next_polls_the_rest(
    cluster: Cluster,
) -> None:
    """Kafka's max.poll.records: the records one fetch brought beyond it are returned by the
    next polls, in order, and the position moves only past those returned (before, a poll
    returned all its fetches brought, and the position was past records not yet seen)."""
    await cluster.create_topic("capped")
    async with Producer(cluster.bootstrap, linger_ms=50) as producer:
        for i in range(10):
            await producer.send("capped", b"%d" % i, partition=0)
        await producer.flush()
    async with Consumer(
        cluster.bootstrap, auto_offset_reset="earliest", max_poll_records=3
    ) as consumer:
        tp = ("capped", 0)
        consumer.assign([tp])
        polls: list[list[bytes | None]] = []
        positions = []
        async with asyncio.timeout(DEADLINE_S):
            while sum(map(len, polls)) < 10:
                records = await consumer.poll(LONG_POLL_MS)
                assert 0 < len(records) <= 3
                polls.append([r.value for r in records])
                positions.append(consumer.position(tp))
        assert [v for values in polls for v in values] == [b"%d" % i for i in range(10)]
        assert positions == list(itertools.accumulate(map(len, polls)))


async def test_records_buffered_for_a_later_poll_are_dropped_by_a_seek() -> None:
    consumer = Consumer(["127.0.0.1:1"], max_poll_records=2)
    tp = ("t", 0)
    consumer.assign([tp])
    consumer.seek(tp, 0)
    values = [b"a", b"b", b"c", b"d", b"e"]
    answer = pb.FetchResponse(
        partitions=[
            pb.FetchPartitionResponse(
                topic="t",
                partition=0,
                high_watermark=5,
                record_batches=build_batch([Record(value=v) for v in values]),
            )
        ]
    )
    try:
        consumer._apply({tp: FetchPosition(0)}, answer)
        assert [r.value for r in consumer._hand_out()[tp]] == [b"a", b"b"]
        assert consumer.position(tp) == 2
        assert [r.value for r in consumer._hand_out()[tp]] == [b"c", b"d"]
        consumer.seek(tp, 1)
        assert consumer._hand_out() == {}
        assert consumer.position(tp) == 1
    finally:
        await consumer.close()


async def test_a_closed_consumer_refuses_to_fetch() -> None:
    """Review 18 L3: poll() after close() opened channels and refresh tasks that nothing
    closed."""
    consumer = Consumer(["127.0.0.1:1"])
    consumer.assign([("t", 0)])
    await consumer.close()
    with pytest.raises(ConsumerClosed):
        await consumer.poll(0)
    with pytest.raises(ConsumerClosed):
        await consumer.seek_to_end()
    assert consumer.metadata._channels == {}


def corrupt(batch: bytearray) -> bytes:
    """`batch` with a flipped byte in its records: it fails its CRC."""
    batch[-1] ^= 0x01
    return bytes(batch)


async def test_a_batch_that_cannot_be_decoded_costs_no_other_records() -> None:
    """As in Kafka's consumer: the partition stops before the bad batch and the next poll
    raises, for that partition alone; records decoded before it, of the same partition or of
    another one in the same answer, are handed over, never skipped."""
    consumer = Consumer(["127.0.0.1:1"])
    first, second = ("t", 0), ("t", 1)
    consumer.assign([first, second])
    consumer.seek(first, 0)
    consumer.seek(second, 0)
    good = build_batch([Record(value=b"a"), Record(value=b"b")])
    bad = bytearray(build_batch([Record(value=b"c")]))
    bad[0:8] = (2).to_bytes(8, "big")  # base offset 2, after the good batch
    answer = pb.FetchResponse(
        partitions=[
            pb.FetchPartitionResponse(
                topic="t", partition=1, high_watermark=3, record_batches=good + corrupt(bad)
            ),
            pb.FetchPartitionResponse(
                topic="t",
                partition=0,
                high_watermark=2,
                record_batches=build_batch([Record(value=b"x"), Record(value=b"y")]),
            ),
        ]
    )
    try:
        consumer._apply({first: FetchPosition(0), second: FetchPosition(0)}, answer)
        fetched = consumer._hand_out()
        assert [r.value for r in fetched[second]] == [b"a", b"b"]
        assert [r.value for r in fetched[first]] == [b"x", b"y"]
        assert (consumer.position(first), consumer.position(second)) == (2, 2)
        with pytest.raises(CorruptMessage, match=r"t-1 at offset 2: .*CRC32C"):
            await consumer.poll(0)
    finally:
        await consumer.close()


async def test_the_position_takes_the_leader_epoch_of_the_last_records_batch() -> None:
    """KIP-320: the epoch a position is validated with after a leader change."""
    consumer = Consumer(["127.0.0.1:1"])
    tp = ("t", 0)
    consumer.assign([tp])
    consumer.seek(tp, 1)
    batches = build_batch([Record(value=b"a"), Record(value=b"b")], partition_leader_epoch=3)
    later = build_batch([Record(value=b"c")], base_offset=2, partition_leader_epoch=4)
    answer = pb.FetchResponse(
        partitions=[
            pb.FetchPartitionResponse(
                topic="t", partition=0, high_watermark=3, record_batches=batches + later
            )
        ]
    )
    try:
        consumer._apply({tp: FetchPosition(1)}, answer)
        fetched = consumer._hand_out()
        assert [r.value for r in fetched[tp]] == [b"b", b"c"]
        assert consumer._positions[tp] == FetchPosition(3, 4)
    finally:
        await consumer.close()


async def test_an_out_of_range_position_is_reset_with_a_warning(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    await cluster.create_topic("range")
    tp = ("range", 0)
    caplog.set_level(logging.WARNING, logger="tidewater.client.consumer")
    async with (
        Producer(cluster.bootstrap) as producer,
        Consumer(cluster.bootstrap, auto_offset_reset="earliest") as consumer,
    ):
        for value in (b"x", b"y"):
            await producer.send_and_wait("range", value, partition=0)
        consumer.assign([tp])
        consumer.seek(tp, 7)
        assert [value for _, value in await poll_until(consumer, 2)] == [b"x", b"y"]
    assert "range-0: fetch position 7 out of range, reset (earliest) to offset 0" in caplog.text


async def test_an_out_of_range_position_without_reset_policy_is_raised_by_every_poll(
    cluster: Cluster,
) -> None:
    await cluster.create_topic("norange")
    tp = ("norange", 0)
    async with (
        Producer(cluster.bootstrap) as producer,
        Consumer(cluster.bootstrap, auto_offset_reset="none") as consumer,
    ):
        await producer.send_and_wait("norange", b"x", partition=0)
        consumer.assign([tp])
        with pytest.raises(NoOffsetForPartition, match="norange-0"):
            await consumer.poll(0)
        consumer.seek(tp, 7)
        async with asyncio.timeout(DEADLINE_S):
            for _ in range(2):
                with pytest.raises(OffsetOutOfRange, match="norange-0: fetch position 7"):
                    while True:
                        await consumer.poll(LONG_POLL_MS)
        assert consumer.position(tp) == 7
        consumer.seek(tp, 0)
        assert await poll_until(consumer, 1) == [(0, b"x")]


class _SlowValidationLeader:
    """A leader's stub: Fetch hands over the records at offsets 0 and 1 of partition 0, one
    per fetch, and then long-polls; OffsetForLeaderEpoch answers once `answer_validation` is
    set."""

    def __init__(self) -> None:
        self.answer_validation = asyncio.Event()

    async def Fetch(self, request: pb.FetchRequest, **_: Any) -> pb.FetchResponse:
        offset = {p.partition: p.fetch_offset for p in request.partitions}.get(0, 2)
        if offset >= 2:
            await asyncio.Event().wait()
        batch = build_batch(
            [Record(value=b"v%d" % offset)], base_offset=offset, partition_leader_epoch=3
        )
        return pb.FetchResponse(
            partitions=[
                pb.FetchPartitionResponse(
                    topic="t", partition=0, high_watermark=2, record_batches=batch
                )
            ]
        )

    async def OffsetForLeaderEpoch(
        self, request: pb.OffsetForLeaderEpochRequest, **_: Any
    ) -> pb.OffsetForLeaderEpochResponse:
        await self.answer_validation.wait()
        # Epoch 2 ends at offset 3 in the new leader's log: truncated under position 5.
        return pb.OffsetForLeaderEpochResponse(
            partitions=[
                pb.OffsetForLeaderEpochPartitionResponse(
                    topic="t", partition=1, leader_epoch=2, end_offset=3
                )
            ]
        )


async def test_a_validation_the_leader_does_not_answer_holds_up_its_partition_alone() -> None:
    """KIP-320, asynchronous as Kafka's validatePositionsIfNeeded: poll() hands over the
    records of the other partitions while an OffsetForLeaderEpoch waits (here for longer than
    the test may take), and a later poll applies its answer."""
    consumer = Consumer(["127.0.0.1:1"], request_timeout_ms=LONG_POLL_MS)
    leader = _SlowValidationLeader()
    fetched, moved = ("t", 0), ("t", 1)
    _assign(consumer, leader, 3, [fetched, moved])
    consumer._positions[fetched] = FetchPosition(0, 3, (1, 3))
    # Read from leader 1 in epoch 2; leader 1 is now in epoch 3: due for validation.
    consumer._positions[moved] = FetchPosition(5, 2, (1, 2))
    try:
        # The first poll finds the leader moved under `moved`, the next ones validate it.
        assert await poll_until(consumer, 1) == [(0, b"v0")]
        assert await poll_until(consumer, 1) == [(0, b"v1")]
        assert consumer.position(moved) == 5
        leader.answer_validation.set()
        async with asyncio.timeout(DEADLINE_S):
            while consumer.position(moved) != 3:
                await consumer.poll(10)
        assert consumer._positions[moved] == FetchPosition(3, 2, (1, 3))
    finally:
        await consumer.close()


class _NewTopicLeader:
    """A leader's stub: Fetch long-polls; ListOffsets finds the start of an empty log."""

    async def Fetch(self, request: pb.FetchRequest, **_: Any) -> pb.FetchResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def ListOffsets(self, request: pb.ListOffsetsRequest, **_: Any) -> pb.ListOffsetsResponse:
        return pb.ListOffsetsResponse(
            partitions=[
                pb.ListOffsetsPartitionResponse(topic="t", partition=0, offset=0, leader_epoch=0)
            ]
        )


@pytest.mark.parametrize("reset", ["earliest", "none"])
async def test_a_topic_created_again_under_its_name_resets_the_position(
    reset: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A new topic id: the position (offset 5 of the deleted topic) is reset by
    auto_offset_reset, as Kafka's consumer does; before, the consumer read the new topic on
    from offset 5 when its leader was the same at epoch 0, skipping its first records."""
    caplog.set_level(logging.WARNING, logger="tidewater.client.consumer")
    consumer = Consumer(["127.0.0.1:1"], auto_offset_reset=reset)
    consumer._stub = lambda address: _NewTopicLeader()  # type: ignore[assignment,method-assign,return-value]
    tp = ("t", 0)
    consumer.assign([tp])
    consumer.metadata.brokers = {1: "127.0.0.1:2"}
    consumer.metadata.partitions[tp] = PartitionInfo(1, 0, (1,), (1,), ErrorCode.NONE)
    consumer.metadata.topics["t"] = TopicInfo(ErrorCode.NONE, "", 1, b"old-id")
    consumer._positions[tp] = FetchPosition(5, 0, (1, 0))
    try:
        assert await consumer.poll(0) == []  # a fetch from 5 of the topic the id names
        consumer.metadata.topics["t"] = TopicInfo(ErrorCode.NONE, "", 1, b"new-id")
        async with asyncio.timeout(DEADLINE_S):
            if reset == "none":
                with pytest.raises(NoOffsetForPartition, match="t-0"):
                    while True:
                        await consumer.poll(10)
                assert consumer.position(tp) is None
            else:
                while consumer.position(tp) != 0:
                    await consumer.poll(10)
    finally:
        await consumer.close()
    assert "t-0: the topic was deleted and created again (new topic id): fetch position 5" in (
        caplog.text
    )


class _RebornDuringReset:
    """A leader's stub: the first ListOffsets is answered (offset 4, the old topic's end)
    once `release` is set; later ones find the new topic's offset 0."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.topic_ids: list[bytes] = []

    async def Fetch(self, request: pb.FetchRequest, **_: Any) -> pb.FetchResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def ListOffsets(self, request: pb.ListOffsetsRequest, **_: Any) -> pb.ListOffsetsResponse:
        self.topic_ids.append(request.partitions[0].topic_id)
        offset = 4 if len(self.topic_ids) == 1 else 0
        await self.release.wait()
        result = pb.ListOffsetsPartitionResponse(
            topic="t", partition=0, offset=offset, leader_epoch=0
        )
        return pb.ListOffsetsResponse(partitions=[result])


def _assign(
    consumer: Consumer, leader: object, leader_epoch: int, partitions: list[tuple[str, int]]
) -> None:
    """`partitions` assigned to `consumer`, led by broker 1 in `leader_epoch` (`leader`: its
    stub); metadata refreshes do nothing (the test sets the metadata)."""
    consumer._stub = lambda address: leader  # type: ignore[assignment,method-assign,return-value]
    consumer.metadata.request_refresh = lambda: None  # type: ignore[method-assign]
    consumer.assign(partitions)
    consumer.metadata.brokers = {1: "127.0.0.1:2"}
    for tp in partitions:
        consumer.metadata.partitions[tp] = PartitionInfo(
            1, leader_epoch, (1,), (1,), ErrorCode.NONE
        )


def _assign_one(consumer: Consumer, leader: object, leader_epoch: int) -> tuple[str, int]:
    """t-0, as _assign."""
    _assign(consumer, leader, leader_epoch, [("t", 0)])
    return ("t", 0)


async def test_a_reset_answered_after_the_topic_id_changed_is_asked_again() -> None:
    """The topic was created again while the reset was in flight: its answer is the old
    topic's offset, dropped; the reset is sent again under the new id. Before, the consumer
    took the old topic's offset for the new topic's."""
    consumer = Consumer(["127.0.0.1:1"], auto_offset_reset="latest")
    leader = _RebornDuringReset()
    tp = _assign_one(consumer, leader, 0)
    consumer.metadata.topics["t"] = TopicInfo(ErrorCode.NONE, "", 1, b"old-id")
    try:
        assert await consumer.poll(0) == []  # the reset is sent, under old-id
        consumer.metadata.topics["t"] = TopicInfo(ErrorCode.NONE, "", 1, b"new-id")
        leader.release.set()
        async with asyncio.timeout(DEADLINE_S):
            while consumer.position(tp) is None:
                assert await consumer.poll(10) == []
        assert consumer.position(tp) == 0
        assert leader.topic_ids == [b"old-id", b"new-id"]
    finally:
        await consumer.close()


async def test_a_seek_to_position_is_held_under_the_topic_id_it_was_found_under() -> None:
    """seek_to_end() found offset 4 in the topic old-id names; the topic is created again
    (new-id) before the next poll. The position is the old topic's: dropped and reset by
    auto_offset_reset under the new id, never fetched from 4 of the new topic. Before, it took
    the id the metadata held at the next poll, and the fetch from 4 named the new one."""
    consumer = Consumer(["127.0.0.1:1"], auto_offset_reset="earliest")
    leader = _RebornDuringReset()
    leader.release.set()
    tp = _assign_one(consumer, leader, 0)
    consumer.metadata.topics["t"] = TopicInfo(ErrorCode.NONE, "", 1, b"old-id")
    try:
        async with asyncio.timeout(DEADLINE_S):
            await consumer.seek_to_end(tp)
            assert consumer.position(tp) == 4
            consumer.metadata.topics["t"] = TopicInfo(ErrorCode.NONE, "", 1, b"new-id")
            while consumer.position(tp) != 0:
                assert await consumer.poll(10) == []
        assert leader.topic_ids == [b"old-id", b"new-id"]
    finally:
        await consumer.close()


class _MovedLeader:
    """A leader's stub: ListOffsets answers `first` (NOT_LEADER_OR_FOLLOWER: the metadata was
    stale) first, then finds offset 4; Fetch long-polls."""

    def __init__(self, first: int = ErrorCode.NOT_LEADER_OR_FOLLOWER) -> None:
        self.list_offsets = 0
        self.first = first

    async def Fetch(self, request: pb.FetchRequest, **_: Any) -> pb.FetchResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def ListOffsets(self, request: pb.ListOffsetsRequest, **_: Any) -> pb.ListOffsetsResponse:
        self.list_offsets += 1
        if self.list_offsets == 1:
            result = pb.ListOffsetsPartitionResponse(topic="t", partition=0, error_code=self.first)
        else:
            result = pb.ListOffsetsPartitionResponse(
                topic="t", partition=0, offset=4, leader_epoch=1
            )
        return pb.ListOffsetsResponse(partitions=[result])


@pytest.mark.parametrize(
    ("first", "reset", "refreshed"),
    [
        (ErrorCode.NOT_LEADER_OR_FOLLOWER, "earliest", True),
        (ErrorCode.OFFSET_NOT_AVAILABLE, "latest", False),  # a LATEST only
    ],
)
async def test_a_reset_answered_a_retriable_error_is_asked_again_not_raised(
    first: int, reset: str, refreshed: bool
) -> None:
    """As Kafka's Fetcher: a retriable error to a reset asks for the reset again after
    retry_backoff_ms, with new metadata if the leader moved; before, poll() raised
    NotLeaderOrFollower. Review 26 L5: a new leader answers OFFSET_NOT_AVAILABLE until its HW
    reaches its leader epoch (the metadata is right)."""
    consumer = Consumer(["127.0.0.1:1"], auto_offset_reset=reset, retry_backoff_ms=10)
    leader = _MovedLeader(first)
    tp = _assign_one(consumer, leader, 1)
    refreshes = []
    consumer.metadata.request_refresh = lambda: refreshes.append(1)  # type: ignore[method-assign]
    try:
        async with asyncio.timeout(DEADLINE_S):
            while consumer.position(tp) is None:
                assert await consumer.poll(10) == []
        assert consumer._positions[tp] == FetchPosition(4, 1, (1, 1))
        assert leader.list_offsets == 2
        assert bool(refreshes) == refreshed
    finally:
        await consumer.close()


async def test_a_reset_the_leader_does_not_answer_holds_up_its_partition_alone(
    cluster: Cluster,
) -> None:
    """A reset by auto_offset_reset (ListOffsets) goes one per leader and outlives the poll
    that sent it, as Kafka's resetPositionsIfNeeded: while broker 1, behind a proxy that
    swallows everything, never answers the reset of its partition, polls return within their
    timeout with the records of broker 2's; before, each poll waited up to
    request_timeout_ms for the reset. Once broker 1 answers, its partition is read too."""
    await cluster.create_topic("split", partitions=2)  # partition p led by broker p + 1
    silent, flowing = ("split", 0), ("split", 1)
    async with Producer(cluster.bootstrap) as producer:
        await producer.send_and_wait("split", b"s0", partition=0)
        await producer.send_and_wait("split", b"f0", partition=1)
    async with TcpProxy(cluster.brokers[1].address, LinkMode.BLACKHOLE) as proxy:
        cluster.advertised[1] = proxy.address  # for clients: replicas still talk directly
        await cluster.publish()
        async with (
            # Not idempotent: InitProducerId may ask broker 1 first.
            Producer(cluster.bootstrap, enable_idempotence=False) as producer,
            Consumer(
                cluster.bootstrap, auto_offset_reset="earliest", request_timeout_ms=LONG_POLL_MS
            ) as consumer,
        ):
            consumer.assign([silent, flowing])
            # Each poll returns (the test's deadline is far below request_timeout_ms).
            assert await poll_until(consumer, 1) == [(1, b"f0")]
            await producer.send_and_wait("split", b"f1", partition=1)
            assert await poll_until(consumer, 1) == [(1, b"f1")]
            async with asyncio.timeout(DEADLINE_S):
                assert await consumer.poll(10) == []
            assert proxy.discarded > 0  # the reset was sent, and swallowed
            assert consumer.position(silent) is None  # not fetched: its reset is pending
            # The swallowed call fails once the link heals; its retry finds offset 0.
            proxy.set_mode(LinkMode.PASS)
            assert await poll_until(consumer, 1) == [(0, b"s0")]
            assert consumer.position(silent) == 1


class _LateResetLeader:
    """A leader's stub whose log ends at offset 1200: the first ListOffsets answers once
    `release` is set, with the end the log had when it was sent (40); later ones at once.
    Fetch from 1000 is out of range, from anywhere else long-polls."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.list_offsets = 0

    async def ListOffsets(self, request: pb.ListOffsetsRequest, **_: Any) -> pb.ListOffsetsResponse:
        self.list_offsets += 1
        if self.list_offsets == 1:
            await self.release.wait()
        offset = 40 if self.list_offsets == 1 else 1200
        return pb.ListOffsetsResponse(
            partitions=[
                pb.ListOffsetsPartitionResponse(
                    topic="t", partition=0, offset=offset, leader_epoch=1
                )
            ]
        )

    async def Fetch(self, request: pb.FetchRequest, **_: Any) -> pb.FetchResponse:
        [p] = request.partitions
        if p.fetch_offset != 1000:
            await asyncio.Event().wait()
        return pb.FetchResponse(
            partitions=[
                pb.FetchPartitionResponse(
                    topic="t", partition=0, error_code=ErrorCode.OFFSET_OUT_OF_RANGE
                )
            ]
        )


async def test_a_reset_sent_before_a_seek_is_not_applied_after_it() -> None:
    """A reset (ListOffsets "latest") is in flight when the application seeks, and a fetch
    from the sought offset is out of range: the position is lost again. The reset's answer,
    the end of the log before the seek (40), is stale (the position changed since it was
    sent): a new reset finds the end now (1200). Before, the only check was that the position
    was None, so the consumer applied 40 and read from an older end of the log."""
    consumer = Consumer(["127.0.0.1:1"], auto_offset_reset="latest", retry_backoff_ms=10)
    leader = _LateResetLeader()
    tp = _assign_one(consumer, leader, 1)
    try:
        assert await consumer.poll(0) == []  # the reset is sent, not answered
        consumer.seek(tp, 1000)
        async with asyncio.timeout(DEADLINE_S):
            while consumer.position(tp) is not None:  # the fetch from 1000: out of range
                assert await consumer.poll(10) == []
            leader.release.set()
            while consumer.position(tp) is None:
                assert await consumer.poll(10) == []
        assert consumer.position(tp) == 1200
        assert leader.list_offsets == 2
    finally:
        await consumer.close()


class _HeldListOffsets:
    """A leader's stub answering each ListOffsets once the event of its spec is set: the
    log starts at 0, ends at 40, and its first record at or after any time is at 20."""

    def __init__(self) -> None:
        self.offsets = {
            pb.OFFSET_SPEC_EARLIEST: 0,
            pb.OFFSET_SPEC_LATEST: 40,
            pb.OFFSET_SPEC_TIMESTAMP: 20,
        }
        self.asked: list[int] = []
        self.release = {spec: asyncio.Event() for spec in self.offsets}

    async def ListOffsets(self, request: pb.ListOffsetsRequest, **_: Any) -> pb.ListOffsetsResponse:
        [p] = request.partitions
        self.asked.append(p.spec)
        await self.release[p.spec].wait()
        return pb.ListOffsetsResponse(
            partitions=[
                pb.ListOffsetsPartitionResponse(
                    topic="t", partition=0, offset=self.offsets[p.spec], leader_epoch=1
                )
            ]
        )


@pytest.mark.parametrize("seek_to", ["beginning", "end", "timestamp"])
async def test_a_seek_made_while_a_seek_to_waits_for_its_answer_wins(seek_to: str) -> None:
    """The application's last positioning call wins, as in Kafka: the answer of a
    seek_to_*() still in flight when the application seeks is dropped. Before, it
    overwrote the sought position."""
    consumer = Consumer(["127.0.0.1:1"])
    leader = _HeldListOffsets()
    tp = _assign_one(consumer, leader, 1)
    calls = {
        "beginning": lambda: consumer.seek_to_beginning(tp),
        "end": lambda: consumer.seek_to_end(tp),
        "timestamp": lambda: consumer.seek_to_timestamp(tp, 0),
    }
    try:
        seeking = asyncio.create_task(calls[seek_to]())
        await eventually(lambda: leader.asked, DEADLINE_S)
        consumer.seek(tp, 1000)
        for release in leader.release.values():
            release.set()
        async with asyncio.timeout(DEADLINE_S):
            await seeking
        assert consumer.position(tp) == 1000
    finally:
        await consumer.close()


async def test_a_seek_to_end_wins_over_an_earlier_seek_to_beginning_answered_after_it() -> None:
    """Two seek_to_*() calls in flight, the later answered first: the later call wins."""
    consumer = Consumer(["127.0.0.1:1"])
    leader = _HeldListOffsets()
    tp = _assign_one(consumer, leader, 1)
    try:
        to_beginning = asyncio.create_task(consumer.seek_to_beginning(tp))
        to_end = asyncio.create_task(consumer.seek_to_end(tp))
        await eventually(lambda: len(leader.asked) == 2, DEADLINE_S)
        leader.release[pb.OFFSET_SPEC_LATEST].set()
        async with asyncio.timeout(DEADLINE_S):
            await to_end
            assert consumer.position(tp) == 40
            leader.release[pb.OFFSET_SPEC_EARLIEST].set()
            await to_beginning
        assert consumer.position(tp) == 40  # before: 0, the earlier call's answer
    finally:
        await consumer.close()


class _RefusingPartition0:
    """A leader's stub: ListOffsets of t-0 is refused at once; of t-1 answered (the log
    starts at 0) once `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.asked: list[int] = []

    async def ListOffsets(self, request: pb.ListOffsetsRequest, **_: Any) -> pb.ListOffsetsResponse:
        [p] = request.partitions
        self.asked.append(p.partition)
        if p.partition == 0:
            answer = pb.ListOffsetsPartitionResponse(
                topic="t", partition=0, error_code=ErrorCode.UNKNOWN_SERVER_ERROR
            )
        else:
            await self.release.wait()
            answer = pb.ListOffsetsPartitionResponse(topic="t", partition=1, offset=0)
        return pb.ListOffsetsResponse(partitions=[answer])


async def test_a_seek_to_that_fails_leaves_an_earlier_one_in_flight_to_be_answered() -> None:
    """seek_to_end(t-0, t-1) fails at t-0 while a seek_to_beginning(t-1) waits for its
    answer: that answer positions t-1, as the failed call never did. Before, the failed call
    held t-1's latest call, so the earlier answer was dropped."""
    consumer = Consumer(["127.0.0.1:1"])
    leader = _RefusingPartition0()
    t0, t1 = ("t", 0), ("t", 1)
    _assign(consumer, leader, 0, [t0, t1])
    try:
        to_beginning = asyncio.create_task(consumer.seek_to_beginning(t1))
        await eventually(lambda: leader.asked == [1], DEADLINE_S)
        with pytest.raises(TidewaterError):
            await consumer.seek_to_end(t0, t1)
        leader.release.set()
        async with asyncio.timeout(DEADLINE_S):
            await to_beginning
        assert consumer.position(t1) == 0
    finally:
        await consumer.close()


async def test_a_partition_with_a_backlog_does_not_hold_back_the_others_of_its_leader(
    cluster: Cluster,
) -> None:
    """Review 26 M1: p0 and p3 share leader 1; p0 has a backlog larger than a fetch. The
    broker fills a fetch in request order, and p0 came first every time: p3 got nothing
    until p0 was read to its end. Each partition gets its max_partition_fetch_bytes of a
    fetch now, and one that returned records goes last in the next (Kafka's
    movePartitionToEnd)."""
    await cluster.create_topic("backlog", partitions=4)  # p0 and p3 led by broker 1
    async with Producer(cluster.bootstrap, linger_ms=0, batch_size=1) as producer:
        for _ in range(60):
            await producer.send("backlog", b"x" * 1000, partition=0)
        for _ in range(3):
            await producer.send("backlog", b"y" * 1000, partition=3)
        await producer.flush()
    async with Consumer(
        cluster.bootstrap, auto_offset_reset="earliest", fetch_max_bytes=3000
    ) as consumer:
        consumer.assign([("backlog", 0), ("backlog", 3)])
        order: list[int] = []
        async with asyncio.timeout(30):
            while 3 not in order:
                for tp, records in (await consumer.poll_partitions(1000)).items():
                    order += [tp[1]] * len(records)
    assert order.index(3) <= 3, order


async def test_a_poll_waiting_when_the_consumer_closes_ends_with_consumer_closed(
    cluster: Cluster,
) -> None:
    """Review 26 M2: a poll another task was in went on after close(): it sent new fetches on
    channels it opened again, and ended with a bare CancelledError."""
    await cluster.create_topic("closing", partitions=3)
    consumer = Consumer(cluster.bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=200)
    consumer.assign([("closing", p) for p in range(3)])
    polling = asyncio.create_task(consumer.poll(3000))
    await eventually(lambda: consumer._fetching.in_flight, 10)
    await consumer.close()
    with pytest.raises(ConsumerClosed):
        await asyncio.wait_for(polling, 10)
    assert not consumer._fetching.in_flight and not consumer.metadata._channels


async def test_a_consumer_moves_off_a_metadata_service_that_stopped_hearing_the_controller(
    cluster: Cluster,
) -> None:
    """Review 26 M3: the first metadata service named answers but has not heard from the
    controller since t-0's leader died; the consumer asked it first at every refresh and
    got nothing for good. A refresh a failure asked for that changes nothing moves on to
    the next service."""
    await cluster.create_topic("stale", partitions=1)  # led by broker 1
    stale = MetadataServer("127.0.0.1:0")
    await stale.start()
    fresh, cluster.metadata = cluster.metadata, stale
    await cluster.publish()  # the stale service's only view
    cluster.metadata = fresh
    try:
        consumer = Consumer(
            [stale.address, fresh.address], auto_offset_reset="earliest", fetch_max_wait_ms=100
        )
        async with consumer:
            consumer.assign([("stale", 0)])
            await consumer.poll(500)
            await cluster.brokers[1].stop(0)
            del cluster.controller.brokers[1]
            await cluster.controller.elect("stale", 0, leader=2, isr=[2, 3])
            await cluster.publish()
            async with Producer(cluster.bootstrap) as producer:
                await producer.send_and_wait("stale", b"after", partition=0)
            got: list[Any] = []
            async with asyncio.timeout(20):
                while not got:
                    got += await consumer.poll(500)
        assert [r.value for r in got] == [b"after"]
    finally:
        await stale.stop(0)


async def test_lag_knows_no_high_watermark_of_a_topic_recreated_or_a_partition_reassigned() -> None:
    """Review 26 L3: lag() went on with the deleted topic's HW (against the new topic's
    position from 0) until the first fetch came back, and with an unassigned partition's HW
    once it was assigned again."""
    consumer = Consumer(["127.0.0.1:1"])
    tp = ("t", 0)
    try:
        consumer.assign([tp])
        consumer.metadata.topics["t"] = TopicInfo(ErrorCode.NONE, "", 1, b"old-id")
        consumer._check_topic_id(tp)
        consumer._positions[tp] = FetchPosition(3)
        consumer._high_watermarks[tp] = 10
        assert consumer.lag(tp) == 7
        consumer.metadata.topics["t"] = TopicInfo(ErrorCode.NONE, "", 1, b"new-id")
        consumer._check_topic_id(tp)
        consumer._positions[tp] = FetchPosition(0)
        assert consumer.lag(tp) is None
        consumer._high_watermarks[tp] = 10
        consumer.assign([])
        consumer.assign([tp])
        consumer._positions[tp] = FetchPosition(0)
        assert consumer.lag(tp) is None
    finally:
        await consumer.close()


async def test_a_partition_moved_off_a_silent_leader_is_fetched_from_the_new_one_at_once(
    cluster: Cluster,
) -> None:
    """Review 26 L4: a fetch to the old leader, which went silent (its host swallows
    everything), held the partition: none went to the new leader until the old one's call
    timed out (request_timeout_ms). A request stale for the partition (its position moved to
    the new leader) holds it no more, as Kafka's consumer waits only on the current leader."""
    await cluster.create_topic("moving", partitions=1)  # led by broker 1
    async with TcpProxy(cluster.brokers[1].address) as proxy:
        cluster.advertised[1] = proxy.address  # for clients: replicas talk directly
        await cluster.publish()
        async with Consumer(
            cluster.bootstrap,
            auto_offset_reset="earliest",
            request_timeout_ms=LONG_POLL_MS,
            fetch_max_wait_ms=LONG_POLL_MS,
        ) as consumer:
            consumer.assign([("moving", 0)])
            async with asyncio.timeout(DEADLINE_S):  # the position found, a long poll out
                while not consumer._fetching.in_flight:
                    await consumer.poll(100)
            proxy.set_mode(LinkMode.BLACKHOLE)
            await cluster.move_leader("moving", 0, leader=2)
            async with Producer(cluster.bootstrap, enable_idempotence=False) as producer:
                await producer.send_and_wait("moving", b"on 2", partition=0)
            consumer.metadata.request_refresh()
            assert await poll_until(consumer, 1) == [(0, b"on 2")]
