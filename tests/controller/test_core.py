"""The controller's decisions as pure functions of the cluster model."""

from __future__ import annotations

import pytest

from tidewater.controller.core import (
    PartitionChange,
    changes_for_controlled_shutdown,
    changes_for_offline_partitions,
    changes_for_unrecorded_partitions,
    changes_for_unusable_broker,
    complete_reassignment,
    elr_changes_for_configs,
    initial_partition_records,
    stale_elr_changes,
    start_reassignment,
    unclean_leader_change,
    validate_isr_change,
)
from tidewater.controller.model import (
    NO_LEADER,
    BrokerState,
    ClusterModel,
    PartitionRecord,
    Reassignment,
    TopicPartition,
    TopicState,
)
from tidewater.errors import TidewaterError
from tidewater.v1.errors_pb2 import ErrorCode

EPOCH = 7


def model(*, unclean: bool = False, fenced: tuple[int, ...] = ()) -> ClusterModel:
    """Topic t: partition 0 on [1, 2, 3] led by 1, partition 1 on [2, 3, 1] led by 2."""
    m = ClusterModel()
    for b in (1, 2, 3):
        m.brokers[b] = BrokerState(b, "127.0.0.1", 9000 + b, "", "x", epoch=b, fenced=b in fenced)
    configs = {"unclean.leader.election.enable": "true"} if unclean else {}
    m.topics["t"] = TopicState("t", configs, {0: (1, 2, 3), 1: (2, 3, 1)})
    m.partitions[("t", 0)] = PartitionRecord(1, 5, (1, 2, 3), 1, partition_epoch=100)
    m.partitions[("t", 1)] = PartitionRecord(2, 3, (2, 3, 1), 1, partition_epoch=101)
    return m


def test_fenced_leader_moves_to_the_first_live_isr_member_in_ar_order() -> None:
    m = model(fenced=(1,))
    changes = {c.tp: c for c in changes_for_unusable_broker(m, 1, EPOCH)}
    led = changes[("t", 0)].after
    assert (led.leader, led.leader_epoch, led.isr, led.controller_epoch) == (2, 6, (2, 3), EPOCH)
    followed = changes[("t", 1)].after
    assert (followed.leader, followed.leader_epoch, followed.isr) == (2, 4, (2, 3))
    assert changes[("t", 0)].expected_partition_epoch == 100


def test_no_isr_member_alive_leaves_the_partition_offline_without_unclean_election() -> None:
    m = model(fenced=(2, 3))
    m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1,))
    m.brokers[1].fenced = True
    (change,) = [c for c in changes_for_unusable_broker(m, 1, EPOCH) if c.tp == ("t", 0)]
    assert change.after.leader == NO_LEADER
    # KIP-966: the ISR empties; 1 is an eligible leader replica, to lead again when it returns.
    assert (change.after.isr, change.after.elr, change.after.last_known_elr) == ((), (1,), (1,))
    assert not change.unclean


def test_unclean_election_only_when_the_topic_allows_it() -> None:
    for unclean in (False, True):
        m = model(unclean=unclean, fenced=(1, 3))
        m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1,))
        (change,) = [c for c in changes_for_unusable_broker(m, 1, EPOCH) if c.tp == ("t", 0)]
        assert change.after.leader == (2 if unclean else NO_LEADER)
        assert change.unclean is unclean


def test_offline_partition_comes_back_when_an_isr_member_returns() -> None:
    m = model(fenced=(1, 2, 3))
    m.partitions[("t", 0)] = PartitionRecord(NO_LEADER, 6, (1,), 1, partition_epoch=120)

    def elect() -> dict[tuple[str, int], int]:
        changes = changes_for_offline_partitions(m, EPOCH)
        for c in changes:
            m.partitions[c.tp] = c.after
        return {c.tp: c.after.leader for c in changes}

    # t-1's leader is fenced too: it goes offline; t-0 already is, so nothing to write.
    assert elect() == {("t", 1): NO_LEADER}
    m.brokers[2].fenced = False
    assert elect() == {("t", 1): 2}
    m.brokers[1].fenced = False
    assert elect() == {("t", 0): 1}
    assert elect() == {}


def commit(
    m: ClusterModel, changes: list[PartitionChange]
) -> dict[TopicPartition, PartitionRecord]:
    for c in changes:
        m.partitions[c.tp] = c.after
    return {c.tp: c.after for c in changes}


def test_a_broker_restarted_in_a_new_controllers_grace_period_leaves_its_leaderships_and_isrs() -> (
    None
):
    # After a failover every broker is fenced until it heartbeats to the new controller; only
    # 2 has when broker 1 registers a new incarnation.
    m = model(fenced=(1, 3))
    changes = commit(
        m, changes_for_unusable_broker(m, 1, EPOCH, unclean_restart=True, in_grace=True)
    )
    led, followed = changes[("t", 0)], changes[("t", 1)]
    assert (led.leader, led.leader_epoch, led.isr) == (2, 6, (2,))
    assert (followed.leader, followed.leader_epoch, followed.isr) == (2, 4, (2, 3))


