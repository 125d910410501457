"""Kafka's Partition rules, one at a time (the ideas of PartitionTest / ReplicaManagerTest).

Broker 1 is the leader unless a test says otherwise; 2 and 3 are its followers."""

from __future__ import annotations

from typing import cast

import pytest

from tests.replication.in_memory import MemoryLog
from tidewater.broker.log.checkpoints import EpochEntry
from tidewater.errors import (
    FencedLeaderEpoch,
    NotEnoughReplicas,
    NotLeaderOrFollower,
    OffsetOutOfRange,
    TidewaterError,
    UnknownLeaderEpoch,
)
from tidewater.replication.follower import (
    StopReplicating,
    TruncateFullyAndStartAt,
    TruncateTo,
    apply_out_of_range,
    follow_leader_log_start,
    on_offset_out_of_range,
    truncation_offset,
)
from tidewater.replication.partition import (
    ACKS_ALL,
    NO_BROKER_EPOCH,
    NO_EPOCH,
    AlterIsrProposal,
    FollowerFetch,
    FollowerFetchOutcome,
    LeaderAndIsr,
    Partition,
    ReplicationConfig,
    UsableBrokerEpoch,
)
from tidewater.replication.replica import UNKNOWN_OFFSET, FetchClock, Replica
from tidewater.v1.errors_pb2 import ErrorCode

T0 = 1_000_000
LAG = 10_000
CONFIG = ReplicationConfig(replica_lag_time_max_ms=LAG, min_insync_replicas=2)
# For rules where an ISR of one member must advance the HW.
MIN_ISR_1 = ReplicationConfig(replica_lag_time_max_ms=LAG, min_insync_replicas=1)
REPLICAS = (1, 2, 3)
# The broker epochs of an ISR proposal whose followers fetched without one.
NO_EPOCHS = (NO_BROKER_EPOCH,) * 3
TOPIC = "orders"


def leader_and_isr(
    leader: int = 1,
    leader_epoch: int = 0,
    isr: tuple[int, ...] = REPLICAS,
    partition_epoch: int = 0,
) -> LeaderAndIsr:
    return LeaderAndIsr(leader, leader_epoch, isr, REPLICAS, partition_epoch)


def log_with(*epochs: int) -> MemoryLog:
    """A log holding one single-record batch per epoch given, from offset 0."""
    log = MemoryLog()
    for offset, epoch in enumerate(epochs):
        log.append_as_leader([f"r{offset}"], epoch)
    return log


def replica_on(
    log: MemoryLog,
    broker_id: int = 1,
    checkpointed_hw: int = 0,
    usable_broker_epoch: UsableBrokerEpoch = lambda broker_id: 0,
    config: ReplicationConfig = CONFIG,
) -> Partition:
    return Partition(TOPIC, 0, broker_id, log, config, checkpointed_hw, usable_broker_epoch)


def new_leader(
    log: MemoryLog,
    isr: tuple[int, ...] = REPLICAS,
    leader_epoch: int = 0,
    checkpointed_hw: int = 0,
    usable_broker_epoch: UsableBrokerEpoch = lambda broker_id: 0,
    config: ReplicationConfig = CONFIG,
) -> Partition:
    partition = replica_on(log, 1, checkpointed_hw, usable_broker_epoch, config)
    partition.make_leader(leader_and_isr(1, leader_epoch, isr), T0)
    return partition


def fetch(
    partition: Partition,
    replica_id: int,
    offset: int,
    now: int = T0,
    last_fetched_epoch: int = NO_EPOCH,
    current_leader_epoch: int | None = None,
    broker_epoch: int = 0,
    clock: FetchClock | None = None,
) -> FollowerFetchOutcome:
    epoch = partition.leader_epoch if current_leader_epoch is None else current_leader_epoch
    request = FollowerFetch(replica_id, offset, 0, last_fetched_epoch, epoch, broker_epoch)
    return partition.on_follower_fetch(request, now, clock)


def append(partition: Partition, count: int, now: int = T0) -> bool:
    log = cast("MemoryLog", partition.log)
    for _ in range(count):
        log.append_as_leader(["x"], partition.leader_epoch)
    return partition.after_leader_append(now)


def commit(partition: Partition, proposal: AlterIsrProposal, now: int = T0) -> bool:
    """The controller accepts the proposal."""
    committed = leader_and_isr(
        1, proposal.leader_epoch, proposal.new_isr, proposal.partition_epoch + 1
    )
    return partition.on_alter_isr_result(proposal, committed, None, now)


def refuse(
    partition: Partition,
    proposal: AlterIsrProposal,
    now: int = T0,
    code: int = ErrorCode.INELIGIBLE_REPLICA,
) -> bool:
    """The controller answers with an error (by default: checked and not applied), or the
    broker gets no answer at all."""
    error = TidewaterError("the ISR change was not committed", code)
    return partition.on_alter_isr_result(proposal, None, error, now)


@pytest.fixture
def log() -> MemoryLog:
    return log_with(*[0] * 10)


# -- ISR expansion ------------------------------------------------------------------------


def test_follower_joins_the_isr_once_its_leo_reaches_the_hw(log: MemoryLog) -> None:
    partition = new_leader(log, isr=(1, 2))
    fetch(partition, 2, 10)
    assert partition.high_watermark == 10
    assert fetch(partition, 3, 4).isr_proposal is None
    proposal = fetch(partition, 3, 10).isr_proposal
    assert proposal == AlterIsrProposal(
        TOPIC,
        0,
        leader_epoch=0,
        new_isr=(1, 2, 3),
        partition_epoch=0,
        new_isr_broker_epochs=NO_EPOCHS,
    )
    assert partition.isr == {1, 2}, "the ISR changes only when the controller commits it"
    assert commit(partition, proposal) is False
    assert (partition.isr, partition.partition_epoch) == ({1, 2, 3}, 1)


def test_follower_joins_only_once_it_reaches_the_current_leader_epoch(
    log: MemoryLog,
) -> None:
    # A new leader whose HW (6) lags its LEO (10): offsets 6..9 were written under an older
    # leader and may not be on the follower as they are here.
    partition = new_leader(log, isr=(1, 2), leader_epoch=1, checkpointed_hw=6)
    assert (partition.high_watermark, partition.leader_epoch_start_offset) == (6, 10)
    assert fetch(partition, 3, 8).isr_proposal is None
    proposal = fetch(partition, 3, 10).isr_proposal
    assert proposal is not None and proposal.new_isr == (1, 2, 3)


