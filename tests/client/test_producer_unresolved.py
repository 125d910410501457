"""The idempotent producer's sender when a batch's outcome is in doubt. One that fails for
good after an answer that may follow an append (NOT_LEADER_OR_FOLLOWER: the old leader
appended it, then leadership moved before the HW covered it, and the new leader had copied
it); and a retry its new leader no longer remembers. The real sender (_drain, _completed,
settle) against a fake link; the new leader is the broker's real producer state over a list
standing in for its log. Each record must be in that log once, and no batch renumbered in a
new epoch and written again."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidewater.broker.producer_state import ProducerStateManager
from tidewater.client import UNKNOWN_OFFSET
from tidewater.client import producer as producer_mod
from tidewater.client.accumulator import ProducerBatch
from tidewater.client.errors import DeliveryTimeout
from tidewater.errors import NotLeaderOrFollower, TidewaterError
from tidewater.records.batch import Record
from tidewater.records.header import read_header
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

TP = ("t", 0)
NEW_LEADER = (2, "new-leader:1", 6)
NOT_LEADER = pb.PartitionProduceResponse(
    topic="t", partition=0, error_code=ErrorCode.NOT_LEADER_OR_FOLLOWER
)


class NewLeader:
    """The next leader's log: as a follower it copied what the old leader appended."""

    def __init__(self, directory: Path) -> None:
        self.producers = ProducerStateManager(directory)
        self.values: list[bytes] = []

    def append(self, batch: ProducerBatch) -> int:
        """Append `batch` unless it is a duplicate; returns its first offset."""
        assert batch.data is not None
        header = read_header(batch.data)
        duplicate = self.producers.check(header)
        if duplicate is not None:
            return duplicate.first_offset
        self.producers.update(header, len(self.values), now_ms=0)
        self.values.extend(bytes(r.value or b"") for r in batch.records)
        return len(self.values) - len(batch.records)

    def answer(self, producer: Any, batches: list[ProducerBatch]) -> None:
        """Append each batch and answer the producer as the broker would, a refusal too."""
        for batch in batches:
            try:
                answer = pb.PartitionProduceResponse(
                    topic="t",
                    partition=0,
                    error_code=ErrorCode.NONE,
                    base_offset=self.append(batch),
                )
            except TidewaterError as e:
                answer = pb.PartitionProduceResponse(topic="t", partition=0, error_code=e.code)
            producer._completed(batch, answer)


def both_sent_appended_and_answered_not_leader(
    producer: producer_mod.Producer,
    sent: list[ProducerBatch],
    new_leader: NewLeader,
    created: tuple[float, float],
) -> tuple[ProducerBatch, ProducerBatch]:
    assert producer._accumulator is not None
    batches = [
        producer._accumulator.append(TP, Record(None, value, (), None), 100, at)[1]
        for value, at in zip((b"A", b"B"), created, strict=True)
    ]
    producer._drain(created[1])
    producer._drain(created[1])  # one batch per partition per drain: both in flight
    assert sent == batches
    for batch in batches:
        new_leader.append(batch)
        producer._completed(batch, NOT_LEADER)
    sent.clear()
    return batches[0], batches[1]


async def test_a_batch_expired_after_not_leader_leaves_the_next_one_numbered(
    sent: list[ProducerBatch], hand_driven_producer: Callable[..., Any], tmp_path: Path
) -> None:
    producer = hand_driven_producer(delivery_timeout_ms=120_000, request_timeout_ms=30_000)
    new_leader = NewLeader(tmp_path)
    t0 = time.monotonic()
    # B is created 60 s after A: when A passes delivery_timeout_ms, B has not.
    a, b = both_sent_appended_and_answered_not_leader(producer, sent, new_leader, (t0, t0 + 60))
    producer.metadata.leader = lambda tp: NEW_LEADER  # type: ignore[method-assign]
    now = t0 + 121
    for _ in range(2):  # A expires; B is sent again, to the new leader
        producer._sequences.settle()
        producer._drain(now)
    new_leader.answer(producer, sent)
    assert new_leader.values == [b"A", b"B"]
    assert b.error is None and b.base_offset == 1
    assert (b.producer_epoch, b.base_sequence, producer._sequences.bumps) == (0, 1, 0)
    assert isinstance(a.error, DeliveryTimeout)


