"""The idempotent producer's sequence and epoch state machine, driven by hand: what it stamps,
what it lets through, and when it bumps the epoch (KIP-360)."""

from __future__ import annotations

import pytest

from tidewater.client.sequences import ProducerSequences
from tidewater.errors import RETRIABLE
from tidewater.records.header import MAX_PRODUCER_EPOCH, SEQUENCE_MAX
from tidewater.v1.errors_pb2 import ErrorCode

TP = ("t", 0)
OTHER = ("t", 1)
PID = 7


class Batch:
    def __init__(self, records: int = 10, tp: tuple[str, int] = TP) -> None:
        self.tp = tp
        self.record_count = records
        self.stamped: tuple[int, int, int] | None = None

    def stamp(self, producer_id: int, producer_epoch: int, base_sequence: int) -> None:
        self.stamped = (producer_id, producer_epoch, base_sequence)


@pytest.fixture
def seq() -> ProducerSequences:
    return ProducerSequences(PID, 0)


def send(seq: ProducerSequences, *batches: Batch) -> None:
    for batch in batches:
        assert seq.may_send(batch)
        seq.sending(batch)


def refuse(seq: ProducerSequences, batch: Batch, code: int) -> bool:
    return seq.retriable(batch, code, RETRIABLE)


def test_batches_are_numbered_per_partition_in_send_order(seq: ProducerSequences) -> None:
    a, b, c = Batch(3), Batch(5), Batch(2, OTHER)
    send(seq, a, b, c)
    assert (a.stamped, b.stamped, c.stamped) == ((PID, 0, 0), (PID, 0, 3), (PID, 0, 0))


def test_sequences_wrap_after_the_largest_int32(seq: ProducerSequences) -> None:
    first = Batch(SEQUENCE_MAX)
    send(seq, first)
    seq.acknowledged(first)
    wrapping, after = Batch(3), Batch(1)
    send(seq, wrapping, after)
    assert (wrapping.stamped, after.stamped) == ((PID, 0, SEQUENCE_MAX), (PID, 0, 2))


def test_a_retry_keeps_its_numbers_and_nothing_bumps(seq: ProducerSequences) -> None:
    a, b = Batch(), Batch()
    send(seq, a, b)
    assert refuse(seq, a, ErrorCode.NOT_LEADER_OR_FOLLOWER)
    # The batch behind it is refused for the gap a left: that resolves once a lands.
    assert refuse(seq, b, ErrorCode.OUT_OF_ORDER_SEQUENCE)
    assert seq.settle() == []
    send(seq, a)
    seq.acknowledged(a)
    send(seq, b)
    seq.acknowledged(b)
    assert (a.stamped, b.stamped, seq.epoch, seq.bumps) == ((PID, 0, 0), (PID, 0, 10), 0, 0)


def test_unknown_producer_id_bumps_the_epoch_and_renumbers_from_zero(
    seq: ProducerSequences,
) -> None:
    acked, lost, behind = Batch(), Batch(), Batch()
    send(seq, acked)
    seq.acknowledged(acked)
    send(seq, lost, behind)
    # The broker forgot the producer (its batches were deleted by retention).
    assert refuse(seq, lost, ErrorCode.UNKNOWN_PRODUCER_ID)
    assert not seq.may_send(lost)  # waits for the bump
    assert seq.settle() == []  # not while `behind` is in flight
    assert refuse(seq, behind, ErrorCode.UNKNOWN_PRODUCER_ID)
    assert seq.settle() == [lost, behind]
    assert seq.epoch == 1
    assert (lost.stamped, behind.stamped) == ((PID, 1, 0), (PID, 1, 10))
    send(seq, lost, behind)
    new = Batch()
    send(seq, new)
    assert new.stamped == (PID, 1, 20)


def test_a_gap_after_the_last_acknowledged_batch_bumps(seq: ProducerSequences) -> None:
    acked, next_batch = Batch(), Batch()
    send(seq, acked)
    seq.acknowledged(acked)
    send(seq, next_batch)
    # The broker lost acknowledged data (an unclean election): the sequence cannot go on.
    assert refuse(seq, next_batch, ErrorCode.OUT_OF_ORDER_SEQUENCE)
    assert seq.settle() == [next_batch]
    assert next_batch.stamped == (PID, 1, 0)


