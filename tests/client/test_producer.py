"""Producer and consumer against real in-process brokers and a real metadata service."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

import pytest

from tests.client.cluster import Cluster
from tidewater.client.consumer import Consumer
from tidewater.client.errors import BufferExhausted, MetadataUnavailable, SenderFailed
from tidewater.client.producer import Producer
from tidewater.errors import (
    InvalidConfig,
    InvalidTopic,
    MessageTooLarge,
    UnknownTopicOrPartition,
)

NO_IDEMPOTENCE = {"enable_idempotence": False}
DEADLINE_S = 30


async def consume_all(cluster: Cluster, tps: list[tuple[str, int]], count: int) -> list:
    records: list = []
    async with Consumer(cluster.bootstrap, auto_offset_reset="earliest") as consumer:
        consumer.assign(tps)
        for _ in range(100):
            records += await consumer.poll(200)
            if len(records) >= count:
                break
        assert all(consumer.lag(tp) == 0 for tp in tps)
    return records


@pytest.mark.parametrize("compression", [None, "gzip", "lz4", "zstd"])
async def test_round_trip(cluster: Cluster, compression: str | None) -> None:
    await cluster.create_topic("rt", partitions=3)
    async with Producer(cluster.bootstrap, compression=compression, **NO_IDEMPOTENCE) as producer:
        futures = [
            await producer.send("rt", f"v{i}".encode(), key=f"k{i % 5}".encode())
            for i in range(300)
        ]
        await producer.flush()
    sent = [f.result() for f in futures]
    records = await consume_all(cluster, [("rt", p) for p in range(3)], 300)
    assert sorted(r.value for r in records) == sorted(f"v{i}".encode() for i in range(300))
    # Per partition, offsets count up in send order.
    for p in range(3):
        offsets = [m.offset for m in sent if m.partition == p]
        assert offsets == list(range(len(offsets)))


async def test_keyless_records_move_on_to_other_partitions_as_batches_fill(
    cluster: Cluster,
) -> None:
    # Sent back to back, the sender never runs in between: only the partitioner's move to
    # another partition when the sticky one's batch is full (KIP-480) spreads them.
    await cluster.create_topic("spread", partitions=3)
    async with Producer(cluster.bootstrap, batch_size=1000, **NO_IDEMPOTENCE) as producer:
        futures = [await producer.send("spread", bytes(100)) for _ in range(300)]
        await producer.flush()
    per_partition = Counter(f.result().partition for f in futures)
    assert set(per_partition) == {0, 1, 2}
    assert max(per_partition.values()) < 200


@pytest.mark.parametrize("idempotent", [False, True], ids=["plain", "idempotent"])
async def test_nothing_lost_across_leader_moves(cluster: Cluster, idempotent: bool) -> None:
    await cluster.create_topic("moving")
    async with Producer(
        cluster.bootstrap, linger_ms=1, retry_backoff_ms=20, enable_idempotence=idempotent
    ) as producer:
        futures = []
        for i in range(600):
            futures.append(await producer.send("moving", str(i).encode(), partition=0))
            if i in (200, 400):
                await cluster.move_leader("moving", 0, leader=2 if i == 200 else 3)
        await producer.flush()
    assert all(f.exception() is None for f in futures)
    records = await consume_all(cluster, [("moving", 0)], 600)
    values = [int(r.value) for r in records]
    if idempotent:
        assert values == list(range(600))
    else:
        # At least once, as in Kafka: a batch the old leader appended but never acknowledged
        # (its delayed produce ends NOT_LEADER_OR_FOLLOWER when leadership moves) is retried
        # and written again by the new leader.
        assert sorted(set(values)) == list(range(600))


async def test_unknown_topic_is_a_clear_error(cluster: Cluster) -> None:
    async with Producer(cluster.bootstrap, max_block_ms=300, **NO_IDEMPOTENCE) as producer:
        with pytest.raises(UnknownTopicOrPartition, match="nope"):
            await producer.send("nope", b"x")


async def test_an_invalid_topic_name_fails_the_send_at_once(cluster: Cluster) -> None:
    """Review 29 #7: INVALID_TOPIC from the metadata service was retried until max_block_ms
    (the test's 600 s would not have ended here), and the name stayed in every refresh."""
    async with Producer(cluster.bootstrap, max_block_ms=600_000, **NO_IDEMPOTENCE) as producer:
        with pytest.raises(InvalidTopic, match="bad!"):
            await asyncio.wait_for(producer.send("bad!", b"x"), DEADLINE_S)
        assert "bad!" not in producer.metadata._wanted


async def test_a_record_that_is_not_bytes_is_refused_by_send_and_the_producer_goes_on(
    cluster: Cluster,
) -> None:
    """Before, the sender met it when encoding the batch and died: every future hung."""
    await cluster.create_topic("typed")
    # The old code hung in close(): bounded, so that it fails rather than hangs.
    async with asyncio.timeout(30), Producer(cluster.bootstrap, **NO_IDEMPOTENCE) as producer:
        with pytest.raises(TypeError, match="not NoneType and str"):
            await producer.send("typed", "text")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="a header is"):
            await producer.send("typed", b"v", headers=(("h", "text"),))  # type: ignore[arg-type]
        future = await producer.send("typed", b"bytes")
        await producer.flush()
        assert future.result().offset == 0


