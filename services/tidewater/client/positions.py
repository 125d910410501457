"""The consumer's fetch positions and KIP-320's check of them after a leader change, as in
Kafka's consumer (SubscriptionState's FetchPosition, maybeValidatePositionForCurrentLeader and
maybeCompleteValidation): the rules, pure; the consumer sends OffsetForLeaderEpoch.

A position carries the leader epoch of the record before it. When the partition's leader or
leader epoch changes, the new leader may hold another history (an unclean election, or tails
lost unflushed on every replica): the consumer asks it where that epoch ends in its log before
fetching again, and an end below the position means records it read are not in the log."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tidewater.client.errors import LogTruncation
from tidewater.client.metadata import TopicPartition
from tidewater.errors import OffsetOutOfRange

NO_EPOCH = -1
# Kafka's auto.offset.reset values; "none" raises instead of resetting.
RESET_POLICIES = ("earliest", "latest", "none")

LeaderAndEpoch = tuple[int, int]  # (leader broker id, leader epoch)


@dataclass(frozen=True, slots=True)
class FetchPosition:
    """Where the consumer reads a partition next.

    offset_epoch: the leader epoch of the batch of the last record consumed (or the one
    ListOffsets gave with the offset); NO_EPOCH when unknown, after seek(), and a position
    without one is never validated. current_leader: the leader it was last fetched from or
    validated against; None before the first fetch."""

    offset: int
    offset_epoch: int = NO_EPOCH
    current_leader: LeaderAndEpoch | None = None

    @property
    def current_leader_epoch(self) -> int:
        """For requests' current_leader_epoch: NO_EPOCH (no fencing) when unknown."""
        return NO_EPOCH if self.current_leader is None else self.current_leader[1]


def for_current_leader(
    position: FetchPosition, leader: LeaderAndEpoch
) -> tuple[FetchPosition, bool]:
    """The position moved to `leader`, and whether it must be validated before the next
    fetch: the leader or its epoch changed, and the position has an epoch to check."""
    if position.current_leader == leader:
        return position, False
    return replace(position, current_leader=leader), position.offset_epoch != NO_EPOCH


def validated(
    tp: TopicPartition,
    position: FetchPosition,
    end_epoch: int,
    end_offset: int,
    auto_offset_reset: str,
) -> FetchPosition | None:
    """Where to fetch from once the leader answered OffsetForLeaderEpoch(position's epoch)
    with (end_epoch, end_offset), the largest epoch <= it in its log and where that ends:

    - end_offset >= the position: its log holds the position's history; the same position;
    - end_offset < the position: the log was truncated under the consumer. With a reset
      policy, the divergence point end_offset, as Kafka does; without, LogTruncation;
    - undefined (-1/-1): the leader knows no epoch as old. None: reset by the policy;
      without one OffsetOutOfRange (Kafka's handleOffsetOutOfRange)."""
    name = f"{tp[0]}-{tp[1]}"
    if end_epoch == NO_EPOCH or end_offset < 0:
        if auto_offset_reset == "none":
            raise OffsetOutOfRange(
                f"{name}: fetch position {position.offset} is out of range: the leader's log "
                f"has no epoch up to {position.offset_epoch}, and auto_offset_reset is 'none'"
            )
        return None
    if end_offset >= position.offset:
        return position
    if auto_offset_reset == "none":
        raise LogTruncation(tp, position.offset, end_offset)
    return FetchPosition(end_offset, end_epoch, position.current_leader)