def test_isr_not_expanded_for_a_fenced_or_shutting_down_replica(log: MemoryLog) -> None:
    fenced = {3}
    partition = new_leader(
        log, isr=(1, 2), usable_broker_epoch=lambda b: None if b in fenced else 0
    )
    fetch(partition, 2, 10)
    assert fetch(partition, 3, 10).isr_proposal is None
    fenced.clear()  # it registered again
    proposal = fetch(partition, 3, 10).isr_proposal
    assert proposal is not None and proposal.new_isr == (1, 2, 3)


def test_isr_not_expanded_for_an_incarnation_other_than_the_registered_one(
    log: MemoryLog,
) -> None:
    """KIP-903: broker 3 registered again at epoch 30 (it may have lost its unflushed tail).
    Fetches of its old incarnation (20), or without an epoch, do not let it in, however caught
    up; nor do the new one's (40) while the leader's metadata still has another."""
    known = {2: 12, 3: 30}
    partition = new_leader(log, isr=(1, 2), usable_broker_epoch=known.get)
    fetch(partition, 2, 10, broker_epoch=12)
    for stale in (20, 0, 40):
        assert fetch(partition, 3, 10, broker_epoch=stale).isr_proposal is None, stale
    # The leader's metadata and the follower's fetches agree: it joins, and the proposal
    # names the epochs the members fetched with (none for the leader itself).
    proposal = fetch(partition, 3, 10, broker_epoch=30).isr_proposal
    assert proposal is not None
    assert (proposal.new_isr, proposal.new_isr_broker_epochs) == ((1, 2, 3), (-1, 12, 30))


def test_a_follower_that_has_not_caught_up_since_registering_again_is_out_of_sync(
    log: MemoryLog,
) -> None:
    """Broker 3 was caught up at T0 (epoch 20), then restarted: its new incarnation (epoch 30)
    fetches from 4, having lost its tail. What the old one fetched no longer counts: it is out
    of sync at once, not a lag time after T0, and its next shrink drops it."""
    partition = new_leader(log, isr=(1, 2, 3))
    fetch(partition, 3, 10, broker_epoch=20)
    fetch(partition, 2, 10, now=T0 + 1000, broker_epoch=12)
    assert partition.out_of_sync_replicas(T0 + 1000) == frozenset()
    fetch(partition, 3, 4, now=T0 + 1000, broker_epoch=30)
    replica = partition.remote_replicas[3]
    assert (replica.broker_epoch, replica.log_end_offset, replica.last_caught_up_time_ms) == (
        30,
        4,
        0,
    )
    assert partition.out_of_sync_replicas(T0 + 1000) == {3}
    shrink = partition.maybe_shrink_isr(T0 + 1000)
    assert shrink is not None
    assert (shrink.new_isr, shrink.new_isr_broker_epochs) == ((1, 2), (-1, 12))


def test_a_fetch_between_two_registrations_is_not_a_new_incarnation(log: MemoryLog) -> None:
    """Broker 3 (epoch 20), told by a heartbeat answer to register again, fetches at epoch 0
    meanwhile: the same process and log, whose state the leader keeps (it stays in sync).
    A later restart, at epoch 30, is still a new incarnation."""
    partition = new_leader(log, isr=(1, 2, 3))
    fetch(partition, 3, 10, broker_epoch=20)  # caught up at T0
    append(partition, 2, now=T0 + 500)
    fetch(partition, 3, 10, now=T0 + 1000, broker_epoch=0)
    replica = partition.remote_replicas[3]
    assert (replica.log_end_offset, replica.last_caught_up_time_ms) == (10, T0)
    assert partition.out_of_sync_replicas(T0 + 1000) == frozenset()
    fetch(partition, 3, 4, now=T0 + 2000, broker_epoch=30)
    assert (replica.log_end_offset, replica.last_caught_up_time_ms) == (4, 0)


def test_only_one_isr_change_in_flight(log: MemoryLog) -> None:
    partition = new_leader(log, isr=(1, 2))
    expand = fetch(partition, 3, 10).isr_proposal
    assert expand is not None
    # 2 has not fetched within the lag time, but the expansion is still in flight.
    late = T0 + LAG + 1
    assert partition.out_of_sync_replicas(late) == {2}
    assert partition.maybe_shrink_isr(late) is None
    assert fetch(partition, 3, 10, late).isr_proposal is None
    commit(partition, expand, late)
    shrink = partition.maybe_shrink_isr(late)
    assert shrink == AlterIsrProposal(
        TOPIC,
        0,
        leader_epoch=0,
        new_isr=(1, 3),
        partition_epoch=1,
        new_isr_broker_epochs=NO_EPOCHS[:2],
    )


def test_an_isr_change_the_controller_did_not_apply_keeps_the_committed_isr_and_is_proposed_again(
    log: MemoryLog,
) -> None:
    partition = new_leader(log)
    fetch(partition, 2, 10)
    proposal = partition.maybe_shrink_isr(T0 + LAG + 1)
    assert proposal is not None and proposal.new_isr == (1, 2)
    refuse(partition, proposal, T0 + LAG + 1)
    assert partition.isr == {1, 2, 3}
    assert not partition.isr_state.in_flight
    assert not partition.awaits_answer(proposal)
    assert partition.maybe_shrink_isr(T0 + LAG + 2) == proposal


@pytest.mark.parametrize(
    "code",
    [
        ErrorCode.INVALID_UPDATE_VERSION,
        ErrorCode.FENCED_LEADER_EPOCH,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.NONE,  # committed, but in a newer leader epoch
    ],
    ids=ErrorCode.Name,
)
def test_an_isr_change_refused_for_a_stale_state_stays_pending_until_a_leader_and_isr(
    log: MemoryLog, code: int
) -> None:
    """Review 22 L1, Kafka's handleAlterPartitionError: the leader proposed {1, 2, 3}; the
    controller committed it, its answer was lost, and it then fenced broker 2 (ISR {1, 3},
    a new leader epoch; its LeaderAndIsr still on the way). The proposal's retry is refused
    FENCED_LEADER_EPOCH. Dropping it left the HW counting {1, 2}, without 3, a member the
    controller could elect: a lagging 3 let the HW pass its LEO. It stays pending, not sent
    again, until the LeaderAndIsr."""
    partition = new_leader(log, isr=(1, 2))
    fetch(partition, 2, 10)
    expand = fetch(partition, 3, 10).isr_proposal
    assert expand is not None and expand.new_isr == (1, 2, 3)
    if code == ErrorCode.NONE:
        newer = leader_and_isr(1, 1, (1, 3), partition_epoch=2)
        assert partition.on_alter_isr_result(expand, newer, None, T0 + 1) is False
    else:
        refuse(partition, expand, T0 + 1, code)
    assert not partition.awaits_answer(expand), "not sent again"
    assert partition.isr_state.maximal_isr == {1, 2, 3}
    append(partition, 5, T0 + 2)
    fetch(partition, 2, 15, T0 + 2)
    assert partition.high_watermark == 10, "3 may be in the ISR: it holds the HW"
    assert partition.maybe_shrink_isr(T0 + LAG + 3) is None, "one change in flight"
    partition.make_leader(leader_and_isr(1, 1, (1, 3), partition_epoch=2), T0 + 3)
    assert (partition.isr, partition.isr_state.in_flight) == ({1, 3}, False)