def test_a_restarted_broker_leaves_isrs_even_where_no_leader_can_be_elected_yet() -> None:
    m = model(fenced=(1, 2, 3))  # the new controller has heard from nobody yet
    changes = commit(
        m, changes_for_unusable_broker(m, 1, EPOCH, unclean_restart=True, in_grace=True)
    )
    led, followed = changes[("t", 0)], changes[("t", 1)]
    assert (led.leader, led.leader_epoch, led.isr) == (NO_LEADER, 6, (2, 3))
    assert (followed.leader, followed.leader_epoch, followed.isr) == (2, 4, (2, 3))
    # Its new incarnation is back first: no longer in sync, it does not lead (it may have lost
    # what it led); an ISR member does once back, at a new epoch.
    m.brokers[1].fenced = False
    commit(m, changes_for_offline_partitions(m, EPOCH))
    assert m.partitions[("t", 0)].leader == NO_LEADER
    m.brokers[2].fenced = False
    back = commit(m, changes_for_offline_partitions(m, EPOCH))
    assert (back[("t", 0)].leader, back[("t", 0)].leader_epoch) == (2, 7)


def test_an_uncleanly_restarted_last_isr_member_leads_again_as_the_last_known_leader() -> None:
    m = model(fenced=(1, 2, 3))
    m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1,))
    changes = changes_for_unusable_broker(m, 1, EPOCH, unclean_restart=True, in_grace=True)
    led = commit(m, changes)[("t", 0)]
    assert (led.leader, led.leader_epoch, led.isr, led.elr) == (NO_LEADER, 6, (), ())
    assert led.last_known_elr == (1,)
    m.brokers[1].fenced = False
    (back,) = [c for c in changes_for_offline_partitions(m, EPOCH) if c.tp == ("t", 0)]
    # As before KIP-966 it leads again at a new epoch; Kafka calls this election unclean.
    assert (back.after.leader, back.after.leader_epoch, back.after.isr) == (1, 7, (1,))
    assert back.unclean and back.after.last_known_elr == ()


def test_no_unclean_election_while_a_new_controller_has_not_heard_from_every_broker() -> None:
    for in_grace in (True, False):
        m = model(unclean=True, fenced=(1, 3))
        m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1, 3))
        changes = changes_for_unusable_broker(m, 1, EPOCH, unclean_restart=True, in_grace=in_grace)
        (change,) = [c for c in changes if c.tp == ("t", 0)]
        # In the grace period ISR member 3 may be alive: wait for it rather than lose data.
        assert (change.after.leader, change.unclean) == (
            (NO_LEADER, False) if in_grace else (2, True)
        )


def test_in_a_grace_period_an_offline_partition_gets_a_leader_once_an_isr_member_heartbeats() -> (
    None
):
    m = model(fenced=(1, 2, 3))  # the new controller has heard from nobody yet
    commit(m, changes_for_unusable_broker(m, 1, EPOCH, unclean_restart=True, in_grace=True))
    assert m.partitions[("t", 0)].leader == NO_LEADER
    # Broker 1's new incarnation heartbeats first: it left the ISR, so it does not lead.
    m.brokers[1].fenced = False
    assert changes_for_offline_partitions(m, EPOCH, in_grace=True) == []
    # ISR member 2 heartbeats: it leads at once, without waiting for the grace period to end.
    # 3, not heard from yet, may be alive and in sync: it stays in the ISR.
    m.brokers[2].fenced = False
    (change,) = changes_for_offline_partitions(m, EPOCH, in_grace=True)
    assert change.tp == ("t", 0) and not change.unclean
    assert (change.after.leader, change.after.leader_epoch, change.after.isr) == (2, 7, (2, 3))
    assert change.after.controller_epoch == EPOCH
    # The grace period ends without a word from 3: it leaves the ISR.
    commit(m, [change])
    commit(m, changes_for_unusable_broker(m, 3, EPOCH))
    assert (m.partitions[("t", 0)].leader, m.partitions[("t", 0)].isr) == (2, (2,))


def test_no_unclean_election_of_an_offline_partition_in_a_grace_period() -> None:
    for in_grace in (True, False):
        m = model(unclean=True, fenced=(3,))
        m.partitions[("t", 0)] = PartitionRecord(NO_LEADER, 6, (3,), 1, partition_epoch=120)
        changes = {c.tp: c for c in changes_for_offline_partitions(m, EPOCH, in_grace=in_grace)}
        if in_grace:  # ISR member 3 may be alive: wait for it rather than lose data
            assert changes == {}
        else:
            assert (changes[("t", 0)].after.leader, changes[("t", 0)].unclean) == (1, True)


def test_in_a_grace_period_a_leader_not_heard_from_yet_keeps_its_partitions() -> None:
    m = model(fenced=(1, 3))  # 1 leads t-0 and may be alive; 2 has heartbeated
    assert changes_for_offline_partitions(m, EPOCH, in_grace=True) == []
    # Once the grace period is over, 1 is gone: its partition moves.
    (change,) = changes_for_offline_partitions(m, EPOCH)
    assert (change.tp, change.after.leader, change.after.isr) == (("t", 0), 2, (2,))


def test_controlled_shutdown_hands_over_leadership_and_leaves_the_isr() -> None:
    m = model()
    changes = {c.tp: c.after for c in changes_for_controlled_shutdown(m, 1, EPOCH)}
    assert (changes[("t", 0)].leader, changes[("t", 0)].isr) == (2, (2, 3))
    assert (changes[("t", 1)].leader, changes[("t", 1)].isr) == (2, (2, 3))