def test_a_batch_refused_for_good_renumbers_the_ones_behind_it(seq: ProducerSequences) -> None:
    bad, behind = Batch(), Batch()
    send(seq, bad, behind)
    assert not refuse(seq, bad, ErrorCode.MESSAGE_TOO_LARGE)
    seq.failed(bad)
    assert refuse(seq, behind, ErrorCode.OUT_OF_ORDER_SEQUENCE)
    assert seq.settle() == [behind]
    assert behind.stamped == (PID, 1, 0)


def test_the_bump_waits_for_unsettled_batches_below_the_gap(seq: ProducerSequences) -> None:
    unsure, bad, behind = Batch(), Batch(), Batch()
    send(seq, unsure, bad, behind)
    # `unsure` timed out: it may be in the log, so it is retried with its own numbers.
    assert refuse(seq, unsure, ErrorCode.REQUEST_TIMED_OUT)
    assert not refuse(seq, bad, ErrorCode.CORRUPT_MESSAGE)
    seq.failed(bad)
    assert refuse(seq, behind, ErrorCode.OUT_OF_ORDER_SEQUENCE)
    assert seq.settle() == []
    assert seq.may_send(unsure) and not seq.may_send(behind)
    send(seq, unsure)
    assert seq.settle() == []
    seq.acknowledged(unsure)
    assert seq.settle() == [behind]
    assert (unsure.stamped, behind.stamped) == ((PID, 0, 0), (PID, 1, 0))


def test_an_expired_batch_later_proven_written_needs_no_bump(seq: ProducerSequences) -> None:
    expired, behind = Batch(), Batch()
    send(seq, expired, behind)
    assert refuse(seq, expired, ErrorCode.REQUEST_TIMED_OUT)
    seq.failed(expired)  # delivery timeout: its fate is unknown
    new = Batch()
    assert not seq.may_send(new)
    seq.acknowledged(behind)  # so `expired` is in the log
    assert seq.settle() == []
    send(seq, new)
    assert (new.stamped, seq.bumps) == ((PID, 0, 20), 0)


def test_an_expired_batch_refused_after_bumps(seq: ProducerSequences) -> None:
    expired, behind = Batch(), Batch()
    send(seq, expired, behind)
    assert refuse(seq, expired, ErrorCode.REQUEST_TIMED_OUT)
    seq.failed(expired)
    # The broker never got it: the batch after it leaves a gap.
    assert refuse(seq, behind, ErrorCode.OUT_OF_ORDER_SEQUENCE)
    assert seq.settle() == [behind]
    assert behind.stamped == (PID, 1, 0)


def test_a_batch_answered_not_leader_that_fails_keeps_the_ones_behind_it_numbered(
    seq: ProducerSequences,
) -> None:
    # The old leader may have appended both before leadership moved (and the new leader
    # copied them): NOT_LEADER_OR_FOLLOWER leaves `failing` unresolved, not a gap.
    failing, behind = Batch(), Batch()
    send(seq, failing, behind)
    for batch in (failing, behind):
        assert refuse(seq, batch, ErrorCode.NOT_LEADER_OR_FOLLOWER)
    assert seq.failed(failing)  # retries or time ran out: it may be in the log
    assert seq.settle() == []
    assert seq.may_send(behind) and not seq.may_send(Batch())
    send(seq, behind)
    seq.acknowledged(behind)  # the new leader had it: a duplicate, answered with its offset
    assert (behind.stamped, seq.bumps) == ((PID, 0, 10), 0)


def test_a_batch_given_up_on_after_a_later_one_was_acknowledged_needs_no_bump(
    seq: ProducerSequences,
) -> None:
    # `failing`'s answer was lost; `behind` was acknowledged (the new leader had `failing`
    # copied), so `failing` is in the log, though its own retries run out after that.
    failing, behind = Batch(), Batch()
    send(seq, failing, behind)
    assert refuse(seq, failing, ErrorCode.REQUEST_TIMED_OUT)
    seq.acknowledged(behind)
    assert seq.failed(failing)
    assert seq.settle() == []
    new = Batch()
    send(seq, new)
    assert (new.stamped, seq.bumps) == ((PID, 0, 20), 0)