@pytest.mark.parametrize(
    "code", [ErrorCode.INVALID_UPDATE_VERSION, ErrorCode.FENCED_LEADER_EPOCH], ids=ErrorCode.Name
)
def test_a_refusal_against_a_state_no_newer_than_ours_is_sent_again(
    log: MemoryLog, code: int
) -> None:
    """Review 24 #5: a controller deposed without knowing it yet refused the proposal against
    its old state; the leader waited for a LeaderAndIsr that its successor had sent already,
    and the proposal stayed pending for good. A refusal naming a state no newer than ours is
    no news: the proposal goes again (to the controller that answers next)."""
    partition = new_leader(log, leader_epoch=3)
    fetch(partition, 2, 10)
    shrink = partition.maybe_shrink_isr(T0 + LAG + 1)
    assert shrink is not None
    deposed = leader_and_isr(1, 2, REPLICAS, partition_epoch=0)
    error = TidewaterError("refused", code)
    partition.on_alter_isr_result(shrink, deposed, error, T0 + LAG + 1)
    assert partition.awaits_answer(shrink), "to be sent again"
    newer = leader_and_isr(1, 3, (1, 2), partition_epoch=4)
    partition.on_alter_isr_result(shrink, newer, error, T0 + LAG + 1)
    assert not partition.awaits_answer(shrink) and partition.isr_state.in_flight


@pytest.mark.parametrize(
    "code",
    [
        ErrorCode.REQUEST_TIMED_OUT,  # the RPC's deadline, or etcd's
        ErrorCode.NOT_CONTROLLER,  # a failover, possibly after the commit
        ErrorCode.STALE_BROKER_EPOCH,
        ErrorCode.UNKNOWN_SERVER_ERROR,  # no answer for the partition; the connection lost
    ],
    ids=ErrorCode.Name,
)
def test_isr_change_with_an_unknown_outcome_stays_pending_until_a_retry_is_answered(
    log: MemoryLog, code: int
) -> None:
    partition = new_leader(log, isr=(1, 2))
    fetch(partition, 2, 10)
    expand = fetch(partition, 3, 10).isr_proposal
    assert expand is not None and expand.new_isr == (1, 2, 3)
    # The controller commits {1, 2, 3} at partition epoch 1; its answer is lost.
    controller = leader_and_isr(1, 0, (1, 2, 3), partition_epoch=1)
    refuse(partition, expand, T0 + 1, code)
    assert partition.awaits_answer(expand), "to be sent again"
    assert partition.isr_state.maximal_isr == set(controller.isr)
    # Meanwhile 3 lags: an acks=all write may not count as committed without it.
    append(partition, 5, T0 + 2)
    fetch(partition, 2, 15, T0 + 2)
    assert partition.high_watermark == 10
    assert partition.enough_replicas_for(15) is None
    assert fetch(partition, 3, 10, T0 + LAG).isr_proposal is None, "one change in flight"
    assert partition.maybe_shrink_isr(T0 + LAG) is None
    # The retry reaches the controller, which answers with its committed state.
    assert partition.on_alter_isr_result(expand, controller, None, T0 + LAG) is False
    assert (partition.isr, partition.partition_epoch) == ({1, 2, 3}, controller.partition_epoch)
    assert not partition.awaits_answer(expand)
    assert fetch(partition, 3, 15, T0 + LAG).high_watermark_changed
    assert partition.high_watermark == 15


def test_answer_to_a_superseded_proposal_is_ignored(log: MemoryLog) -> None:
    partition = new_leader(log)
    proposal = partition.maybe_shrink_isr(T0 + LAG + 1)
    assert proposal is not None
    # The controller elected us again in a new epoch before answering.
    partition.make_leader(leader_and_isr(1, 1, REPLICAS, 1), T0 + LAG + 1)
    assert commit(partition, proposal, T0 + LAG + 1) is False
    assert (partition.isr, partition.partition_epoch) == ({1, 2, 3}, 1)


# -- ISR shrink ---------------------------------------------------------------------------


def test_isr_shrinks_after_the_lag_time_without_catching_up_and_not_before(
    log: MemoryLog,
) -> None:
    partition = new_leader(log)
    fetch(partition, 2, 10)
    fetch(partition, 3, 10)
    append(partition, 1)
    fetch(partition, 2, 11, T0 + LAG)
    assert partition.maybe_shrink_isr(T0 + LAG) is None
    proposal = partition.maybe_shrink_isr(T0 + LAG + 1)
    assert proposal is not None and proposal.new_isr == (1, 2)


def test_follower_keeping_up_with_its_previous_fetch_stays_in_the_isr(log: MemoryLog) -> None:
    partition = new_leader(log, isr=(1, 2))
    fetch(partition, 2, 10)
    leo_at_last_fetch = 10
    now = T0
    while now < T0 + 3 * LAG:
        append(partition, 1, now)
        now += 1000
        fetch(partition, 2, leo_at_last_fetch, now)
        leo_at_last_fetch = log.log_end_offset
    assert partition.remote_replicas[2].log_end_offset < log.log_end_offset
    assert partition.maybe_shrink_isr(now) is None


def test_follower_at_the_leader_leo_stays_in_the_isr_however_long_it_is_quiet(
    log: MemoryLog,
) -> None:
    partition = new_leader(log)
    fetch(partition, 2, 10)
    fetch(partition, 3, 10)
    assert partition.maybe_shrink_isr(T0 + 100 * LAG) is None


# -- quiet followers (a fetch session's partitions left alone while nothing changes) ---------


def times(replica: Replica) -> tuple[int, int, int, int]:
    return (
        replica.log_end_offset,
        replica.last_fetch_leader_log_end_offset,
        replica.last_fetch_time_ms,
        replica.last_caught_up_time_ms,
    )


