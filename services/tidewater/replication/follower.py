"""A follower's decisions on what its leader tells it: where to truncate, and what to do when
its fetch offset is out of the leader's range. Pure functions of the two logs' offsets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from tidewater.replication.partition import (
    NO_EPOCH,
    EpochHistory,
    FollowerFetch,
    Partition,
    ReplicaLog,
)
from tidewater.replication.replica import UNKNOWN_OFFSET


class FollowerLog(ReplicaLog, Protocol):
    """The truncations a follower performs on what its leader sends (its appends are the
    fetcher's, which may write off the event loop)."""

    def truncate_to(self, offset: int) -> None: ...

    def truncate_fully_and_start_at(self, offset: int) -> None: ...

    def advance_log_start(self, offset: int) -> None: ...


# A NamedTuple, not a frozen dataclass (about three times as dear to make): one per partition of
# every fetch answer.
class FetchedPartition(NamedTuple):
    """One partition of a fetch response, on the follower. Errors are the fetcher's concern."""

    high_watermark: int
    diverging_epoch: tuple[int, int] | None
    records: Any  # whole batches as the leader's log serves them; empty when none


@dataclass(frozen=True)
class TruncateTo:
    offset: int


@dataclass(frozen=True)
class TruncateFullyAndStartAt:
    offset: int


@dataclass(frozen=True)
class StopReplicating:
    """Truncation would lose data the controller did not allow to lose: stop fetching this
    partition and say so loudly, as Kafka does without unclean leader election."""

    reason: str


OutOfRangeAction = TruncateTo | TruncateFullyAndStartAt | StopReplicating


def truncation_offset(
    local_epochs: EpochHistory, local_end_offset: int, diverging_epoch: tuple[int, int]
) -> int:
    """Where to truncate when the leader reports (epoch, end offset) of our diverging history
    (Kafka's getOffsetTruncationState). If our own largest epoch <= theirs is smaller, we
    truncate to its end and the next fetch, naming that epoch, checks again (KIP-279)."""
    leader_epoch, leader_end_offset = diverging_epoch
    if leader_end_offset == UNKNOWN_OFFSET:
        # The leader knows no end for our epoch: nothing says where we diverge (Kafka keeps
        # the fetch offset).
        return local_end_offset
    if leader_epoch == NO_EPOCH:
        return min(leader_end_offset, local_end_offset)
    follower_epoch, follower_end_offset = local_epochs.end_offset_for(
        leader_epoch, local_end_offset
    )
    if follower_epoch == NO_EPOCH:
        return min(leader_end_offset, local_end_offset)
    if follower_epoch != leader_epoch:
        return min(follower_end_offset, local_end_offset)
    return min(leader_end_offset, follower_end_offset, local_end_offset)


def on_offset_out_of_range(
    name: str,
    local_end_offset: int,
    leader_end_offset: int,
    leader_start_offset: int,
    unclean_leader_election_enable: bool,
) -> OutOfRangeAction | None:
    """Kafka's handleOffsetOutOfRange. None: our LEO is in range after all; fetch again."""
    if leader_end_offset < local_end_offset:
        if not unclean_leader_election_enable:
            return StopReplicating(
                f"{name}: the leader's log ends at {leader_end_offset}, before this replica's "
                f"{local_end_offset}; truncating would lose data and "
                "unclean.leader.election.enable is false"
            )
        return TruncateTo(leader_end_offset)
    if leader_start_offset > local_end_offset:
        return TruncateFullyAndStartAt(leader_start_offset)
    return None


def next_fetch(partition: Partition, topic_id: bytes = b"") -> FollowerFetch:
    """What a follower asks its leader for: from its LEO, naming the epoch of its last batch
    so the leader can spot a diverging history, its view of the leader epoch (KIP-320), and
    the topic id its log holds (KIP-516)."""
    return FollowerFetch(
        replica_id=partition.local_broker_id,
        fetch_offset=partition.log.log_end_offset,
        log_start_offset=partition.log.log_start_offset,
        last_fetched_epoch=partition.log.leader_epoch_cache.latest_epoch,
        current_leader_epoch=partition.leader_epoch,
        topic_id=topic_id,
    )


def truncate_if_diverged(partition: Partition, log: FollowerLog, fetched: FetchedPartition) -> bool:
    """Truncate to where a diverging history agrees, and say so. Truncation is decided by
    leader epochs, never by the HW. Otherwise (False) the follower appends what the leader
    sent, then takes its HW (Partition.update_follower_high_watermark caps it by our LEO)."""
    if fetched.diverging_epoch is None:
        return False
    log.truncate_to(
        truncation_offset(log.leader_epoch_cache, log.log_end_offset, fetched.diverging_epoch)
    )
    partition.after_truncation()
    return True


def follow_leader_log_start(
    partition: Partition, log: FollowerLog, leader_log_start_offset: int
) -> None:
    """After a fetch answer: the follower lets go of what its leader let go of (retention), up
    to its own HW, as Kafka's follower does (maybeIncrementLogStartOffset with the leader's
    log start offset). Else its log start would follow its own retention only, and the
    earliest offset could move back when it leads."""
    new_start = min(leader_log_start_offset, partition.high_watermark)
    if new_start > log.log_start_offset:
        log.advance_log_start(new_start)


def apply_out_of_range(partition: Partition, log: FollowerLog, action: OutOfRangeAction) -> None:
    """Carry out a truncation decided by on_offset_out_of_range."""
    if isinstance(action, TruncateTo):
        log.truncate_to(action.offset)
    elif isinstance(action, TruncateFullyAndStartAt):
        log.truncate_fully_and_start_at(action.offset)
    partition.after_truncation()