def test_controlled_shutdown_keeps_a_sole_isr_member_leading() -> None:
    m = model()
    m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1,))
    assert ("t", 0) not in {c.tp for c in changes_for_controlled_shutdown(m, 1, EPOCH)}


@pytest.mark.parametrize(
    ("leader", "leader_epoch", "partition_epoch", "new_isr", "code"),
    [
        (2, 5, 100, (2, 3), ErrorCode.FENCED_LEADER_EPOCH),  # not the leader
        (1, 4, 100, (1, 2), ErrorCode.FENCED_LEADER_EPOCH),  # stale leader epoch
        (1, 5, 99, (1, 2), ErrorCode.INVALID_UPDATE_VERSION),  # stale partition epoch
        (1, 5, 100, (2, 3), ErrorCode.INELIGIBLE_REPLICA),  # leader not in the new ISR
        (1, 5, 100, (1, 4), ErrorCode.INELIGIBLE_REPLICA),  # not a replica
    ],
)
def test_alter_isr_validation(
    leader: int, leader_epoch: int, partition_epoch: int, new_isr: tuple[int, ...], code: int
) -> None:
    with pytest.raises(TidewaterError) as info:
        validate_isr_change(model(), leader, ("t", 0), leader_epoch, partition_epoch, new_isr, 1)
    assert info.value.code == code


def test_alter_isr_refuses_a_fenced_member() -> None:
    m = model(fenced=(3,))
    m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1, 2))
    with pytest.raises(TidewaterError) as info:
        validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2, 3), EPOCH)
    assert info.value.code == ErrorCode.INELIGIBLE_REPLICA
    change = validate_isr_change(model(), 1, ("t", 0), 5, 100, (1, 2), EPOCH)
    assert change is not None
    assert (change.after.isr, change.after.leader_epoch) == ((1, 2), 5)


def test_alter_isr_refuses_a_member_that_registered_again_since_it_was_proposed() -> None:
    """KIP-903's race: follower 3 (epoch 3) caught up and its leader proposed ISR {1, 2, 3}.
    Before the proposal arrives, 3 crashes, loses its unflushed tail, registers again (epoch
    50) and heartbeats: alive and unfenced, but not the incarnation that caught up. Admitting
    it would let a replica lacking acknowledged records be elected."""
    m = model()
    m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1, 2))
    proposed = (-1, 2, 3)  # the leader's own epoch is the request's; 2 and 3 as they fetched
    old = m.brokers[3]
    m.brokers[3] = BrokerState(3, old.host, old.port, "", "y", epoch=50)
    for change in changes_for_unusable_broker(m, 3, EPOCH, unclean_restart=True):
        m.partitions[change.tp] = change.after
    assert m.partitions[("t", 0)].leader_epoch == 5, "3 was not in this ISR: no new epoch"
    m.brokers[3].fenced = False  # its first heartbeat
    with pytest.raises(TidewaterError) as info:
        validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2, 3), EPOCH, proposed)
    assert info.value.code == ErrorCode.INELIGIBLE_REPLICA
    assert "broker 3 at epoch 3" in info.value.message
    # Once the new incarnation has caught up, the leader proposes it at its current epoch.
    change = validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2, 3), EPOCH, (-1, 2, 50))
    assert change is not None and change.after.isr == (1, 2, 3)
    # -1 skips a member's check, as does a proposal without epochs.
    assert validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2, 3), EPOCH, (-1, -1, -1))
    assert validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2, 3), EPOCH)


def test_alter_isr_with_broker_epochs_not_one_per_member_is_invalid() -> None:
    with pytest.raises(TidewaterError) as info:
        validate_isr_change(model(), 1, ("t", 0), 5, 100, (1, 2), EPOCH, (-1, 2, 3))
    assert info.value.code == ErrorCode.INVALID_REQUEST


def test_a_retried_alter_isr_that_already_committed_is_answered_with_the_current_state() -> None:
    """The answer to an expansion {1, 2} -> {1, 2, 3} was lost after it committed (partition
    epoch 100 -> 130); the leader resends it naming epoch 100. Refusing it would leave the
    leader with the old ISR and partition epoch for good."""
    m = model()
    m.partitions[("t", 0)] = PartitionRecord(1, 5, (1, 2, 3), EPOCH, partition_epoch=130)
    assert validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2, 3), EPOCH) is None
    assert validate_isr_change(m, 1, ("t", 0), 5, 100, (3, 2, 1), EPOCH) is None  # a set
    # Not the committed state: a stale partition epoch is still refused.
    with pytest.raises(TidewaterError) as info:
        validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2), EPOCH)
    assert info.value.code == ErrorCode.INVALID_UPDATE_VERSION
    # The same ISR under another leader epoch is another state: fenced.
    with pytest.raises(TidewaterError) as info:
        validate_isr_change(m, 1, ("t", 0), 4, 100, (1, 2, 3), EPOCH)
    assert info.value.code == ErrorCode.FENCED_LEADER_EPOCH


def test_unclean_leader_election_request() -> None:
    with pytest.raises(TidewaterError) as info:
        unclean_leader_change(model(), ("t", 0), EPOCH)
    assert info.value.code == ErrorCode.ELECTION_NOT_NEEDED
    m = model(fenced=(1,))
    m.partitions[("t", 0)] = PartitionRecord(NO_LEADER, 6, (1,), 1, partition_epoch=120)
    change = unclean_leader_change(m, ("t", 0), EPOCH)
    assert (change.after.leader, change.unclean) == (2, True)