def test_a_quiet_followers_fetches_count_as_if_each_were_processed() -> None:
    """Follower 2 fetches at the LEO at T0, T0+500, T0+1000; the leader appends at T0+1200;
    2 fetches from the old LEO at T0+1500. Processed one by one (as Kafka does), or in a
    session where only the first is processed and the others only move the session's clock:
    the leader's view of 2 is the same at every step, and so is every ISR shrink decision."""
    processed = new_leader(log_with(*[0] * 10))
    quiet = new_leader(log_with(*[0] * 10))
    clock = FetchClock()
    for now in (T0, T0 + 500, T0 + 1000):
        fetch(processed, 2, 10, now)
        fetch(processed, 3, 10, now)
        clock.now_ms = now
        if now == T0:
            fetch(quiet, 2, 10, now, clock=clock)
            fetch(quiet, 3, 10, now, clock=clock)  # the HW moves: 2 is woken
            fetch(quiet, 2, 10, now, clock=clock)
            clock.unsettled.clear()  # the session settles them (ReplicaManager)
        assert quiet.quiet_in(2, clock) and quiet.quiet_in(3, clock)
    assert quiet.remote_replicas[2].last_fetch_time_ms == T0  # not told of each fetch...
    for partition in (processed, quiet):
        append(partition, 1, T0 + 1200)
    # ...but the append wakes it with the session's time: the last fetch that found it caught up.
    assert times(quiet.remote_replicas[2]) == times(processed.remote_replicas[2])
    assert times(quiet.remote_replicas[2]) == (10, 10, T0 + 1000, T0 + 1000)
    assert not quiet.quiet_in(2, clock)
    assert clock.unsettled == {(TOPIC, 0)}  # processed at the session's next fetch
    for partition in (processed, quiet):
        fetch(partition, 2, 10, T0 + 1500, clock=clock if partition is quiet else None)
    assert times(quiet.remote_replicas[2]) == times(processed.remote_replicas[2])
    assert not quiet.quiet_in(2, clock), "behind the LEO: processed at every fetch"
    for now in (T0 + 1000 + LAG, T0 + 1000 + LAG + 1):
        assert quiet.maybe_shrink_isr(now) == processed.maybe_shrink_isr(now)
    shrink = quiet.maybe_shrink_isr(T0 + 1001 + LAG)
    assert shrink is None, "one in flight already"


def test_an_isr_or_leader_change_wakes_quiet_followers(log: MemoryLog) -> None:
    partition = new_leader(log)
    clock = FetchClock()
    clock.now_ms = T0 + 700
    for follower in (2, 3, 2):  # 3's fetch moves the HW, which wakes 2
        fetch(partition, follower, 10, clock=clock)
    assert partition.quiet_in(2, clock) and partition.quiet_in(3, clock)
    clock.unsettled.clear()
    partition.wake_follower(3)  # its session forgot the partition
    assert not partition.quiet_in(3, clock) and clock.unsettled == {(TOPIC, 0)}
    assert partition.remote_replicas[3].last_fetch_time_ms == T0 + 700
    # A new epoch (the controller's ISR change): every follower is processed again.
    clock.unsettled.clear()
    partition.make_leader(leader_and_isr(1, 1, (1, 2)), T0 + 800)
    assert not partition.quiet_in(2, clock) and clock.unsettled == {(TOPIC, 0)}
    fetch(partition, 2, 10, T0 + 900, clock=clock)
    assert partition.quiet_in(2, clock)
    # 3, outside the ISR, is proposed in: not quiet, and the ISR change wakes 2.
    assert fetch(partition, 3, 10, T0 + 900, clock=clock).isr_proposal is not None
    assert not partition.quiet_in(3, clock) and not partition.quiet_in(2, clock)


def test_an_isr_member_that_is_not_a_replica_is_proposed_out_of_the_isr(log: MemoryLog) -> None:
    # As after a reassignment was cancelled while its target replica 4 was in the ISR.
    partition = replica_on(log)
    partition.make_leader(LeaderAndIsr(1, 0, (1, 2, 3, 4), REPLICAS, 0), T0)
    assert partition.out_of_sync_replicas(T0) == {4}
    proposal = partition.maybe_shrink_isr(T0)
    assert proposal is not None and proposal.new_isr == REPLICAS


# -- HW -----------------------------------------------------------------------------------


def test_a_follower_out_of_the_isr_that_stops_holding_the_hw_lets_it_move_without_an_append(
    log: MemoryLog,
) -> None:
    """Review 22 M1: follower 3, out of the ISR after a controlled shutdown began, caught up
    and so held the HW (about to join). Broker 2 fetched a new acks=all batch, 3 stopped before
    it did; then 3 stopped counting (no longer usable, or its lag time passed). Neither moves
    a LEO: the HW of an idle partition stayed short of its LEO for good, the produce timed out
    and so did its retry, a duplicate. Kafka recomputes the HW after every append, duplicates
    included; the broker runs the recompute at the periodic ISR check and when the usable
    brokers change (ReplicaManager._recheck_high_watermarks)."""
    usable = {2: 0, 3: 0}
    for stops_counting in ("unusable", "lag time passed"):
        usable[3] = 0
        partition = new_leader(log_with(*[0] * 10), isr=(1, 2), usable_broker_epoch=usable.get)
        fetch(partition, 2, 10, T0)
        proposal = fetch(partition, 3, 10, T0).isr_proposal
        assert proposal is not None
        refuse(partition, proposal, T0, ErrorCode.INELIGIBLE_REPLICA)  # shutting down
        append(partition, 3, T0 + 1)
        fetch(partition, 2, 13, T0 + 2)
        assert partition.high_watermark == 10  # 3 holds it, as a follower about to join
        if stops_counting == "unusable":
            del usable[3]
            now = T0 + 3
        else:
            now = T0 + LAG + 1
        assert partition.maybe_increment_high_watermark(now) is True
        assert partition.high_watermark == 13


def test_hw_is_the_smallest_leo_in_the_isr(log: MemoryLog) -> None:
    partition = new_leader(log)
    assert fetch(partition, 2, 10).high_watermark_changed is False  # 3 has not fetched yet
    assert fetch(partition, 3, 7).high_watermark_changed is True
    assert partition.high_watermark == 7
    assert append(partition, 2) is False
    assert fetch(partition, 3, 10).high_watermark_changed is True
    assert partition.high_watermark == 10


def test_hw_moves_at_once_for_a_leader_alone_in_the_isr(log: MemoryLog) -> None:
    partition = replica_on(log, config=MIN_ISR_1)
    assert partition.make_leader(leader_and_isr(isr=(1,)), T0) is True
    assert partition.high_watermark == 10
    assert append(partition, 1) is True
    assert partition.high_watermark == 11


def test_new_leader_hw_waits_for_every_isr_member_to_fetch(log: MemoryLog) -> None:
    partition = replica_on(log, checkpointed_hw=6)
    assert partition.make_leader(leader_and_isr(leader_epoch=1), T0) is False
    fetch(partition, 2, 10)
    assert partition.high_watermark == 6
    fetch(partition, 3, 10)
    assert partition.high_watermark == 10