async def test_oversized_record_is_refused(cluster: Cluster) -> None:
    await cluster.create_topic("big")
    async with Producer(cluster.bootstrap, max_request_size=1000, **NO_IDEMPOTENCE) as producer:
        with pytest.raises(MessageTooLarge):
            await producer.send("big", bytes(2000))


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_batch_above_the_topics_max_message_bytes_is_split_until_it_fits(
    cluster: Cluster, idempotent: bool
) -> None:
    """Review 18 L4: the topic takes batches of at most 2,000 bytes, the producer (which does
    not know that) fills 16 KiB ones: the broker refuses each, MESSAGE_TOO_LARGE, and every
    record failed. As Kafka's producer, it sends the records again in halves, split again
    while too large: every record lands once, in send order, each future naming its offset.
    One record alone above the limit still fails."""
    cluster.controller.configs["small"] = {"max.message.bytes": "2000"}
    await cluster.create_topic("small")
    config = {"linger_ms": 50, "max_in_flight_requests_per_connection": 1}
    if not idempotent:
        config.update(NO_IDEMPOTENCE)
    # Big records, then small ones: the first half is split again, the second fits at once
    # (review 24 #1: the first half's halves went behind the second half).
    sizes = [297] * 20 + [5] * 20
    async with Producer(cluster.bootstrap, **config) as producer:
        futures = [
            await producer.send("small", b"%03d" % i + bytes(n)) for i, n in enumerate(sizes)
        ]
        too_big = await producer.send("small", bytes(3000))
        await producer.flush()
    assert [f.result().offset for f in futures] == list(range(40))
    with pytest.raises(MessageTooLarge):
        too_big.result()
    records = await consume_all(cluster, [("small", 0)], 40)
    assert [(r.offset, r.value[:3]) for r in records] == [(i, b"%03d" % i) for i in range(40)]


async def test_producer_id_waits_out_a_controller_election(cluster: Cluster) -> None:
    await cluster.create_topic("pid")
    # Two InitProducerIds in a row find no active controller behind the broker (the broker
    # asks three times per call): retriable, so the producer backs off and asks again.
    cluster.controller.refuse_producer_ids = 6
    async with Producer(cluster.bootstrap, retry_backoff_ms=10) as producer:
        metadata = await (await producer.send("pid", b"x", partition=0))
    assert cluster.controller.refuse_producer_ids == 0
    assert metadata.offset == 0


async def test_buffer_exhausted_after_max_block(cluster: Cluster) -> None:
    await cluster.create_topic("full")
    # A leader that never answers in time: broker 1 is stopped after the metadata says it leads.
    producer = Producer(
        cluster.bootstrap, buffer_memory=2000, max_block_ms=200, linger_ms=1000, **NO_IDEMPOTENCE
    )
    await producer.send("full", bytes(900), partition=0)
    await producer.send("full", bytes(900), partition=0)
    with pytest.raises(BufferExhausted, match="buffer_memory"):
        await producer.send("full", bytes(900), partition=0)
    await producer.close()


@pytest.mark.parametrize(
    "config",
    [
        {"acks": 2},
        {"compression": "snappy"},
        {"batch_size": 0},
        {"linger.ms": 5},
        {"acks": 1},
        {"retries": 0},  # with enable_idempotence, as Kafka
        {"metadata_max_age_ms": -1},
    ],
)
def test_invalid_config_values(config: dict) -> None:
    with pytest.raises(InvalidConfig):
        Producer(["127.0.0.1:1"], **config)


def test_a_bad_compression_is_refused_naming_every_value_it_takes() -> None:
    with pytest.raises(InvalidConfig) as raised:
        Producer(["127.0.0.1:1"], compression="snappy")
    assert raised.value.message == (
        "compression must be None, 'none', 'gzip', 'lz4' or 'zstd', got 'snappy'"
    )
    Producer(["127.0.0.1:1"], compression="none")  # as the CLI passes it


async def test_silent_metadata_address_fails_fast() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        producer = Producer(
            [address], request_timeout_ms=500, delivery_timeout_ms=1000, **NO_IDEMPOTENCE
        )
        with pytest.raises(MetadataUnavailable, match=address):
            await producer.send("t", b"x")
        await producer.close()


async def test_a_sender_that_dies_fails_every_pending_record_and_every_later_send(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The sender task meets a bug once: the records it held fail with SenderFailed naming
    the cause, flush() returns, and every later send() raises it at once (a fatal state, as
    in Kafka's producer). Before, those records waited for close() to fail them, and flush()
    waited forever."""
    await cluster.create_topic("doomed", partitions=2)
    async with (
        asyncio.timeout(DEADLINE_S),
        Producer(cluster.bootstrap, linger_ms=60_000) as producer,
    ):
        before = await producer.send("doomed", b"before", partition=0)
        await producer.flush()
        assert (await before).offset == 0
        drain = producer._drain

        def bug_once(now: float) -> float:
            producer._drain = drain  # type: ignore[method-assign]
            raise RuntimeError("a bug in the sender")

        producer._drain = bug_once  # type: ignore[method-assign]
        # Queued (a long linger) and pending when the sender wakes up for them and dies.
        pending = [await producer.send("doomed", b"v", partition=p) for p in (0, 1)]
        await producer.flush()
        for future in pending:
            with pytest.raises(SenderFailed, match="a bug in the sender"):
                await future
        with pytest.raises(SenderFailed, match="a bug in the sender") as info:
            await producer.send("doomed", b"after", partition=0)
        assert isinstance(info.value.__cause__, RuntimeError)
        await producer.flush()
    assert "uncaught error in the producer's sender" in caplog.text