def test_an_unclean_election_request_leaves_a_partition_with_a_leader_alone() -> None:
    """Review 23 #1: a leader not heard from yet after a failover (fenced until it
    heartbeats), or one in controlled shutdown that is the only ISR member, is still the
    leader: an unclean election replaced it by a replica out of the ISR, losing what the
    ISR had acknowledged. Kafka answers ELECTION_NOT_NEEDED whenever there is a leader."""
    not_heard_from = model(fenced=(1, 2))
    shutting_down = model()
    shutting_down.partitions[("t", 0)] = shutting_down.partitions[("t", 0)].with_(isr=(1,))
    shutting_down.brokers[1].shutting_down = True
    for m in (not_heard_from, shutting_down):
        with pytest.raises(TidewaterError) as info:
            unclean_leader_change(m, ("t", 0), EPOCH)
        assert info.value.code == ErrorCode.ELECTION_NOT_NEEDED


def test_no_unclean_election_request_is_carried_out_in_a_grace_period() -> None:
    m = model(fenced=(1, 2))
    m.partitions[("t", 0)] = PartitionRecord(NO_LEADER, 6, (1,), 1, partition_epoch=120)
    with pytest.raises(TidewaterError) as info:
        unclean_leader_change(m, ("t", 0), EPOCH, in_grace=True)
    assert info.value.code == ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE


def test_a_leader_in_controlled_shutdown_keeps_its_partition_when_another_broker_returns() -> None:
    """Review 23 #5: broker 1, the only ISR member of t-0, is shutting down and so keeps
    leading it until it stops. Broker 3 coming back ran the offline elections, which took a
    leader that is not usable for offline: t-0 went leaderless while 1 still served it."""
    for unclean in (False, True):
        m = model(unclean=unclean, fenced=(3,))
        m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1,))
        m.brokers[1].shutting_down = True
        m.brokers[3].fenced = False
        assert ("t", 0) not in {c.tp for c in changes_for_offline_partitions(m, EPOCH)}


def test_a_partition_that_never_had_a_leader_starts_as_a_new_one_once_a_replica_is_back() -> None:
    """Review 23 #2: recorded while none of its replicas was usable, it had no ISR to elect
    from when they came back, and stayed offline for good without unclean election. It holds
    no record (leader epoch 0, never led): every live replica joins its ISR."""
    m = model(fenced=(1, 2, 3))
    m.topics["n"] = TopicState("n", {}, {0: (3, 1, 2)})
    (created,) = changes_for_unrecorded_partitions(m, EPOCH)
    assert (created.after.leader, created.after.isr) == (NO_LEADER, ())
    m.partitions[("n", 0)] = created.after
    for b in (1, 3):
        m.brokers[b].fenced = False
    (change,) = [c for c in changes_for_offline_partitions(m, EPOCH) if c.tp == ("n", 0)]
    assert (change.after.leader, change.after.isr) == (3, (3, 1))
    assert (change.after.leader_epoch, change.unclean) == (1, False)


def test_a_partition_that_never_led_stays_so_through_a_reassignment() -> None:
    """Review 24 #6: reassigned while leaderless, its leader epoch moved off 0 and it was no
    longer taken for never led: offline for good without unclean election."""
    m = model(fenced=(1, 2, 3))
    m.brokers[4] = BrokerState(4, "127.0.0.1", 9004, "", "x", epoch=4, fenced=True)
    m.topics["n"] = TopicState("n", {}, {0: (1, 2)})
    (created,) = changes_for_unrecorded_partitions(m, EPOCH)
    m.partitions[("n", 0)] = created.after
    step = start_reassignment(m, ("n", 0), (3, 4), EPOCH)
    assert step.change.after.leader_epoch == 0
    m.partitions[("n", 0)] = step.change.after
    m.topics["n"].assignment[0] = step.replicas
    m.brokers[4].fenced = False
    (change,) = [c for c in changes_for_offline_partitions(m, EPOCH) if c.tp == ("n", 0)]
    assert (change.after.leader, change.after.leader_epoch, change.unclean) == (4, 1, False)


def test_new_partitions_start_with_the_first_usable_replica_leading() -> None:
    changes = initial_partition_records({0: (3, 1, 2), 1: (1, 2, 3)}, "n", {1, 2}, EPOCH)
    assert [(c.after.leader, c.after.isr, c.before) for c in changes] == [
        (1, (1, 2), None),
        (1, (1, 2), None),
    ]


def reassigning(isr: tuple[int, ...], leader: int, *, unclean: bool = False) -> ClusterModel:
    """t-0 moving from [1, 2, 3] to [1, 2, 4] (so assigned to [1, 2, 4, 3]); brokers 1-5."""
    m = model(unclean=unclean)
    for b in (4, 5):
        m.brokers[b] = BrokerState(b, "127.0.0.1", 9000 + b, "", "x", epoch=b, fenced=False)
    m.topics["t"].assignment[0] = (1, 2, 4, 3)
    m.topics["t"].reassignments[0] = Reassignment((1, 2, 3), (1, 2, 4))
    m.partitions[("t", 0)] = PartitionRecord(leader, 7, isr, 1, partition_epoch=200)
    return m