async def test_a_batch_out_of_retries_after_not_leader_leaves_the_next_one_numbered(
    sent: list[ProducerBatch], hand_driven_producer: Callable[..., Any], tmp_path: Path
) -> None:
    producer = hand_driven_producer(retries=2)
    new_leader = NewLeader(tmp_path)
    t0 = time.monotonic()
    a, b = both_sent_appended_and_answered_not_leader(producer, sent, new_leader, (t0, t0))
    now = t0
    for _ in range(2):  # stale metadata: A's retries go to the old leader again
        now += 1
        producer._sequences.settle()
        producer._drain(now)
        assert sent == [a]
        sent.clear()
        producer._completed(a, NOT_LEADER)
    producer.metadata.leader = lambda tp: NEW_LEADER  # type: ignore[method-assign]
    producer._sequences.settle()
    producer._drain(now + 1)
    new_leader.answer(producer, sent)
    assert new_leader.values == [b"A", b"B"]
    assert b.error is None and b.base_offset == 1
    assert isinstance(a.error, NotLeaderOrFollower)
    assert "may be in the log" in str(a.error)


async def test_a_retry_the_new_leader_no_longer_remembers_is_not_written_again(
    sent: list[ProducerBatch], hand_driven_producer: Callable[..., Any], tmp_path: Path
) -> None:
    """Review 18 H1: X went to the old leader, which appended it (the new leader copied it)
    and hung. A refresh named the new leader, and the producer sent Y0..Y4 there while X was
    in flight: appended after X, acknowledged. X's stream timed out; its retry reached the
    new leader, whose last five batches no longer hold X: OUT_OF_ORDER_SEQUENCE. The producer
    took it for a gap, bumped its epoch and wrote X again after Y4. A later acknowledged batch
    proves X in the log: it completes, at an offset unknown."""
    producer = hand_driven_producer()
    new_leader = NewLeader(tmp_path)
    now = time.monotonic()

    def send(value: bytes) -> ProducerBatch:
        batch = producer._accumulator.append(TP, Record(None, value, (), None), 100, now)[1]
        producer._drain(now)
        assert sent == [batch]
        sent.clear()
        return batch

    x = send(b"X")
    new_leader.append(x)  # the old leader appended it; the new one copied it
    producer.metadata.leader = lambda tp: NEW_LEADER  # type: ignore[method-assign]
    ys = []
    for i in range(5):  # X and four more are as many as may be in flight
        ys.append(send(b"Y%d" % i))
        new_leader.answer(producer, ys[-1:])
    producer._transport_failed([x], "no answer from old-leader:1 within 35s")
    producer._sequences.settle()
    producer._drain(now + 1)
    assert sent == [x]
    new_leader.answer(producer, sent)
    sent.clear()
    assert x.done.done() and x.error is None
    producer._sequences.settle()
    producer._drain(now + 2)
    assert sent == []
    assert new_leader.values == [b"X", b"Y0", b"Y1", b"Y2", b"Y3", b"Y4"]
    assert producer._sequences.bumps == 0
    assert x.metadata(0).offset == UNKNOWN_OFFSET
    assert [y.metadata(0).offset for y in ys] == [1, 2, 3, 4, 5]


async def test_a_link_holding_as_many_requests_as_a_broker_reads_takes_no_more(
    sent: list[ProducerBatch], hand_driven_producer: Callable[..., Any]
) -> None:
    """Review 24 #7: a broker reads at most MAX_IN_FLIGHT_PER_STREAM requests of a stream at
    once; max_in_flight_requests_per_connection counts per partition, so a producer of many
    partitions sent more, which waited unread while their deadlines ran. A full link takes
    no new request until an answer frees it."""
    producer = hand_driven_producer()
    assert producer._accumulator is not None
    now = time.monotonic()
    producer._accumulator.append(TP, Record(None, b"A", (), None), 100, now)
    producer._drain(now)
    assert len(sent) == 1
    [link] = producer._links.values()
    link.full = True
    producer._accumulator.append(TP, Record(None, b"B", (), None), 100, now)
    producer._drain(now)
    assert len(sent) == 1
    link.full = False
    producer._drain(now)
    assert [r.value for batch in sent for r in batch.records] == [b"A", b"B"]
