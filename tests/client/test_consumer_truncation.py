"""KIP-320 against broker processes: a consumer whose partition's new leader holds a shorter
log (an unclean election) detects the truncation under its position instead of reading on at
its old offset in the new history."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.client.cluster import Cluster
from tidewater.client.consumer import Consumer
from tidewater.client.errors import LogTruncation
from tidewater.client.producer import Producer

TOPIC = "diverge"
TP = (TOPIC, 0)
DEADLINE_S = 90
LONG_POLL_MS = 120_000


async def produce(cluster: Cluster, *values: bytes) -> None:
    async with Producer(cluster.bootstrap, acks=-1) as producer:
        for value in values:
            await producer.send_and_wait(TOPIC, value, partition=0)


async def poll_values(consumer: Consumer, count: int) -> list[tuple[int, bytes | None]]:
    """(offset, value) of the next `count` records."""
    got: list[tuple[int, bytes | None]] = []
    while len(got) < count:
        got += [(r.offset, r.value) for r in await consumer.poll(LONG_POLL_MS)]
    return got


async def unclean_election_under(cluster: Cluster, consumer: Consumer) -> None:
    """Broker 2 holds a, b (epoch 1) and goes down; broker 1 alone writes c, d, e (epoch 2),
    which `consumer` reads; then broker 1 dies and broker 2, restarted, is elected out of the
    ISR (epoch 3) and writes f, g, h, i at offsets 2-5. The consumer does not poll meanwhile,
    so its position 5 is also an offset of the new history."""
    await cluster.controller.elect(TOPIC, 0, leader=1, replicas=[1, 2])
    await cluster.publish()
    await produce(cluster, b"a", b"b")  # acks=all with ISR [1, 2]: broker 2 has them
    cluster.brokers[2].kill()
    del cluster.controller.brokers[2]
    await cluster.controller.elect(TOPIC, 0, leader=1, isr=[1])
    await cluster.publish()
    await produce(cluster, b"c", b"d", b"e")
    consumer.assign([TP])
    await consumer.seek_to_beginning(TP)
    assert [value for _, value in await poll_values(consumer, 5)] == [b"a", b"b", b"c", b"d", b"e"]
    assert consumer.position(TP) == 5
    cluster.brokers[1].kill()
    del cluster.controller.brokers[1]
    cluster.controller.brokers[2] = await asyncio.to_thread(cluster.brokers[2].start)
    await cluster.controller.elect(TOPIC, 0, leader=2, isr=[2])
    await cluster.publish()
    await produce(cluster, b"f", b"g", b"h", b"i")


NEW_HISTORY = [(2, b"f"), (3, b"g"), (4, b"h"), (5, b"i")]


@pytest.mark.parametrize("policy", ["earliest", "latest"])
async def test_a_truncation_under_the_position_is_read_on_from_the_divergence_point(
    process_cluster: Cluster, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tidewater.client.consumer")
    async with (
        asyncio.timeout(DEADLINE_S),
        Consumer(
            process_cluster.bootstrap, auto_offset_reset=policy, request_timeout_ms=5000
        ) as consumer,
    ):
        await unclean_election_under(process_cluster, consumer)
        # Not the old offset 5 in the new history (i alone), nor the log's start or end.
        assert await poll_values(consumer, 4) == NEW_HISTORY
    assert (
        "diverge-0: log truncation detected at fetch position 5 (epoch 2): the leader's log "
        "diverges from offset 2" in caplog.text
    )


async def test_a_truncation_under_the_position_without_reset_policy_is_raised(
    process_cluster: Cluster,
) -> None:
    async with (
        asyncio.timeout(DEADLINE_S),
        Consumer(
            process_cluster.bootstrap, auto_offset_reset="none", request_timeout_ms=5000
        ) as consumer,
    ):
        await unclean_election_under(process_cluster, consumer)
        with pytest.raises(LogTruncation) as raised:
            await poll_values(consumer, 1)
        assert (raised.value.topic_partition, raised.value.position) == (TP, 5)
        assert raised.value.divergent_offset == 2
        assert "diverge-0" in str(raised.value)
        # The application decides: here, the new history from where it diverges.
        consumer.seek(TP, raised.value.divergent_offset)
        assert await poll_values(consumer, 4) == NEW_HISTORY