def test_restarted_replica_hw_is_capped_by_its_leo(log: MemoryLog) -> None:
    # The checkpoint said 12, but the crash took the unflushed tail from 10 on.
    assert replica_on(log, checkpointed_hw=12).high_watermark == 10


def test_hw_stays_within_the_log_start_and_the_leo(log: MemoryLog) -> None:
    log.advance_log_start(4)  # retention passed the checkpointed HW
    assert replica_on(log, checkpointed_hw=2).high_watermark == 4
    follower = replica_on(log, broker_id=2)
    follower.make_follower(leader_and_isr())
    for leader_hw, hw in ((2, 4), (7, 7), (12, 10)):
        follower.update_follower_high_watermark(leader_hw)
        assert follower.high_watermark == hw


def test_hw_never_moves_back(log: MemoryLog) -> None:
    partition = new_leader(log, isr=(1, 2))
    fetch(partition, 2, 10)
    assert partition.high_watermark == 10
    # The follower lost its tail and fetches from 4 again.
    assert fetch(partition, 2, 4).high_watermark_changed is False
    assert partition.high_watermark == 10
    # A replica joining the ISR does not pull it back either.
    proposal = fetch(partition, 3, 10).isr_proposal
    assert proposal is not None
    commit(partition, proposal)
    assert partition.high_watermark == 10


def test_hw_waits_for_a_member_being_removed_until_the_shrink_commits(log: MemoryLog) -> None:
    partition = new_leader(log)
    fetch(partition, 2, 10)
    fetch(partition, 3, 10)
    append(partition, 5)
    late = T0 + LAG + 1
    fetch(partition, 2, 15, late)
    proposal = partition.maybe_shrink_isr(late)
    assert proposal is not None and proposal.new_isr == (1, 2)
    append(partition, 1, late)
    fetch(partition, 2, 16, late)
    assert partition.high_watermark == 10, "3 may still be in the ISR: the HW waits for it"
    assert commit(partition, proposal, late) is True
    assert partition.high_watermark == 16


def test_hw_waits_for_a_member_being_added(log: MemoryLog) -> None:
    partition = new_leader(log, isr=(1, 2))
    fetch(partition, 2, 10)
    proposal = fetch(partition, 3, 10).isr_proposal
    assert proposal is not None
    # Long after 3 last caught up, so only the pending expansion holds the HW for it.
    late = T0 + LAG + 1
    append(partition, 5, late)
    fetch(partition, 2, 15, late)
    assert partition.high_watermark == 10
    commit(partition, proposal, late)
    fetch(partition, 3, 15, late)
    assert partition.high_watermark == 15


def test_hw_waits_for_a_caught_up_follower_outside_the_isr_within_the_lag_time(
    log: MemoryLog,
) -> None:
    partition = new_leader(log, isr=(1,), config=MIN_ISR_1)
    proposal = fetch(partition, 2, 10).isr_proposal
    assert proposal is not None
    refuse(partition, proposal)
    # 2 is not in the ISR, but caught up at T0: it is about to join, so the HW waits for it.
    append(partition, 5, T0 + 1)
    assert partition.high_watermark == 10
    # Once it has not caught up for longer than the lag time, the HW goes on without it.
    assert append(partition, 1, T0 + LAG + 1) is True
    assert partition.high_watermark == 16


def test_hw_does_not_wait_for_a_fenced_follower(log: MemoryLog) -> None:
    partition = new_leader(
        log, isr=(1,), usable_broker_epoch=lambda b: None if b == 2 else 0, config=MIN_ISR_1
    )
    assert fetch(partition, 2, 10).isr_proposal is None
    append(partition, 5, T0 + 1)
    assert partition.high_watermark == 15


def test_hw_does_not_move_while_the_committed_isr_is_below_min_insync(log: MemoryLog) -> None:
    # KIP-966: with ISR {1} and min.insync.replicas=2 nothing is committed, acks=1 appends
    # included, so the replicas that left the ISR hold every committed record.
    partition = replica_on(log)
    assert partition.make_leader(leader_and_isr(isr=(1,)), T0) is False
    assert append(partition, 5) is False
    assert partition.high_watermark == 0
    proposal = fetch(partition, 2, 15).isr_proposal
    assert proposal is not None
    assert partition.high_watermark == 0, "a member being added does not count yet"
    assert commit(partition, proposal) is True
    assert partition.high_watermark == 15


def test_hw_moves_once_a_lower_min_insync_is_met(log: MemoryLog) -> None:
    # The topic lowers min.insync.replicas to what ISR {1} meets: the HW moves with the new
    # configs (UpdateMetadata), not at the next append or fetch (before, review 12).
    partition = replica_on(log)
    partition.make_leader(leader_and_isr(isr=(1,)), T0)
    append(partition, 5)
    assert partition.reconfigure(CONFIG, T0) is False
    assert partition.high_watermark == 0
    assert partition.reconfigure(MIN_ISR_1, T0) is True
    assert partition.high_watermark == log.log_end_offset == 15
    assert partition.config == MIN_ISR_1


def test_hw_stops_once_a_shrink_below_min_insync_commits(log: MemoryLog) -> None:
    partition = new_leader(log, isr=(1, 2))
    fetch(partition, 2, 10)
    append(partition, 1)
    assert partition.high_watermark == 10
    proposal = partition.maybe_shrink_isr(T0 + LAG + 1)
    assert proposal is not None and proposal.new_isr == (1,)
    assert commit(partition, proposal, T0 + LAG + 1) is False
    assert append(partition, 3, T0 + LAG + 2) is False
    assert partition.high_watermark == 10


def test_min_insync_above_the_replication_factor_counts_as_the_replication_factor(
    log: MemoryLog,
) -> None:
    # Kafka's effective min ISR: min.insync.replicas=2 on a topic of one replica.
    partition = replica_on(log)
    assert partition.make_leader(LeaderAndIsr(1, 0, (1,), (1,), 0), T0) is True
    assert partition.high_watermark == 10


# -- roles --------------------------------------------------------------------------------


def test_new_leader_starts_its_epoch_at_its_leo_and_offsets_continue() -> None:
    log = log_with(0, 0, 0, 0, 0, 0, 0)
    partition = replica_on(log, checkpointed_hw=5)
    partition.make_follower(leader_and_isr(leader=2, leader_epoch=0))
    partition.make_leader(leader_and_isr(leader=1, leader_epoch=1), T0)
    assert partition.leader_epoch_start_offset == 7
    assert log.leader_epoch_cache.epoch_entries == [EpochEntry(0, 0), EpochEntry(1, 7)]
    partition.check_append(acks=1)
    batch = log.append_as_leader(["next"], partition.leader_epoch)
    assert (batch.base_offset, batch.epoch) == (7, 1)
    assert log.leader_epoch_cache.end_offset_for(0, log.log_end_offset) == (0, 7)