def test_a_cancel_is_one_step_that_takes_the_replicas_it_added_out() -> None:
    """Review 15 L1: a cancel was three etcd writes, and moved the leader epoch two or three
    times (its start, its completion). One step now, as KRaft's one record: the partition's
    state without broker 4 in a new leader epoch, the assignment back to the original
    replicas, nothing in flight, and a StopReplica for 4."""
    m = reassigning((1, 2, 4), leader=1)
    step = start_reassignment(m, ("t", 0), (1, 2, 3), EPOCH)
    after = step.change.after
    assert (after.leader, after.leader_epoch, after.isr) == (1, 8, (1, 2))
    assert step.change.expected_partition_epoch == 200
    assert (step.replicas, step.in_flight, step.stopping) == ((1, 2, 3), None, (4,))


def test_re_targeting_a_reassignment_takes_the_dropped_replica_out_of_the_isr() -> None:
    m = reassigning((1, 2, 4), leader=1)
    step = start_reassignment(m, ("t", 0), (1, 2, 5), EPOCH)
    assert (step.replicas, step.stopping) == ((1, 2, 5, 3), (4,))
    assert step.in_flight == Reassignment((1, 2, 3), (1, 2, 5))
    assert step.change.after.isr == (1, 2)


def test_a_reassignment_starts_with_original_and_target_replicas_assigned() -> None:
    m = model()
    m.brokers[4] = BrokerState(4, "127.0.0.1", 9004, "", "x", epoch=4, fenced=False)
    m.partitions[("t", 0)] = PartitionRecord(1, 7, (1, 2, 3), 1, partition_epoch=200)
    step = start_reassignment(m, ("t", 0), (4, 2, 3), EPOCH)
    assert (step.replicas, step.in_flight, step.stopping) == (
        (4, 2, 3, 1),
        Reassignment((1, 2, 3), (4, 2, 3)),
        (),
    )
    assert (step.change.after.leader, step.change.after.leader_epoch) == (1, 8)


def test_a_dropped_leader_hands_over_to_the_first_remaining_isr_member() -> None:
    m = reassigning((4, 3, 2), leader=4)
    change = start_reassignment(m, ("t", 0), (1, 2, 3), EPOCH).change
    after = change.after
    assert (after.leader, after.leader_epoch, after.isr) == (2, 8, (3, 2))
    assert not change.unclean


def test_a_cancel_that_would_leave_no_isr_member_needs_unclean_election() -> None:
    with pytest.raises(TidewaterError) as info:
        start_reassignment(reassigning((4,), leader=4), ("t", 0), (1, 2, 3), EPOCH)
    assert info.value.code == ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE
    with pytest.raises(TidewaterError) as info:
        start_reassignment(reassigning((4,), leader=NO_LEADER), ("t", 0), (1, 2, 3), EPOCH)
    assert info.value.code == ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE
    m = reassigning((4,), leader=4, unclean=True)
    change = start_reassignment(m, ("t", 0), (1, 2, 3), EPOCH).change
    assert (change.after.leader, change.after.isr, change.unclean) == (1, (1,), True)


def test_a_new_controller_in_its_grace_period_reassigns_as_it_elects() -> None:
    """Review 15 L2: in its grace period, a new controller that had not heard from broker 3
    yet dropped it from the ISR of a cancel that moved the leadership, and with unclean
    election allowed elected an unclean leader: no election in the grace period does either
    (changes_for_offline_partitions)."""
    m = reassigning((4, 3, 2), leader=4)
    m.brokers[3].fenced = True  # not heard from yet
    change = start_reassignment(m, ("t", 0), (1, 2, 3), EPOCH, in_grace=True).change
    assert (change.after.leader, change.after.isr) == (2, (3, 2))
    change = start_reassignment(m, ("t", 0), (1, 2, 3), EPOCH).change
    assert (change.after.leader, change.after.isr) == (2, (2,))
    m = reassigning((4,), leader=4, unclean=True)
    with pytest.raises(TidewaterError) as info:
        start_reassignment(m, ("t", 0), (1, 2, 3), EPOCH, in_grace=True)
    assert info.value.code == ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE


def test_a_cancel_completes_while_an_original_replica_is_out_of_the_isr() -> None:
    """Review 15 M1: a cancel waited, as a reassignment does, for every replica it goes back
    to to be in the ISR: with broker 3 down it stayed listed as in flight until 3 came back,
    and every cancel again only moved the leader epoch. It is over at once, as Kafka's
    revert; a reassignment that adds a replica still waits for it."""
    m = reassigning((1, 2, 4), leader=1)
    step = start_reassignment(m, ("t", 0), (1, 2, 3), EPOCH)
    assert step.in_flight is None
    assert (step.change.after.leader, step.change.after.isr) == (1, (1, 2))
    m = reassigning((1, 2, 3), leader=1)  # broker 4, being added, not in the ISR yet
    assert complete_reassignment(m, ("t", 0), EPOCH) is None


