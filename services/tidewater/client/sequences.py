"""The idempotent producer's producer id, epoch and per-partition sequence numbers (the
idempotent half of Kafka's TransactionManager, with KIP-360's epoch bump). A pure state
machine: the sender tells it what it sends and what came back; it stamps batches and says
what may be sent and whether an error is worth a retry.

A partition's sequence state goes wrong in two ways, and both end in an epoch bump:
- a gap: a batch known not to be in the log will never be (it failed for good and every
  attempt was refused before the append, or the broker lost the producer's state:
  UNKNOWN_PRODUCER_ID, or a gap after the last acknowledged batch: OUT_OF_ORDER_SEQUENCE).
  The batches after it cannot be appended with their sequences.
- an unresolved sequence: a batch that may be in the log failed for good (time or retries ran
  out after an answer that may follow an append, such as NOT_LEADER_OR_FOLLOWER or a lost
  one, or time ran out while it was in flight). New batches wait until the batches sent after
  it settle: one acknowledged (before or after) proves it was written; otherwise its fate is
  unknown, and the partition moves on in a new epoch.

The bump waits until the partition has nothing in flight and nothing unacknowledged below the
gap, so every batch it renumbers is one the broker has refused: renumbered from sequence 0 in
a new epoch, it cannot duplicate a record already in the log, and a stray copy of its old
numbering is fenced by the new epoch. The epoch is bumped locally, as Kafka's idempotent
producer does (a broker takes any newer epoch that starts at 0); an exhausted epoch needs a
new producer id from InitProducerId. Other partitions keep their epoch until their own
batches are acknowledged, then start at 0 in the new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tidewater.records.header import (
    MAX_PRODUCER_EPOCH,
    NO_PRODUCER_EPOCH,
    NO_PRODUCER_ID,
    SEQUENCE_MAX,
)
from tidewater.v1.errors_pb2 import ErrorCode

TopicPartition = tuple[str, int]
# Errors our broker gives only before it appends the batch (validation, the ISR check, the
# producer state check): that attempt is known not to be in the log. Any other answer, a lost
# one included, may follow an append: NOT_LEADER_OR_FOLLOWER answers a batch the old leader
# appended when leadership moves before the HW covers it, and the new leader may hold it.
# The producer state's refusals of a batch's sequence: the broker lacks a batch before it
# (not landed yet, or lost), or no longer remembers the batch itself.
SEQUENCE_REFUSALS = frozenset({ErrorCode.UNKNOWN_PRODUCER_ID, ErrorCode.OUT_OF_ORDER_SEQUENCE})

REFUSED_BEFORE_APPEND = frozenset(
    {
        ErrorCode.CORRUPT_MESSAGE,
        ErrorCode.MESSAGE_TOO_LARGE,
        ErrorCode.UNSUPPORTED_COMPRESSION_TYPE,
        ErrorCode.UNSUPPORTED_VERSION,
        ErrorCode.INVALID_REQUEST,
        ErrorCode.INVALID_REQUIRED_ACKS,
        ErrorCode.NOT_ENOUGH_REPLICAS,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.UNKNOWN_TOPIC_ID,
        ErrorCode.UNKNOWN_PRODUCER_ID,
        ErrorCode.INVALID_PRODUCER_EPOCH,
        ErrorCode.OUT_OF_ORDER_SEQUENCE,
    }
)


class SequencedBatch(Protocol):
    """What the state machine needs of a producer batch."""

    @property
    def tp(self) -> TopicPartition: ...

    @property
    def record_count(self) -> int: ...

    def stamp(self, producer_id: int, producer_epoch: int, base_sequence: int) -> None:
        """Number the batch (again): its bytes must be built anew."""


@dataclass(eq=False, slots=True)
class _Entry:
    """A stamped batch not yet acknowledged or failed. `base` does not wrap."""

    batch: SequencedBatch
    base: int
    in_flight: bool = True
    maybe_appended: bool = False

    @property
    def end(self) -> int:
        return self.base + self.batch.record_count


@dataclass(slots=True)
class _Partition:
    producer_id: int
    epoch: int
    next_sequence: int = 0
    last_acked: int = -1
    # Stamped batches in sequence order.
    unacked: list[_Entry] = field(default_factory=list)
    # First sequence known not to be in the log: renumber from there in a new epoch.
    gap: int | None = None
    # The sequence after a batch that failed for good but may be in the log.
    unresolved: int | None = None

    def below(self, sequence: int) -> bool:
        return any(e.base < sequence for e in self.unacked)


class ProducerSequences:
    def __init__(self, producer_id: int = NO_PRODUCER_ID, epoch: int = NO_PRODUCER_EPOCH) -> None:
        self.producer_id = producer_id
        self.epoch = epoch
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._entries: dict[SequencedBatch, _Entry] = {}
        # Epoch bumps so far (for logs and tests).
        self.bumps = 0

    @property
    def needs_producer_id(self) -> bool:
        """Nothing is sent until set_producer_id() brings one (the first, or after the epoch
        ran out)."""
        return self.producer_id == NO_PRODUCER_ID

    def set_producer_id(self, producer_id: int, epoch: int) -> None:
        self.producer_id = producer_id
        self.epoch = epoch

    # -- sending ---------------------------------------------------------------------------

    def may_send(self, batch: SequencedBatch) -> bool:
        """Whether `batch`, at the head of its partition's queue, may go now."""
        if self.needs_producer_id:
            return False
        state = self._partitions.get(batch.tp)
        if state is None:
            return True
        entry = self._entries.get(batch)
        if entry is None:
            # A new batch waits for the partition's numbering to be known and current.
            stale = (state.producer_id, state.epoch) != (self.producer_id, self.epoch)
            return state.gap is None and state.unresolved is None and not (stale and state.unacked)
        return state.gap is None or entry.base < state.gap

    def sending(self, batch: SequencedBatch) -> None:
        """`batch` goes out now; a new one is numbered first."""
        entry = self._entries.get(batch)
        if entry is not None:
            entry.in_flight = True
            return
        state = self._partitions.get(batch.tp)
        if state is None or (state.producer_id, state.epoch) != (self.producer_id, self.epoch):
            state = self._partitions[batch.tp] = _Partition(self.producer_id, self.epoch)
        entry = _Entry(batch, state.next_sequence)
        state.next_sequence = entry.end
        state.unacked.append(entry)
        self._entries[batch] = entry
        batch.stamp(state.producer_id, state.epoch, entry.base % (SEQUENCE_MAX + 1))

    # -- answers ---------------------------------------------------------------------------

    def acknowledged(self, batch: SequencedBatch) -> None:
        entry = self._entries.pop(batch)
        state = self._partitions[batch.tp]
        state.unacked.remove(entry)
        state.last_acked = max(state.last_acked, entry.end - 1)
        if state.unresolved is not None and state.last_acked + 1 >= state.unresolved:
            # A batch after the unresolved one is in the log, so that one is too.
            state.unresolved = None

    def split(self, batch: SequencedBatch, parts: list[SequencedBatch]) -> None:
        """The broker refused `batch` before appending it (MESSAGE_TOO_LARGE): `parts`, its
        records in order, take its sequence numbers in its place (Kafka's
        splitAndReenqueue). Batches sent after it are refused OUT_OF_ORDER_SEQUENCE until
        the parts land, and retried then."""
        entry = self._entries.pop(batch)
        state = self._partitions[batch.tp]
        entries = []
        base = entry.base
        for part in parts:
            part_entry = _Entry(part, base, in_flight=False, maybe_appended=entry.maybe_appended)
            self._entries[part] = part_entry
            entries.append(part_entry)
            part.stamp(state.producer_id, state.epoch, base % (SEQUENCE_MAX + 1))
            base = part_entry.end
        index = state.unacked.index(entry)
        state.unacked[index : index + 1] = entries

    def in_the_log(self, batch: SequencedBatch) -> bool:
        """Whether a later batch of its partition's sequence is acknowledged: a broker appends
        a producer's batches in sequence order only, so `batch` is in the log, though its
        leader may no longer remember it (past the last five batches a partition keeps)."""
        return self._entries[batch].end - 1 <= self._partitions[batch.tp].last_acked

    def retriable(self, batch: SequencedBatch, code: int, retriable_codes: frozenset[int]) -> bool:
        """The broker refused `batch` with `code` (or the answer was lost:
        REQUEST_TIMED_OUT): whether to send it again, maybe after a bump."""
        entry = self._entries[batch]
        entry.in_flight = False
        if code not in REFUSED_BEFORE_APPEND:
            entry.maybe_appended = True
        state = self._partitions[batch.tp]
        if code in SEQUENCE_REFUSALS:
            # With an earlier batch still unsettled, the refusal may only mean that one has
            # not landed yet: it is retried first. Otherwise the sequence cannot go on.
            if not state.below(entry.base):
                self._gap(state, entry.base)
            return True
        return code in retriable_codes

    def failed(self, batch: SequencedBatch) -> bool:
        """`batch` failed for good (retries or time ran out, or a fatal error); returns
        whether it may be in the log all the same (its outcome is unknown)."""
        entry = self._entries.pop(batch, None)
        if entry is None:
            return False  # never sent: it holds no sequence
        state = self._partitions[batch.tp]
        state.unacked.remove(entry)
        # Still in flight (the producer closed before the answer): it may be appended yet.
        maybe_appended = entry.maybe_appended or entry.in_flight
        if maybe_appended:
            self._unresolved(state, entry)
        else:
            self._gap(state, entry.base)
        return maybe_appended

    def expired(self, batch: SequencedBatch) -> None:
        """`batch` was given up on while in flight (delivery timeout): its request may still
        append it. It stays in flight until its answer (acknowledged() or failed()); new
        batches wait for that (Kafka's markSequenceUnresolved for an expired batch)."""
        self._unresolved(self._partitions[batch.tp], self._entries[batch])

    def _unresolved(self, state: _Partition, entry: _Entry) -> None:
        """`entry` may be in the log: the batches after it keep their numbers (Kafka's
        markSequenceUnresolved), as the broker may hold them too."""
        if state.last_acked + 1 < entry.end:
            state.unresolved = max(state.unresolved or 0, entry.end)
        # Otherwise a batch after it is acknowledged already, so it is in the log: nothing is
        # unresolved (Kafka's maybeResolveSequences finds the next sequence acknowledged).

    # -- the bump --------------------------------------------------------------------------

    def settle(self) -> list[SequencedBatch]:
        """Resolve what can be resolved and renumber partitions whose bump is due; returns the
        renumbered batches (their bytes must be rebuilt). Call before each drain."""
        renumbered: list[SequencedBatch] = []
        for state in self._partitions.values():
            if state.unresolved is not None and not state.unacked:
                # Every batch after the unresolved one failed too: its fate stays unknown.
                self._gap(state, state.unresolved)
            gap = state.gap
            if gap is None or state.below(gap) or any(e.in_flight for e in state.unacked):
                continue
            if (state.producer_id, state.epoch) == (self.producer_id, self.epoch):
                self._bump()
            if self.needs_producer_id:
                break
            state.producer_id, state.epoch = self.producer_id, self.epoch
            state.gap = state.unresolved = None
            state.last_acked = -1
            state.next_sequence = 0
            for entry in state.unacked:
                entry.base = state.next_sequence
                entry.maybe_appended = False
                state.next_sequence = entry.end
                entry.batch.stamp(state.producer_id, state.epoch, entry.base % (SEQUENCE_MAX + 1))
                renumbered.append(entry.batch)
        return renumbered

    def _gap(self, state: _Partition, sequence: int) -> None:
        state.gap = sequence if state.gap is None else min(state.gap, sequence)

    def _bump(self) -> None:
        self.bumps += 1
        if self.epoch >= MAX_PRODUCER_EPOCH:
            # The epoch ran out: a new id from InitProducerId.
            self.producer_id, self.epoch = NO_PRODUCER_ID, NO_PRODUCER_EPOCH
        else:
            self.epoch += 1