def test_an_append_survives_an_epoch_bump_that_kept_the_leader() -> None:
    """The controller bumps the leader epoch when it fences a follower, and this broker goes
    on leading: an acks=all batch appended before the bump is still at its offsets."""
    log = log_with(0)
    partition = replica_on(log)
    partition.make_leader(leader_and_isr(leader_epoch=1), T0)
    batch = log.append_as_leader(["a", "b"], partition.leader_epoch)
    partition.make_leader(leader_and_isr(leader_epoch=2, isr=(1, 2)), T0)
    assert partition.holds_append(1, batch.last_offset + 1)
    assert partition.holds_append(2, batch.last_offset + 1)


def test_an_append_truncated_while_another_leader_led_is_not_held() -> None:
    """Review 4, finding 1: the leader lost the partition after its append, truncated the
    batch, copied the next leader's record to its offset and leads again. The log end is past
    the batch; its offset holds another record."""
    log = log_with(0)
    partition = replica_on(log)
    partition.make_leader(leader_and_isr(leader_epoch=1), T0)
    batch = log.append_as_leader(["mine"], partition.leader_epoch)
    partition.make_follower(leader_and_isr(leader=2, leader_epoch=2))
    log.truncate_to(batch.base_offset)
    log.append_as_leader(["theirs"], 2)  # as copied from leader 2: its epoch kept
    partition.make_leader(leader_and_isr(leader_epoch=3), T0)
    log.append_as_leader(["later"], partition.leader_epoch)
    assert log.log_end_offset > batch.last_offset + 1
    assert not partition.holds_append(1, batch.last_offset + 1)
    # Truncated in the epoch's first batch: the history has no epoch 1 left at all.
    assert log.leader_epoch_cache.epoch_entries[-2:] == [EpochEntry(2, 1), EpochEntry(3, 2)]


def test_make_follower_says_whether_the_fetcher_must_restart(log: MemoryLog) -> None:
    partition = replica_on(log, broker_id=2)
    assert partition.make_follower(leader_and_isr(leader=1, leader_epoch=3)) is True
    assert partition.make_follower(leader_and_isr(leader=1, leader_epoch=3)) is False
    # Same leader, but we missed epochs 4 and 5: its log may have changed under us.
    assert partition.make_follower(leader_and_isr(leader=1, leader_epoch=6)) is True
    assert partition.make_follower(leader_and_isr(leader=3, leader_epoch=7)) is True
    assert (partition.leader, partition.leader_epoch) == (3, 7)


def test_a_newer_partition_epoch_alone_updates_the_leader_without_a_new_epoch(
    log: MemoryLog,
) -> None:
    """KRaft's partition change that keeps the leader epoch (the ELR changed alone: here a
    lower min.insync.replicas cleared it). The leader takes the new committed ISR, partition
    epoch and min ISR: its HW moves now that ISR {1, 2} meets 2. The followers' fetch state,
    the epoch's start offset and the epoch cache stay (before, the controller moved the
    leader epoch, and a new one started at the LEO with the followers' state reset)."""
    min_isr_3 = ReplicationConfig(replica_lag_time_max_ms=LAG, min_insync_replicas=3)
    partition = new_leader(log, isr=(1, 2), leader_epoch=3, checkpointed_hw=10, config=min_isr_3)
    assert partition.partition_epoch == 0
    fetch(partition, 2, 10)
    append(partition, 5, T0 + 1)
    fetch(partition, 2, 15, T0 + 2)
    fetch(partition, 3, 12, T0 + 3)
    assert partition.high_watermark == 10, "ISR {1, 2} is below min.insync.replicas=3"
    followers = {b: times(r) for b, r in partition.remote_replicas.items()}
    entries = list(log.leader_epoch_cache.epoch_entries)
    partition.config = CONFIG
    lowered = leader_and_isr(1, 3, (1, 2), partition_epoch=1)
    partition.check_newer(lowered)
    assert partition.make_leader(lowered, T0 + LAG) is True
    assert partition.high_watermark == 15
    assert (partition.leader_epoch, partition.partition_epoch, partition.isr) == (3, 1, {1, 2})
    assert partition.leader_epoch_start_offset == 10
    assert log.leader_epoch_cache.epoch_entries == entries
    assert {b: times(r) for b, r in partition.remote_replicas.items()} == followers


def test_a_leader_and_isr_is_applied_only_when_newer(log: MemoryLog) -> None:
    """A newer leader epoch, or the same one in a newer partition epoch; the same state again
    (a new controller's resend), an older one, or another leader in the same epoch is
    FENCED_LEADER_EPOCH."""
    partition = replica_on(log, broker_id=2)
    partition.check_newer(leader_and_isr(leader=1, leader_epoch=0))  # nothing known yet
    assert partition.make_follower(leader_and_isr(leader=1, leader_epoch=3, partition_epoch=7))
    for stale in [
        leader_and_isr(leader=1, leader_epoch=3, partition_epoch=7),
        leader_and_isr(leader=1, leader_epoch=3, partition_epoch=6),
        leader_and_isr(leader=1, leader_epoch=2, partition_epoch=9),
        leader_and_isr(leader=3, leader_epoch=3, partition_epoch=8),
    ]:
        with pytest.raises(FencedLeaderEpoch):
            partition.check_newer(stale)
    partition.check_newer(leader_and_isr(leader=3, leader_epoch=4, partition_epoch=8))
    # The ISR or ELR changed alone: the follower goes on fetching, truncating nothing.
    isr_only = leader_and_isr(leader=1, leader_epoch=3, isr=(1, 2), partition_epoch=8)
    partition.check_newer(isr_only)
    assert partition.make_follower(isr_only) is False
    assert (partition.leader, partition.leader_epoch, partition.partition_epoch) == (1, 3, 8)


