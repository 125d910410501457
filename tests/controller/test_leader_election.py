from __future__ import annotations

import pytest

from tidewater.controller.leader_election import (
    ElectionResult,
    controlled_shutdown_leader,
    imbalanced_brokers,
    no_op_leader,
    offline_partition_leader,
    preferred_replica_leader,
    reassigned_partition_leader,
)
from tidewater.controller.model import NO_LEADER, PartitionRecord
from tidewater.errors import (
    ElectionNotNeeded,
    NoReplicaOnline,
    PreferredLeaderNotAvailable,
    StateChangeFailed,
)
from tidewater.v1.errors_pb2 import ErrorCode

AR = (1, 2, 3)


def state(leader: int, isr: tuple[int, ...], leader_epoch: int = 5) -> PartitionRecord:
    return PartitionRecord(
        leader=leader, leader_epoch=leader_epoch, isr=isr, controller_epoch=7, partition_epoch=42
    )


def assert_elected(result: ElectionResult, leader: int, isr: tuple[int, ...]) -> None:
    after = result.leader_and_isr
    assert (after.leader, after.isr) == (leader, isr)
    assert after.leader_epoch == 6
    # The etcd write compares against the current partition epoch; the caller stamps its own
    # controller epoch.
    assert (after.partition_epoch, after.controller_epoch) == (42, 7)


# Offline partition


def test_offline_elects_first_live_isr_member_in_replica_order() -> None:
    # ISR order differs from AR order: AR order decides.
    result = offline_partition_leader(AR, state(1, (3, 1, 2)), {2, 3}, unclean_allowed=False)
    assert_elected(result, 2, (3, 2))
    assert result.replicas_to_notify == (2, 3)
    assert not result.unclean


def test_offline_prefers_a_live_isr_member_to_an_earlier_live_replica_out_of_sync() -> None:
    result = offline_partition_leader(AR, state(1, (1, 3)), {2, 3}, unclean_allowed=True)
    assert_elected(result, 3, (3,))
    assert not result.unclean


def test_offline_without_live_isr_member_elects_first_live_replica_when_unclean_allowed() -> None:
    result = offline_partition_leader(AR, state(1, (1,)), {2, 3}, unclean_allowed=True)
    assert_elected(result, 2, (2,))
    assert result.unclean
    assert result.replicas_to_notify == (2, 3)


def test_offline_without_live_isr_member_fails_when_unclean_disabled() -> None:
    with pytest.raises(NoReplicaOnline) as raised:
        offline_partition_leader(AR, state(1, (1,)), {2, 3}, unclean_allowed=False)
    assert raised.value.code == ErrorCode.NO_REPLICA_ONLINE
    assert "unclean" in str(raised.value)


def test_offline_with_no_live_replica_fails_even_when_unclean_allowed() -> None:
    with pytest.raises(NoReplicaOnline):
        offline_partition_leader(AR, state(1, (1, 2)), {4}, unclean_allowed=True)


def test_offline_ignores_live_brokers_outside_the_assignment() -> None:
    with pytest.raises(NoReplicaOnline):
        offline_partition_leader(AR, state(NO_LEADER, (4,)), {4}, unclean_allowed=True)


# Reassignment


def test_reassignment_elects_first_live_isr_member_in_target_order() -> None:
    # Target replicas (4, 5, 6); 4 is dead, 6 is in sync before 5 in the ISR.
    result = reassigned_partition_leader((4, 5, 6), state(1, (1, 6, 5, 4)), {1, 5, 6})
    assert_elected(result, 5, (1, 6, 5, 4))
    assert result.replicas_to_notify == (5, 6)


def test_reassignment_fails_when_no_target_replica_is_live_and_in_sync() -> None:
    # 5 is in sync but dead, 6 alive but not in sync; 1 is neither a target.
    with pytest.raises(NoReplicaOnline) as raised:
        reassigned_partition_leader((5, 6), state(1, (1, 5)), {1, 6})
    assert raised.value.code == ErrorCode.NO_REPLICA_ONLINE


def test_reassignment_with_no_target_replicas_fails() -> None:
    with pytest.raises(NoReplicaOnline):
        reassigned_partition_leader((), state(1, (1, 2)), {1, 2})


# Preferred replica


def test_preferred_replica_takes_over_when_live_and_in_sync() -> None:
    result = preferred_replica_leader(AR, state(2, (2, 3, 1)), {1, 2, 3})
    assert_elected(result, 1, (2, 3, 1))
    assert result.replicas_to_notify == (1, 2, 3)


def test_preferred_replica_already_leading_needs_no_election() -> None:
    with pytest.raises(ElectionNotNeeded) as raised:
        preferred_replica_leader(AR, state(1, (1, 2)), {1, 2, 3})
    assert raised.value.code == ErrorCode.ELECTION_NOT_NEEDED


@pytest.mark.parametrize(
    ("isr", "live"),
    [((2, 3, 1), {2, 3}), ((2, 3), {1, 2, 3})],
    ids=["preferred-dead", "preferred-out-of-sync"],
)
def test_preferred_replica_dead_or_out_of_sync_is_not_available(
    isr: tuple[int, ...], live: set[int]
) -> None:
    with pytest.raises(PreferredLeaderNotAvailable) as raised:
        preferred_replica_leader(AR, state(2, isr), live)
    assert raised.value.code == ErrorCode.PREFERRED_LEADER_NOT_AVAILABLE
    # A failed state change like any other for callers that do not care why.
    assert isinstance(raised.value, StateChangeFailed)


