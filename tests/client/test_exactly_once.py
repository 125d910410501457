"""The idempotent producer against faults between a leader's append and its answer, with real
broker processes: answers lost on the way back, the leader killed -9 mid-stream, the
producer's state forgotten by the broker, batches expiring unanswered. Each record ends up in
the log exactly once, in send order per partition; where the sequence cannot go on, the
producer moves to a new epoch (KIP-360)."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.client.cluster import Cluster
from tests.client.conftest import PROCESS_SETTINGS
from tidewater.client.consumer import Consumer
from tidewater.client.errors import DeliveryTimeout
from tidewater.client.producer import Producer, RecordMetadata
from tidewater.local.process import ManagedProcess
from tidewater.local.tcp_proxy import LinkMode, TcpProxy
from tidewater.local.wait import eventually
from tidewater.records.header import BatchHeader
from tidewater.records.validate import iter_batch_headers

RECORDS = 10_000
PARTITIONS = 3
CHUNK = 500
PRODUCER = {"linger_ms": 2, "retry_backoff_ms": 20}
DEADLINE_S = 20.0


def batches_on_disk(root: Path, broker_id: int, tp: tuple[str, int]) -> list[BatchHeader]:
    """Headers of the whole batches in a broker's copy of a partition, read from its files as
    it writes them (a batch still being written is left out)."""
    directory = root / f"broker-{broker_id}" / f"{tp[0]}-{tp[1]}"
    return [
        header
        for segment in sorted(directory.glob("*.log"))
        for _, header in iter_batch_headers(segment.read_bytes(), ignore_partial_tail=True)
    ]


def log_end(root: Path, broker_id: int, tp: tuple[str, int]) -> int:
    batches = batches_on_disk(root, broker_id, tp)
    return batches[-1].next_offset if batches else 0


class Stream:
    """Sends RECORDS values "0", "1", ... round-robin over the partitions, a chunk at a time,
    and checks the log afterwards."""

    def __init__(self, cluster: Cluster, topic: str) -> None:
        self.cluster = cluster
        self.topic = topic
        self.futures: list[Any] = []

    def acknowledged(self, partition: int) -> int:
        return sum(
            1
            for i, f in enumerate(self.futures)
            if i % PARTITIONS == partition and f.done() and not f.exception()
        )

    async def send_chunk(self, producer: Producer) -> None:
        start = len(self.futures)
        for i in range(start, min(start + CHUNK, RECORDS)):
            self.futures.append(
                await producer.send(self.topic, str(i).encode(), partition=i % PARTITIONS)
            )

    async def assert_exactly_once_in_order(self) -> None:
        sent: list[RecordMetadata] = [f.result() for f in self.futures]
        assert len(sent) == RECORDS
        tps = [(self.topic, p) for p in range(PARTITIONS)]
        by_partition: dict[int, list[int]] = {p: [] for p in range(PARTITIONS)}
        async with Consumer(self.cluster.bootstrap, auto_offset_reset="earliest") as consumer:
            consumer.assign(tps)

            async def all_read() -> bool:
                for record in await consumer.poll(200):
                    by_partition[int(record.value) % PARTITIONS].append(int(record.value))
                return all(consumer.lag(tp) == 0 for tp in tps)

            await eventually(all_read, DEADLINE_S)
        for p in range(PARTITIONS):
            assert by_partition[p] == list(range(p, RECORDS, PARTITIONS))
            # Each acknowledgement names the offset the record really has.
            assert [m.offset for m in sent[p::PARTITIONS]] == list(range(len(by_partition[p])))


@pytest.fixture
async def proxies(process_cluster: Cluster) -> AsyncIterator[dict[int, TcpProxy]]:
    """A proxy in front of every broker, for the producer only (replicas talk directly)."""
    started = {}
    try:
        for broker_id, address in process_cluster.controller.brokers.items():
            started[broker_id] = proxy = TcpProxy(address)
            process_cluster.advertised[broker_id] = await proxy.start()
        await process_cluster.publish()
        yield started
    finally:
        for proxy in started.values():
            await proxy.stop()


async def test_answers_lost_after_the_append_are_retried_without_duplicates(
    process_cluster: Cluster, proxies: dict[int, TcpProxy], tmp_path: Path
) -> None:
    await process_cluster.create_topic("lost-answers", partitions=PARTITIONS)
    stream = Stream(process_cluster, "lost-answers")
    tp = ("lost-answers", 0)  # led by broker 1
    async with Producer(process_cluster.bootstrap, **PRODUCER) as producer:
        for chunk in range(RECORDS // CHUNK):
            if chunk % 5 != 2:
                await stream.send_chunk(producer)
                continue
            proxies[1].set_mode(LinkMode.ONE_WAY)
            await stream.send_chunk(producer)

            def appended_unanswered() -> bool:
                return log_end(tmp_path, 1, tp) > stream.acknowledged(0)

            await eventually(appended_unanswered, DEADLINE_S)
            # Healing closes the connection that lost the answers: the producer retries.
            proxies[1].set_mode(LinkMode.PASS)
        await producer.flush()
    await stream.assert_exactly_once_in_order()


async def test_leader_killed_mid_stream_fails_over_without_duplicates(
    process_cluster: Cluster, tmp_path: Path
) -> None:
    await process_cluster.create_topic("failover", partitions=PARTITIONS)
    stream = Stream(process_cluster, "failover")
    tp = ("failover", 0)  # led by broker 1, replicated to 2 and 3
    async with Producer(process_cluster.bootstrap, **PRODUCER) as producer:
        for chunk in range(RECORDS // CHUNK):
            if chunk != RECORDS // CHUNK // 2:
                await stream.send_chunk(producer)
                continue
            # With broker 3 paused the HW cannot pass what it has: broker 2 gets the
            # records, the producer no answer. Then the leader dies and broker 2 takes over.
            process_cluster.brokers[3].signal(signal.SIGSTOP)
            await stream.send_chunk(producer)

            def replicated_unanswered() -> bool:
                return log_end(tmp_path, 2, tp) > stream.acknowledged(0)

            await eventually(replicated_unanswered, DEADLINE_S)
            process_cluster.brokers[3].signal(signal.SIGCONT)
            await process_cluster.kill(1)
        await producer.flush()
    assert process_cluster.controller.states[tp].leader == 2
    await stream.assert_exactly_once_in_order()


async def test_a_producer_whose_batches_retention_deleted_goes_on_in_its_epoch(
    process_cluster: Cluster, tmp_path: Path
) -> None:
    # Tiny segments, retention keeping only the active one: another producer's records push
    # the quiet producer's batches out of the log. The leader keeps its state (KIP-360).
    process_cluster.controller.configs["retained"] = {
        "segment.bytes": "1024",
        "retention.bytes": "1",
    }
    await process_cluster.create_topic("retained")
    tp = ("retained", 0)
    async with (
        Producer(process_cluster.bootstrap, **PRODUCER) as quiet,
        Producer(process_cluster.bootstrap, batch_size=500, **PRODUCER) as busy,
    ):
        await quiet.send_and_wait("retained", b"quiet-0", partition=0)
        last = await quiet.send_and_wait("retained", b"quiet-1", partition=0)
        filler = [await busy.send("retained", bytes(200), partition=0) for _ in range(20)]
        await busy.flush()
        assert all(f.exception() is None for f in filler)

        def deleted() -> bool:
            return batches_on_disk(tmp_path, 1, tp)[0].base_offset > last.offset

        await eventually(deleted, DEADLINE_S)
        after = await quiet.send_and_wait("retained", b"quiet-2", partition=0)

    stored = {h.base_offset: h for h in batches_on_disk(tmp_path, 1, tp)}
    assert (stored[after.offset].producer_epoch, stored[after.offset].base_sequence) == (0, 2)


# Producers idle for 3 s are forgotten (checked every 100 ms). The sends after the expiry go
# out together: a gap of 3 s between them on a loaded machine would be a second expiry.
EXPIRING = PROCESS_SETTINGS | {
    "producer.id.expiration.ms": "3000",
    "producer.id.expiration.check.interval.ms": "100",
}


@pytest.mark.parametrize("process_settings", [EXPIRING])
async def test_a_producer_the_broker_forgot_bumps_its_epoch_and_goes_on(
    process_cluster: Cluster, tmp_path: Path
) -> None:
    await process_cluster.create_topic("forgetful")
    tp = ("forgetful", 0)
    async with Producer(process_cluster.bootstrap, **PRODUCER) as quiet:
        await quiet.send_and_wait("forgetful", b"quiet-0", partition=0)
        leader = process_cluster.brokers[1]
        assert isinstance(leader, ManagedProcess)
        leader_log = leader.log_file
        await eventually(
            lambda: "forgetful-0: expired 1 producer(s)" in leader_log.read_text(), DEADLINE_S
        )
        # Its sequence 1 is refused (UNKNOWN_PRODUCER_ID): it bumps its epoch and starts at 0.
        sent = [await quiet.send("forgetful", v, partition=0) for v in (b"quiet-1", b"quiet-2")]
        after, again = [await f for f in sent]

    assert again.offset == after.offset + 1
    stored = batches_on_disk(tmp_path, 1, tp)

    def numbering(offset: int) -> tuple[int, int]:
        """(producer epoch, sequence) of the record at `offset`."""
        h = next(h for h in stored if h.base_offset <= offset < h.next_offset)
        return h.producer_epoch, h.base_sequence + offset - h.base_offset

    assert [numbering(m.offset) for m in (after, again)] == [(1, 0), (1, 1)]


async def test_batches_that_expired_unanswered_move_the_partition_to_a_new_epoch(
    process_cluster: Cluster, proxies: dict[int, TcpProxy], tmp_path: Path
) -> None:
    await process_cluster.create_topic("expiring")
    tp = ("expiring", 0)
    async with Producer(
        process_cluster.bootstrap, request_timeout_ms=300, delivery_timeout_ms=600, **PRODUCER
    ) as producer:
        before = await producer.send_and_wait("expiring", b"before", partition=0)
        proxies[1].set_mode(LinkMode.ONE_WAY)
        lost = [await producer.send("expiring", b"lost", partition=0) for _ in range(3)]
        await producer.flush()
        # Written by the leader, never acknowledged: the producer cannot tell.
        assert all(isinstance(f.exception(), DeliveryTimeout) for f in lost)
        await eventually(lambda: log_end(tmp_path, 1, tp) == before.offset + 4, DEADLINE_S)
        proxies[1].set_mode(LinkMode.PASS)
        after = await producer.send_and_wait("expiring", b"after", partition=0)

    # Its sequence after the lost ones is unknown to the producer, so it starts epoch 1 at 0.
    stored = {h.base_offset: h for h in batches_on_disk(tmp_path, 1, tp)}
    assert after.offset == before.offset + 4
    assert (stored[after.offset].producer_epoch, stored[after.offset].base_sequence) == (1, 0)