@pytest.mark.parametrize(
    "offline",
    [
        PartitionRecord(NO_LEADER, 7, (), 1, partition_epoch=200, elr=(4,)),
        PartitionRecord(NO_LEADER, 7, (), 1, partition_epoch=200, last_known_elr=(4,)),
    ],
    ids=["eligible leader replica", "last known leader"],
)
def test_a_cancel_of_an_offline_partition_keeps_the_replica_holding_its_records(
    offline: PartitionRecord,
) -> None:
    """Review 15 H1: broker 4, added by the reassignment, led alone and acknowledged writes,
    then failed too: the ISR is empty and 4 is the ELR (or the last known leader). A cancel
    dropped 4 (and StopReplica deleted its log): the partition could come back only by an
    unclean election, without the records 4 alone held."""
    m = reassigning((), leader=NO_LEADER)
    m.partitions[("t", 0)] = offline
    with pytest.raises(TidewaterError) as info:
        start_reassignment(m, ("t", 0), (1, 2, 3), EPOCH)
    assert info.value.code == ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE
    assert "none of [4], the replicas holding every committed record" in str(info.value)
    # Broker 4 stays a target: allowed, and the eligible one stays eligible.
    change = start_reassignment(m, ("t", 0), (1, 4, 3), EPOCH).change
    assert (change.after.elr + change.after.last_known_elr) == (4,)
    # With unclean election allowed, the operator may give those records up.
    m.topics["t"].configs["unclean.leader.election.enable"] = "true"
    change = start_reassignment(m, ("t", 0), (1, 2, 3), EPOCH).change
    assert (change.after.leader, change.after.elr, change.after.last_known_elr) == (
        NO_LEADER,
        (),
        (),
    )


def test_a_reassignment_whose_targets_are_in_the_isr_completes() -> None:
    m = reassigning((3, 1, 2, 4), leader=3)
    step = complete_reassignment(m, ("t", 0), EPOCH)
    assert step is not None
    after = step.change.after
    # Broker 3 leaves: leadership goes to the first target in the ISR.
    assert (after.leader, after.leader_epoch, after.isr) == (1, 8, (1, 2, 4))
    assert (step.replicas, step.in_flight, step.stopping) == ((1, 2, 4), None, (3,))


def test_a_reassignment_whose_targets_cannot_lead_yet_stays_in_flight() -> None:
    # A new controller has heard from no broker: the leader must move (it is fenced), and no
    # target could lead. It completes once one can (at an ISR change, or the grace period's end).
    m = reassigning((1, 2, 4, 3), leader=1)
    for broker in m.brokers.values():
        broker.fenced = True
    assert complete_reassignment(m, ("t", 0), EPOCH) is None


def test_a_new_controller_in_its_grace_period_completes_without_moving_an_unheard_leader() -> None:
    """Review 16 L3: in its grace period a new controller that had not heard from broker 1,
    the leader and a target, moved its leadership to complete a reassignment (the grace rule:
    no leader it has not heard from moves). It waits for the grace period's end now."""
    m = reassigning((1, 2, 4), leader=1)
    m.brokers[1].fenced = True  # not heard from yet
    assert complete_reassignment(m, ("t", 0), EPOCH, in_grace=True) is None
    step = complete_reassignment(m, ("t", 0), EPOCH)
    assert step is not None and step.change.after.leader == 2


def test_a_cancel_a_previous_version_left_in_flight_completes() -> None:
    """Review 17 L1: a version before 0f6f378 stored a cancel in flight (its first write, with
    the replica it dropped still assigned, as `dropping`), which completed at once when
    resumed. It still does, though broker 3, an original replica, is out of the ISR, and
    broker 4 gets its StopReplica."""
    m = reassigning((1, 2), leader=1)
    stored = m.topics["t"].to_json() | {
        "reassignments": {"0": {"original": [1, 2, 3], "target": [1, 2, 3], "dropping": [4]}}
    }
    m.topics["t"] = TopicState.from_json("t", stored)
    step = complete_reassignment(m, ("t", 0), EPOCH)
    assert step is not None
    assert (step.replicas, step.in_flight, step.stopping) == ((1, 2, 3), None, (4,))
    assert (step.change.after.leader, step.change.after.isr) == (1, (1, 2))


def test_partitions_stored_without_a_leader_and_isr_start_as_new_ones() -> None:
    # A controller died between storing topic n (and partition 2 of t) and their state.
    m = model(fenced=(3,))
    m.topics["n"] = TopicState("n", {}, {0: (3, 1), 1: (2, 3)})
    m.topics["t"].assignment[2] = (3, 2, 1)
    changes = changes_for_unrecorded_partitions(m, EPOCH)
    assert [(c.tp, c.before, c.after.leader, c.after.isr) for c in changes] == [
        (("n", 0), None, 1, (1,)),
        (("n", 1), None, 2, (2,)),
        (("t", 2), None, 2, (2, 1)),
    ]


# -- eligible leader replicas (KIP-966) -------------------------------------------------------


def min_isr_2(*, fenced: tuple[int, ...] = ()) -> ClusterModel:
    m = model(fenced=fenced)
    m.topics["t"].configs["min.insync.replicas"] = "2"
    return m


def test_replicas_leaving_an_isr_below_min_insync_join_the_elr_until_it_is_back() -> None:
    m = min_isr_2()
    shrink = validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2), EPOCH)
    assert shrink is not None and shrink.after.elr == (), "ISR {1, 2} meets min.insync.replicas"
    m.partitions[("t", 0)] = shrink.after
    shrink = validate_isr_change(m, 1, ("t", 0), 5, 100, (1,), EPOCH)
    assert shrink is not None and shrink.after.elr == (2,), "3 left while the ISR met it"
    m.partitions[("t", 0)] = shrink.after
    expand = validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 3), EPOCH)
    assert expand is not None and expand.after.elr == ()


