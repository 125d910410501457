"""The idempotent producer's sender when a batch fails for good after an answer that may follow
an append (NOT_LEADER_OR_FOLLOWER: the old leader appended it, then leadership moved before
the HW covered it, and the new leader had copied it). The real sender (_drain, _completed,
settle) against a fake link; the new leader is the broker's real producer state over a list
standing in for its log. Each record must be in that log once, and the batch behind the failed
one acknowledged at its first offset, not renumbered in a new epoch and written again."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidewater.broker.producer_state import ProducerStateManager
from tidewater.client import producer as producer_mod
from tidewater.client.accumulator import ProducerBatch
from tidewater.client.errors import DeliveryTimeout
from tidewater.errors import NotLeaderOrFollower
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
        for batch in batches:
            offset = self.append(batch)
            producer._completed(
                batch,
                pb.PartitionProduceResponse(
                    topic="t", partition=0, error_code=ErrorCode.NONE, base_offset=offset
                ),
            )


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