def test_a_newer_partition_epoch_supersedes_a_proposal_in_flight(log: MemoryLog) -> None:
    """Leader 1 proposes ISR {1, 2} at partition epoch 0 when the controller changes the ELR
    alone (partition epoch 1, the leader epoch kept). Its proposal is stale: the controller
    refuses it, and its answer, whichever comes, changes nothing; the next proposal names
    partition epoch 1. An AlterIsr answer that taught the leader a later partition epoch is
    not undone by a LeaderAndIsr of an earlier one arriving after it."""
    partition = new_leader(log)
    fetch(partition, 2, 10)
    shrink = partition.maybe_shrink_isr(T0 + LAG + 1)
    assert shrink is not None and shrink.partition_epoch == 0
    elr_only = leader_and_isr(1, 0, REPLICAS, partition_epoch=1)
    partition.check_newer(elr_only)
    partition.make_leader(elr_only, T0 + LAG + 1)
    assert not partition.isr_state.in_flight and not partition.awaits_answer(shrink)
    assert refuse(partition, shrink, T0 + LAG + 1) is False
    assert commit(partition, shrink, T0 + LAG + 1) is False
    assert (partition.isr, partition.partition_epoch) == ({1, 2, 3}, 1)
    again = partition.maybe_shrink_isr(T0 + LAG + 2)
    assert again is not None and (again.new_isr, again.partition_epoch) == ((1, 2), 1)
    committed = leader_and_isr(1, 0, (1, 2), partition_epoch=3)
    partition.on_alter_isr_result(again, committed, None, T0 + LAG + 2)
    with pytest.raises(FencedLeaderEpoch):
        partition.check_newer(leader_and_isr(1, 0, REPLICAS, partition_epoch=2))
    assert (partition.isr, partition.partition_epoch) == ({1, 2}, 3)


def test_former_leader_refuses_appends_and_follower_fetches(log: MemoryLog) -> None:
    partition = new_leader(log)
    fetch(partition, 2, 10)
    assert partition.make_follower(leader_and_isr(leader=2, leader_epoch=1)) is True
    with pytest.raises(NotLeaderOrFollower):
        partition.check_append(acks=1)
    with pytest.raises(NotLeaderOrFollower):
        fetch(partition, 3, 10)
    assert partition.maybe_shrink_isr(T0 + 100 * LAG) is None
    assert partition.remote_replicas == {}


# -- fetch validation ---------------------------------------------------------------------


def test_fetch_with_an_older_leader_epoch_is_fenced(log: MemoryLog) -> None:
    partition = new_leader(log, leader_epoch=5)
    with pytest.raises(FencedLeaderEpoch):
        fetch(partition, 2, 10, current_leader_epoch=4)
    assert partition.remote_replicas[2].log_end_offset == UNKNOWN_OFFSET


def test_fetch_with_a_newer_leader_epoch_is_unknown_here(log: MemoryLog) -> None:
    partition = new_leader(log, leader_epoch=5)
    with pytest.raises(UnknownLeaderEpoch):
        fetch(partition, 2, 10, current_leader_epoch=6)
    assert partition.remote_replicas[2].log_end_offset == UNKNOWN_OFFSET


def test_fetch_without_a_leader_epoch_is_not_checked(log: MemoryLog) -> None:
    partition = new_leader(log, leader_epoch=5)
    fetch(partition, 2, 10, current_leader_epoch=NO_EPOCH)
    assert partition.remote_replicas[2].log_end_offset == 10


def test_fetch_from_a_broker_that_is_not_a_replica_is_refused(log: MemoryLog) -> None:
    partition = new_leader(log)
    with pytest.raises(NotLeaderOrFollower):
        fetch(partition, 9, 10)


def test_leader_reports_a_diverging_epoch_it_never_had() -> None:
    # Epoch 0 wrote 0..2, epoch 2 wrote 3..5; the follower led epoch 1 and wrote 3..4 alone.
    leader = new_leader(log_with(0, 0, 0, 2, 2, 2), leader_epoch=3)
    outcome = fetch(leader, 2, 5, last_fetched_epoch=1)
    assert outcome == FollowerFetchOutcome(diverging_epoch=(0, 3))
    assert leader.remote_replicas[2].log_end_offset == UNKNOWN_OFFSET, "no progress recorded"


def test_leader_reports_a_diverging_epoch_that_ends_before_the_fetch_offset() -> None:
    leader = new_leader(log_with(0, 0, 0, 2, 2, 2), leader_epoch=3)
    # The follower got 3..4 of epoch 0 from an old leader; ours ended at 3.
    assert fetch(leader, 2, 5, last_fetched_epoch=0).diverging_epoch == (0, 3)
    assert fetch(leader, 2, 3, last_fetched_epoch=0).diverging_epoch is None
    assert fetch(leader, 2, 6, last_fetched_epoch=2).diverging_epoch is None
    assert leader.remote_replicas[2].log_end_offset == 6


def test_follower_fetch_beyond_the_leader_leo_is_out_of_range(log: MemoryLog) -> None:
    partition = new_leader(log)
    with pytest.raises(OffsetOutOfRange):
        fetch(partition, 2, 11)


def test_follower_fetch_below_the_leader_log_start_is_out_of_range() -> None:
    log = MemoryLog()
    log.truncate_fully_and_start_at(100)
    log.append_as_leader(["a", "b"], 0)
    partition = new_leader(log)
    with pytest.raises(OffsetOutOfRange):
        fetch(partition, 2, 50)
    fetch(partition, 2, 100)
    assert partition.remote_replicas[2].log_end_offset == 100


# -- the follower's side of out of range and divergence ------------------------------------


def test_leader_behind_us_truncates_only_where_unclean_election_allowed_it() -> None:
    assert on_offset_out_of_range("orders-0", 20, 12, 0, True) == TruncateTo(12)
    action = on_offset_out_of_range("orders-0", 20, 12, 0, False)
    assert isinstance(action, StopReplicating)
    assert "12" in action.reason and "20" in action.reason


def test_leader_log_start_beyond_us_starts_over_there() -> None:
    assert on_offset_out_of_range("orders-0", 20, 500, 300, False) == TruncateFullyAndStartAt(300)


def test_offset_in_range_after_all_fetches_again() -> None:
    assert on_offset_out_of_range("orders-0", 20, 30, 10, False) is None


def test_applying_out_of_range_actions_keeps_the_hw_within_the_log() -> None:
    log = log_with(*[0] * 20)
    follower = replica_on(log, broker_id=2, checkpointed_hw=18)
    apply_out_of_range(follower, log, TruncateTo(12))
    assert (log.log_end_offset, follower.high_watermark) == (12, 12)
    apply_out_of_range(follower, log, TruncateFullyAndStartAt(300))
    assert (log.log_start_offset, log.log_end_offset, follower.high_watermark) == (300, 300, 300)
    assert log.leader_epoch_cache.epoch_entries == []


def test_a_follower_lets_go_of_what_its_leader_let_go_of_up_to_its_hw() -> None:
    log = log_with(*[0] * 20)
    follower = replica_on(log, broker_id=2, checkpointed_hw=8)
    follow_leader_log_start(follower, log, 5)
    assert log.log_start_offset == 5
    follow_leader_log_start(follower, log, 3)  # never back
    assert log.log_start_offset == 5
    follow_leader_log_start(follower, log, 12)  # not past what it knows is committed
    assert (log.log_start_offset, follower.high_watermark) == (8, 8)