def test_a_replica_back_in_an_isr_below_min_insync_leaves_the_elr() -> None:
    m = min_isr_2()
    m.topics["t"].configs["min.insync.replicas"] = "3"
    m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1,), elr=(2, 3))
    change = validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2), EPOCH)
    assert change is not None and (change.after.isr, change.after.elr) == ((1, 2), (3,))


def test_whole_cluster_clean_shutdown_then_a_clean_election_from_the_elr() -> None:
    """The README's old limitation: 1, 2 and 3 stop cleanly one after another; 1 and 2 come
    back, 3 (the last ISR member) never does. 2 left the ISR when it was below
    min.insync.replicas, so it holds every committed record and leads, cleanly."""
    m = min_isr_2()
    for b in (1, 2):
        commit(m, changes_for_controlled_shutdown(m, b, EPOCH))
        m.brokers[b].fenced = True
        commit(m, changes_for_unusable_broker(m, b, EPOCH))
    p0 = m.partitions[("t", 0)]
    assert (p0.leader, p0.isr, p0.elr) == (3, (3,), (2,))
    m.brokers[3].fenced = True
    commit(m, changes_for_unusable_broker(m, 3, EPOCH))
    p0 = m.partitions[("t", 0)]
    assert (p0.leader, p0.isr, p0.elr, p0.last_known_elr) == (NO_LEADER, (), (2, 3), (3,))
    # 1 and 2 register after clean shutdowns (their registrations fence nothing more), and
    # heartbeat.
    for b in (1, 2):
        assert commit(m, changes_for_unusable_broker(m, b, EPOCH)) == {}
        m.brokers[b].fenced = False
    changes = {c.tp: c for c in changes_for_offline_partitions(m, EPOCH)}
    elected = changes[("t", 0)]
    assert not elected.unclean
    assert (elected.after.leader, elected.after.isr, elected.after.elr) == (2, (2,), (3,))
    assert elected.after.last_known_elr == ()
    # 1 catches up: the ISR meets min.insync.replicas again, and the ELR is cleared.
    m.partitions[("t", 0)] = elected.after
    epoch = elected.after.leader_epoch
    back = validate_isr_change(m, 2, ("t", 0), epoch, 100, (2, 1), EPOCH)
    assert back is not None and (back.after.isr, back.after.elr) == ((2, 1), ())


def test_an_unclean_restart_leaves_the_elr_and_the_partition_stays_offline() -> None:
    m = min_isr_2(fenced=(1, 2, 3))
    m.partitions[("t", 0)] = PartitionRecord(NO_LEADER, 8, (), 1, 100, (2, 3), (3,))
    (change,) = [
        c for c in changes_for_unusable_broker(m, 2, EPOCH, unclean_restart=True) if c.tp[1] == 0
    ]
    # The ELR alone changes: the leader epoch stays (Kafka's), only the partition epoch moves.
    assert (change.after.isr, change.after.elr, change.after.leader_epoch) == ((), (3,), 8)
    commit(m, [change])
    m.brokers[1].fenced = m.brokers[2].fenced = False
    assert [c for c in changes_for_offline_partitions(m, EPOCH) if c.tp[1] == 0] == []


def test_an_unclean_restart_of_an_elr_member_keeps_the_leader_and_its_epoch() -> None:
    """Leader 1 alone in the ISR, 2 and 3 eligible; 2 comes back from a crash. Only the ELR
    changes: the leader epoch stays (before, it moved, and the followers restarted their
    fetch), the write is fenced by the partition epoch it read, and the ISR and last known
    leader stay as they were."""
    m = min_isr_2(fenced=(2,))
    before = PartitionRecord(1, 8, (1,), 1, 100, (2, 3))
    m.partitions[("t", 0)] = before
    (change,) = [
        c for c in changes_for_unusable_broker(m, 2, EPOCH, unclean_restart=True) if c.tp[1] == 0
    ]
    assert change.after == before.with_(elr=(3,), controller_epoch=EPOCH)
    assert change.expected_partition_epoch == 100


def test_an_isr_proposal_naming_the_partition_epoch_before_an_elr_only_change_is_stale() -> None:
    """Leader 1 proposed ISR {1, 2} at partition epoch 100 when an unclean restart of 3 took
    it out of the ELR (committed at 130, the leader epoch kept): the proposal is refused as
    stale, though its leader epoch is current, and the leader keeps its committed ISR. Its
    next proposal, at the partition epoch its LeaderAndIsr tells it, commits."""
    m = min_isr_2(fenced=(3,))
    m.partitions[("t", 0)] = PartitionRecord(1, 5, (1,), 1, 100, (2, 3))
    (change,) = [
        c for c in changes_for_unusable_broker(m, 3, EPOCH, unclean_restart=True) if c.tp[1] == 0
    ]
    m.partitions[("t", 0)] = change.after.with_(partition_epoch=130)
    with pytest.raises(TidewaterError) as info:
        validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2), EPOCH)
    assert info.value.code == ErrorCode.INVALID_UPDATE_VERSION
    again = validate_isr_change(m, 1, ("t", 0), 5, 130, (1, 2), EPOCH)
    assert again is not None and (again.after.isr, again.after.elr) == ((1, 2), ())
    assert again.after.leader_epoch == 5