# Controlled shutdown


def test_controlled_shutdown_moves_leadership_off_the_shutting_down_broker() -> None:
    # live includes the broker shutting down: it is still up until it stops.
    result = controlled_shutdown_leader(AR, state(1, (1, 2, 3)), {1, 2, 3}, shutting_down={1})
    assert_elected(result, 2, (2, 3))
    assert result.replicas_to_notify == (1, 2, 3)


def test_controlled_shutdown_notifies_the_broker_shutting_down_even_if_not_counted_live() -> None:
    result = controlled_shutdown_leader(AR, state(1, (1, 2, 3)), {2, 3}, shutting_down={1})
    assert_elected(result, 2, (2, 3))
    assert result.replicas_to_notify == (1, 2, 3)


def test_controlled_shutdown_skips_dead_and_shutting_down_isr_members() -> None:
    # 2 is dead (and leaves the ISR later through its own path), 1 and 3 are shutting down.
    result = controlled_shutdown_leader(
        (1, 2, 3, 4), state(1, (1, 2, 3, 4)), {1, 3, 4}, shutting_down={1, 3}
    )
    assert_elected(result, 4, (2, 4))


def test_controlled_shutdown_fails_when_only_shutting_down_brokers_are_in_sync() -> None:
    with pytest.raises(StateChangeFailed) as raised:
        controlled_shutdown_leader(AR, state(1, (1,)), {1, 2, 3}, shutting_down={1})
    assert raised.value.code == ErrorCode.STATE_CHANGE_FAILED


# No-op


def test_no_op_keeps_leader_isr_and_epoch() -> None:
    current = state(2, (2, 3))
    result = no_op_leader(AR, current, {2, 3})
    assert result.leader_and_isr == current
    assert result.replicas_to_notify == (2, 3)


def test_no_op_bumps_the_leader_epoch_when_told() -> None:
    result = no_op_leader(AR, state(2, (2, 3)), {1, 2, 3}, bump_leader_epoch=True)
    assert_elected(result, 2, (2, 3))
    assert result.replicas_to_notify == (1, 2, 3)


# Auto leader rebalance


def test_imbalanced_brokers_lists_partitions_to_give_back_above_the_threshold() -> None:
    assignments = {("t", p): ((1, 2) if p < 4 else (2, 1)) for p in range(8)}
    # Broker 1 prefers t-0..3 but leads only t-0 and t-1 (50% imbalance); broker 2 leads all
    # of its own.
    states = {tp: state(2, (1, 2)) for tp in assignments}
    states["t", 0] = states["t", 1] = state(1, (1, 2))
    assert imbalanced_brokers(assignments, states, {1, 2}) == {1: (("t", 2), ("t", 3))}


def test_imbalance_at_the_threshold_is_tolerated() -> None:
    # Broker 1 is preferred for ten partitions and does not lead one: exactly 10%.
    assignments = {("t", p): (1, 2) for p in range(10)}
    states = {tp: state(1, (1, 2)) for tp in assignments}
    states["t", 9] = state(2, (1, 2))
    assert imbalanced_brokers(assignments, states, {1, 2}) == {}
    assert imbalanced_brokers(assignments, states, {1, 2}, imbalance_percentage=9) == {
        1: (("t", 9),)
    }


def test_imbalanced_brokers_leaves_out_partitions_the_preferred_replica_cannot_lead() -> None:
    assignments = {("t", 0): (1, 2), ("t", 1): (1, 2), ("u", 0): (3, 2)}
    states = {
        ("t", 0): state(2, (2,)),  # broker 1 out of sync
        ("t", 1): state(2, (1, 2)),
        ("u", 0): state(2, (2, 3)),  # broker 3 dead
    }
    assert imbalanced_brokers(assignments, states, {1, 2}) == {1: (("t", 1),)}


def test_partitions_without_state_do_not_count() -> None:
    assignments = {("t", 0): (1, 2), ("t", 1): (1, 2)}
    states = {("t", 0): state(1, (1, 2))}
    assert imbalanced_brokers(assignments, states, {1, 2}) == {}


# -- eligible leader replicas (KIP-966) -------------------------------------------------------


def test_offline_election_takes_a_live_elr_member_only_when_the_isr_is_empty() -> None:
    current = state(NO_LEADER, ()).with_(elr=(3, 2), last_known_elr=(1,))
    assert_elected(offline_partition_leader(AR, current, {1, 2, 3}, unclean_allowed=False), 2, (2,))
    # An ISR member not heard from yet may be alive: no ELR election while it is in the ISR.
    with pytest.raises(NoReplicaOnline):
        offline_partition_leader(AR, current.with_(isr=(1,)), {2, 3}, unclean_allowed=False)


def test_offline_election_takes_the_last_known_leader_only_without_isr_and_elr() -> None:
    current = state(NO_LEADER, ()).with_(last_known_elr=(3,))
    result = offline_partition_leader(AR, current, {2, 3}, unclean_allowed=False)
    assert_elected(result, 3, (3,))
    assert result.unclean, "Kafka's label: it may have lost an unflushed tail"
    with pytest.raises(NoReplicaOnline):
        offline_partition_leader(AR, current, {1, 2}, unclean_allowed=False)
    with pytest.raises(NoReplicaOnline):  # a (fenced) ELR member outranks it
        offline_partition_leader(AR, current.with_(elr=(1,)), {2, 3}, unclean_allowed=False)
    unclean = offline_partition_leader(AR, current, {1, 2}, unclean_allowed=True)
    assert_elected(unclean, 1, (1,))