@pytest.mark.parametrize(
    ("diverging_epoch", "local_end_offset", "expected"),
    [
        pytest.param((NO_EPOCH, 5), 8, 5, id="epoch-undefined-leader-offset-below"),
        pytest.param((NO_EPOCH, 5), 3, 3, id="epoch-undefined-our-leo-below"),
        pytest.param((NO_EPOCH, -1), 8, 8, id="nothing-known-no-truncation"),
    ],
)
def test_truncation_when_the_leader_names_no_epoch(
    diverging_epoch: tuple[int, int],
    local_end_offset: int,
    expected: int,
) -> None:
    log = log_with(*[0] * local_end_offset)
    assert truncation_offset(log.leader_epoch_cache, local_end_offset, diverging_epoch) == expected


def test_truncation_when_we_have_no_epoch_up_to_the_leaders() -> None:
    # Batches from before leader epochs: the cache is empty, the leader's offset decides.
    log = log_with(*[NO_EPOCH] * 8)
    assert log.leader_epoch_cache.epoch_entries == []
    assert truncation_offset(log.leader_epoch_cache, 8, (3, 5)) == 5
    assert truncation_offset(log.leader_epoch_cache, 8, (3, 10)) == 8


@pytest.mark.parametrize("leader_end_offset", [12, 5])
def test_truncation_to_the_end_of_our_largest_epoch_below_the_leaders(
    leader_end_offset: int,
) -> None:
    # Ours: epoch 0 at 0, 1 at 4, 3 at 7. The leader says its epoch 2 ended at 12 (or 5); we
    # never had epoch 2, so we cut what epoch 3 wrote, whatever the leader's offset, and the
    # next fetch asks about epoch 1.
    log = log_with(0, 0, 0, 0, 1, 1, 1, 3, 3)
    assert truncation_offset(log.leader_epoch_cache, 9, (2, leader_end_offset)) == 7


@pytest.mark.parametrize(
    ("epochs", "diverging_epoch", "expected"),
    [
        pytest.param((0, 0, 0, 1, 1, 1, 1, 1, 1), (1, 6), 6, id="leader-epoch-ends-first"),
        pytest.param((0, 0, 0, 1, 1, 2, 2, 2, 2), (1, 6), 5, id="our-epoch-ends-first"),
    ],
)
def test_truncation_in_an_epoch_we_share_is_at_the_first_end(
    epochs: tuple[int, ...],
    diverging_epoch: tuple[int, int],
    expected: int,
) -> None:
    log = log_with(*epochs)
    assert truncation_offset(log.leader_epoch_cache, 9, diverging_epoch) == expected


# -- produce ------------------------------------------------------------------------------


def test_append_is_refused_by_a_follower(log: MemoryLog) -> None:
    partition = replica_on(log, broker_id=2)
    partition.make_follower(leader_and_isr(leader=1))
    with pytest.raises(NotLeaderOrFollower):
        partition.check_append(acks=1)


def test_acks_all_append_needs_min_insync_replicas(log: MemoryLog) -> None:
    partition = new_leader(log, isr=(1,))
    with pytest.raises(NotEnoughReplicas):
        partition.check_append(acks=ACKS_ALL)
    partition.check_append(acks=1)
    partition.check_append(acks=0)


def test_acks_all_completes_once_the_hw_covers_the_batch(log: MemoryLog) -> None:
    partition = new_leader(log, isr=(1, 2))
    fetch(partition, 2, 10)
    partition.check_append(acks=ACKS_ALL)
    append(partition, 1)
    assert partition.enough_replicas_for(11) is None
    fetch(partition, 2, 11)
    assert partition.enough_replicas_for(11) is True


@pytest.mark.parametrize("hw_passed", [False, True])
def test_acks_all_after_the_isr_shrank_below_min_insync(log: MemoryLog, hw_passed: bool) -> None:
    # Before the HW passed the batch, the HW no longer moves (KIP-966): the produce waits, and
    # times out unless the ISR grows back, where before it failed with
    # NOT_ENOUGH_REPLICAS_AFTER_APPEND, still the answer once the HW has passed it.
    partition = new_leader(log, isr=(1, 2))
    fetch(partition, 2, 10)
    partition.check_append(acks=ACKS_ALL)
    append(partition, 1)
    if hw_passed:
        fetch(partition, 2, 11)
        append(partition, 1)  # 2 is behind again, so it can fall out
    proposal = partition.maybe_shrink_isr(T0 + LAG + 1)
    assert proposal is not None
    assert commit(partition, proposal, T0 + LAG + 1) is False
    assert partition.enough_replicas_for(11) is (False if hw_passed else None)


def test_min_insync_replicas_above_the_replication_factor_is_capped_at_it(log: MemoryLog) -> None:
    # Kafka's effective min ISR, in every rule: min.insync.replicas=4 with 3 replicas is 3 for
    # the acks=all check before the append, the HW rule and the acks=all completion alike.
    # Before, only the HW rule capped it: acks=all was refused with the whole ISR in sync.
    config = ReplicationConfig(replica_lag_time_max_ms=LAG, min_insync_replicas=4)
    partition = new_leader(log, config=config)
    assert not partition.under_min_isr
    fetch(partition, 2, 10)
    fetch(partition, 3, 10)
    partition.check_append(acks=ACKS_ALL)
    append(partition, 1)
    fetch(partition, 2, 11)
    fetch(partition, 3, 11)
    assert partition.high_watermark == 11
    assert partition.enough_replicas_for(11) is True


def test_acks_all_counts_a_member_being_added(log: MemoryLog) -> None:
    # min.insync.replicas=3. The batch at 10 is accepted with ISR {1,2,3}; 3 falls out before
    # it has the batch, gets it, and is being added back. The HW waits for the ISR of three
    # to commit (KIP-966), and then three replicas hold the batch: it is committed.
    config = ReplicationConfig(replica_lag_time_max_ms=LAG, min_insync_replicas=3)
    partition = new_leader(log, config=config)
    fetch(partition, 2, 10)
    fetch(partition, 3, 10)
    fetch(partition, 2, 10, T0 + LAG - 5)
    partition.check_append(acks=ACKS_ALL)
    append(partition, 1, T0 + LAG - 5)
    late = T0 + LAG + 1
    shrink = partition.maybe_shrink_isr(late)
    assert shrink is not None and shrink.new_isr == (1, 2)
    commit(partition, shrink, late)
    assert partition.enough_replicas_for(11) is None
    expand = fetch(partition, 3, 11, late).isr_proposal
    assert expand is not None
    fetch(partition, 2, 11, late)
    assert partition.high_watermark == 10
    commit(partition, expand, late)
    assert partition.high_watermark == 11
    assert partition.enough_replicas_for(11) is True