def test_a_fenced_last_isr_member_hands_over_to_a_live_elr_member_at_once() -> None:
    m = min_isr_2(fenced=(1,))
    m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1,), elr=(2,))
    (change,) = [c for c in changes_for_unusable_broker(m, 1, EPOCH) if c.tp[1] == 0]
    assert not change.unclean
    assert (change.after.leader, change.after.isr, change.after.elr) == (2, (2,), (1,))


def test_an_unclean_election_clears_the_elr() -> None:
    m = min_isr_2(fenced=(1, 2))
    m.topics["t"].configs["unclean.leader.election.enable"] = "true"
    m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(leader=NO_LEADER, isr=(1,), elr=(2,))
    change = unclean_leader_change(m, ("t", 0), EPOCH)
    assert change.unclean and (change.after.leader, change.after.elr) == (3, ())


def test_min_insync_above_the_replication_factor_counts_as_the_replication_factor() -> None:
    m = model()
    m.topics["t"].configs["min.insync.replicas"] = "5"
    change = validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2), EPOCH)
    assert change is not None and change.after.elr == (3,)
    m.partitions[("t", 0)] = change.after
    change = validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2, 3), EPOCH)
    assert change is not None and change.after.elr == ()


def test_a_lower_min_insync_clears_the_elr_of_isrs_that_meet_it() -> None:
    m = min_isr_2()
    m.topics["t"].configs["min.insync.replicas"] = "3"
    m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1,), elr=(2, 3))
    m.partitions[("t", 1)] = m.partitions[("t", 1)].with_(isr=(2, 3), elr=(1,))
    assert elr_changes_for_configs(m, m.topics["t"], EPOCH) == []
    lower = TopicState("t", {"min.insync.replicas": "2"}, m.topics["t"].assignment)
    (change,) = elr_changes_for_configs(m, lower, EPOCH)
    assert change.tp == ("t", 1) and change.after.elr == ()
    # The leader epoch stays (Kafka's): brokers apply the newer partition epoch alone.
    assert change.after.leader_epoch == m.partitions[("t", 1)].leader_epoch


def test_a_topic_without_its_own_min_insync_takes_the_controllers() -> None:
    """The controller's --min-insync-replicas (Kafka's controller config) is the value of a
    topic without the override, as the brokers' default is theirs: with 2 the ELR is kept as
    for a topic that sets 2 (before, as for 1: the ISR {1} cleared it). The override wins."""
    m = model()
    m.min_insync_replicas = 2
    shrink = validate_isr_change(m, 1, ("t", 0), 5, 100, (1, 2), EPOCH)
    assert shrink is not None and shrink.after.elr == ()
    m.partitions[("t", 0)] = shrink.after
    shrink = validate_isr_change(m, 1, ("t", 0), 5, 100, (1,), EPOCH)
    assert shrink is not None and shrink.after.elr == (2,)
    m.topics["t"].configs["min.insync.replicas"] = "1"
    shrink = validate_isr_change(m, 1, ("t", 0), 5, 100, (1,), EPOCH)
    assert shrink is not None and shrink.after.elr == ()


def test_deleting_a_topics_min_insync_falls_back_to_the_controllers() -> None:
    """The override of 3 goes: the ISR {2, 3} is still below the controller's 3, so its ELR
    stays (before, the fallback was 1 and cleared it); below a controller's 2 it goes."""
    m = model()
    m.topics["t"].configs["min.insync.replicas"] = "3"
    m.partitions[("t", 1)] = m.partitions[("t", 1)].with_(isr=(2, 3), elr=(1,))
    deleted = TopicState("t", {}, m.topics["t"].assignment)
    m.min_insync_replicas = 3
    assert elr_changes_for_configs(m, deleted, EPOCH) == []
    m.min_insync_replicas = 2
    (change,) = elr_changes_for_configs(m, deleted, EPOCH)
    assert change.tp == ("t", 1) and change.after.elr == ()


def test_a_lower_controller_min_insync_clears_the_elrs_its_isrs_meet() -> None:
    """The ELRs of a controller whose --min-insync-replicas was 3 (ISRs of two kept one); its
    successor runs with 2: the partitions taking the default lose their ELR (a leader with two
    in sync advances the HW without the third), one whose own value is 3 keeps it."""
    m = model()
    m.topics["u"] = TopicState("u", {"min.insync.replicas": "3"}, {0: (1, 2, 3)})
    m.partitions[("t", 0)] = m.partitions[("t", 0)].with_(isr=(1, 2), elr=(3,))
    m.partitions[("t", 1)] = m.partitions[("t", 1)].with_(isr=(2,), elr=(3, 1))
    m.partitions[("u", 0)] = m.partitions[("t", 0)]
    m.min_insync_replicas = 3
    assert stale_elr_changes(m, EPOCH) == []
    m.min_insync_replicas = 2
    (change,) = stale_elr_changes(m, EPOCH)
    assert change.tp == ("t", 0) and (change.after.isr, change.after.elr) == ((1, 2), ())
    assert change.after.leader_epoch == m.partitions[("t", 0)].leader_epoch
    assert change.after.controller_epoch == EPOCH


def test_a_partition_record_stored_without_an_elr_loads_with_none() -> None:
    record = PartitionRecord(1, 5, (1,), 3, elr=(2,), last_known_elr=())
    assert PartitionRecord.from_json(record.to_json(), 9) == record.with_(partition_epoch=9)
    old = {"leader": 1, "leader_epoch": 5, "isr": [1], "controller_epoch": 3}
    assert PartitionRecord.from_json(old, 9).elr == ()