def test_a_batch_failed_while_in_flight_may_be_in_the_log(seq: ProducerSequences) -> None:
    # The producer closed before its answer came: its request may still append it.
    in_flight, behind = Batch(), Batch()
    send(seq, in_flight, behind)
    assert seq.failed(in_flight)
    seq.acknowledged(behind)  # proves it written: its sequence is not a gap
    assert seq.settle() == [] and seq.bumps == 0


def test_when_every_batch_expires_the_partition_moves_to_a_new_epoch(
    seq: ProducerSequences,
) -> None:
    first, second = Batch(), Batch()
    send(seq, first, second)
    for batch in (first, second):
        assert refuse(seq, batch, ErrorCode.REQUEST_TIMED_OUT)
        seq.failed(batch)
    new = Batch()
    assert not seq.may_send(new)
    assert seq.settle() == []
    send(seq, new)
    assert new.stamped == (PID, 1, 0)


def test_other_partitions_switch_epoch_once_their_batches_are_acknowledged(
    seq: ProducerSequences,
) -> None:
    lost, elsewhere = Batch(), Batch(tp=OTHER)
    send(seq, lost, elsewhere)
    assert refuse(seq, lost, ErrorCode.UNKNOWN_PRODUCER_ID)
    seq.settle()
    assert seq.epoch == 1
    # OTHER's broker still knows epoch 0: its batch in flight stays in it, and new batches
    # wait, so a sequence 0 of epoch 1 cannot overtake it.
    waiting = Batch(tp=OTHER)
    assert not seq.may_send(waiting)
    assert refuse(seq, elsewhere, ErrorCode.NOT_LEADER_OR_FOLLOWER)
    send(seq, elsewhere)
    assert elsewhere.stamped == (PID, 0, 0)
    seq.acknowledged(elsewhere)
    send(seq, waiting)
    assert waiting.stamped == (PID, 1, 0)


def test_an_exhausted_epoch_needs_a_new_producer_id() -> None:
    seq = ProducerSequences(PID, MAX_PRODUCER_EPOCH)
    lost = Batch()
    send(seq, lost)
    assert refuse(seq, lost, ErrorCode.UNKNOWN_PRODUCER_ID)
    assert seq.settle() == []
    assert seq.needs_producer_id and not seq.may_send(lost)
    seq.set_producer_id(PID + 1, 0)
    assert seq.settle() == [lost]
    assert lost.stamped == (PID + 1, 0, 0)


def test_a_batch_never_sent_holds_no_sequence(seq: ProducerSequences) -> None:
    seq.failed(Batch())  # expired in the queue
    new = Batch()
    send(seq, new)
    assert (new.stamped, seq.bumps) == ((PID, 0, 0), 0)


def test_nothing_is_sent_without_a_producer_id() -> None:
    seq = ProducerSequences()
    assert seq.needs_producer_id and not seq.may_send(Batch())


def test_the_halves_of_a_split_batch_take_its_numbers_and_the_batch_after_waits_for_them(
    seq: ProducerSequences,
) -> None:
    """Kafka's splitAndReenqueue: the broker refused `big` (sequences 0-9) as too large,
    before appending it; its halves go in its place, numbered 0-4 and 5-9. The batch sent
    after it is refused OUT_OF_ORDER_SEQUENCE (the broker lacks 0-9): a retry, not a gap,
    since the halves below it are unsettled; no bump."""
    big, after = Batch(10), Batch(3)
    send(seq, big, after)
    first, second = Batch(5), Batch(5)
    seq.split(big, [first, second])
    assert (first.stamped, second.stamped) == ((PID, 0, 0), (PID, 0, 5))
    assert refuse(seq, after, ErrorCode.OUT_OF_ORDER_SEQUENCE)
    send(seq, first, second)
    for batch in (first, second):
        seq.acknowledged(batch)
    assert seq.may_send(after) and seq.settle() == []
    send(seq, after)
    seq.acknowledged(after)
    assert (after.stamped, seq.bumps) == ((PID, 0, 10), 0)
