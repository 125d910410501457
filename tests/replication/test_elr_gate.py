"""A leader counts its ISR as below min.insync.replicas while the ELR committed with it is not
empty (KIP-966): the controller's rules (controller.core) and a leader's Partition together,
in the orders the real components can run them. The controller computes ELRs by its own
min ISR at once; a leader learns a topic's new value later (UpdateMetadata), or never has
the controller's default. Before, a leader on a lower value advanced the HW past replicas the
controller had just made eligible to lead, and a later clean election of one lost the records
it had acknowledged (review 12, R6)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from tests.replication.in_memory import MemoryLog
from tidewater.controller import core
from tidewater.controller.model import BrokerState, ClusterModel, PartitionRecord, TopicState
from tidewater.errors import NotEnoughReplicas
from tidewater.replication.partition import (
    ACKS_ALL,
    FollowerFetch,
    LeaderAndIsr,
    Partition,
    ReplicationConfig,
)

LAG = 1_000
T0 = 1_000_000
TP = ("t", 0)
MIN_ISR_1 = ReplicationConfig(LAG, 1)
MIN_ISR_2 = ReplicationConfig(LAG, 2)


def broker_epoch(broker_id: int) -> int:
    return 10 + broker_id


def state_of(record: PartitionRecord, replicas: tuple[int, ...]) -> LeaderAndIsr:
    """What LeaderAndIsr (or an AlterIsr answer) tells the leader of a committed record."""
    return LeaderAndIsr(
        record.leader,
        record.leader_epoch,
        record.isr,
        replicas,
        record.partition_epoch,
        record.controller_epoch,
        elr=record.elr,
    )


@dataclass
class Setup:
    model: ClusterModel
    leader: Partition
    logs: dict[int, MemoryLog]
    replicas: tuple[int, ...]

    def commit(self, change: core.PartitionChange) -> PartitionRecord:
        """The controller's etcd write: the next partition epoch."""
        record = change.after.with_(partition_epoch=self.model.partitions[TP].partition_epoch + 1)
        self.model.partitions[TP] = record
        return record

    def append(self, payload: str, now: int) -> bool:
        self.logs[1].append_as_leader([payload], self.leader.leader_epoch)
        return self.leader.after_leader_append(now)

    def acknowledged(self) -> list[str]:
        """The records below the leader's HW: acks=all produces of them were answered."""
        batches = self.logs[1].read(0, max_offset=self.leader.high_watermark)
        return [r for batch in batches for r in batch.payload]

    def held_by(self, broker_id: int) -> list[str]:
        return [r for batch in self.logs[broker_id].batches for r in batch.payload]


def in_sync(replicas: tuple[int, ...]) -> Setup:
    """Topic t's min.insync.replicas is 1 (the topic's own) at the controller and the leader;
    broker 1 leads partition 0 on `replicas`, all in sync holding r0..r2 (HW 3). Then the
    operator raises it to 2 at the controller (alter_topic_configs): the UpdateMetadata that
    brings it to the leader is still on its way."""
    model = ClusterModel(min_insync_replicas=1)
    for b in replicas:
        model.brokers[b] = BrokerState(b, "h", 1, "", f"i{b}", broker_epoch(b), fenced=False)
    model.topics["t"] = TopicState("t", {"min.insync.replicas": "1"}, {0: replicas})
    model.partitions[TP] = PartitionRecord(1, 0, replicas, 1, partition_epoch=100)
    logs = {b: MemoryLog() for b in replicas}
    # The leader's metadata knows which brokers are fenced (UpdateMetadata).
    leader = Partition(
        "t", 0, 1, logs[1], MIN_ISR_1, 0, lambda b: None if model.brokers[b].fenced else 10 + b
    )
    leader.make_leader(state_of(model.partitions[TP], replicas), T0)
    for i in range(3):
        logs[1].append_as_leader([f"r{i}"], 0)
    leader.after_leader_append(T0)
    for b in replicas[1:]:
        logs[b].append_as_follower(logs[1].read(0))
        leader.on_follower_fetch(FollowerFetch(b, 3, 0, 0, 0, broker_epoch(b)), T0)
    assert leader.high_watermark == 3
    raised = replace(model.topics["t"], configs={"min.insync.replicas": "2"})
    assert core.elr_changes_for_configs(model, raised, 1) == []  # a higher value clears none
    model.topics["t"] = raised
    return Setup(model, leader, logs, replicas)


def elected_after_the_leader_goes(s: Setup) -> int:
    """Leader 1 stops (no other ISR member to hand over to) and is fenced: the controller
    elects, cleanly. Returns the new leader."""
    s.model.brokers[1].fenced = True
    [change] = core.changes_for_unusable_broker(s.model, 1, 1)
    assert not change.unclean
    return change.after.leader


def test_a_shrink_the_leader_proposes_while_a_raise_is_on_its_way_holds_the_hw() -> None:
    """Followers 2 and 3 stall; the leader, still on 1, proposes ISR {1}; the controller
    commits it with ELR {2, 3} by its 2. The answer carries the ELR: the leader holds the HW
    and refuses acks=all, though its own value is still 1. Before, its HW passed r3 and the
    next acks=all record, both acknowledged, and an ELR member elected later lacked them."""
    s = in_sync((1, 2, 3))
    s.leader.check_append(ACKS_ALL)
    s.append("r3", T0)  # acks=all: ISR {1, 2, 3} must hold it
    now = T0 + 2 * LAG
    shrink = s.leader.maybe_shrink_isr(now)
    assert shrink is not None and shrink.new_isr == (1,)
    change = core.validate_isr_change(
        s.model, 1, TP, 0, shrink.partition_epoch, shrink.new_isr, 1, shrink.new_isr_broker_epochs
    )
    assert change is not None
    committed = s.commit(change)
    assert (committed.isr, committed.elr) == ((1,), (2, 3))

    assert s.leader.on_alter_isr_result(shrink, state_of(committed, ()), None, now) is False
    assert (s.leader.elr, s.leader.under_min_isr) == ((2, 3), True)
    assert s.leader.high_watermark == 3
    assert s.leader.enough_replicas_for(4) is None, "r3 is not acknowledged"
    with pytest.raises(NotEnoughReplicas) as refused:
        s.leader.check_append(ACKS_ALL)
    assert refused.value.message == (
        "t-0: ISR [1] is below min.insync.replicas as the controller counts it "
        "(eligible leader replicas [2, 3])"
    )
    assert s.append("acks-1", now) is False
    # The UpdateMetadata with 2 arrives: nothing changes.
    assert s.leader.reconfigure(MIN_ISR_2, now) is False
    assert s.leader.high_watermark == 3

    assert elected_after_the_leader_goes(s) == 2
    assert s.acknowledged() == ["r0", "r1", "r2"]
    assert s.held_by(2)[:3] == s.acknowledged()


def test_a_shrink_the_controller_makes_while_a_raise_is_on_its_way_holds_the_hw() -> None:
    """Partition on 1 and 2; follower 2's broker is fenced right after the raise: the
    controller takes it out of the ISR (a new leader epoch) with ELR {2} by its 2. Until the
    leader applies that LeaderAndIsr its ISR still names 2, so the HW waits for 2; once
    applied, the ELR holds it. Before, the leader on 1 with ISR {1} advanced the HW alone."""
    s = in_sync((1, 2))
    s.append("r3", T0)  # acks=all, accepted with ISR {1, 2}
    s.model.brokers[2].fenced = True
    [change] = core.changes_for_unusable_broker(s.model, 2, 1)
    committed = s.commit(change)
    assert (committed.leader, committed.isr, committed.elr) == (1, (1,), (2,))
    assert s.leader.high_watermark == 3, "2 is in the ISR the leader has"

    state = state_of(committed, s.replicas)
    s.leader.check_newer(state)
    assert s.leader.make_leader(state, T0 + 1) is False
    assert s.leader.high_watermark == 3
    assert s.append("acks-1", T0 + 1) is False
    with pytest.raises(NotEnoughReplicas):
        s.leader.check_append(ACKS_ALL)

    # 2 comes back (it shut down cleanly: it stays eligible) and 1 goes.
    s.model.brokers[2].fenced = False
    assert elected_after_the_leader_goes(s) == 2
    assert s.held_by(2)[:3] == s.acknowledged() == ["r0", "r1", "r2"]


def behind_an_elr(replicas: tuple[int, ...] = (1, 2, 3)) -> Setup:
    """in_sync, then follower 2 and 3 stall and the leader's shrink to ISR {1} commits with
    ELR {2, 3}; r3 and an acks=1 record wait above the HW (3)."""
    s = in_sync(replicas)
    s.append("r3", T0)
    shrink = s.leader.maybe_shrink_isr(T0 + 2 * LAG)
    assert shrink is not None
    change = core.validate_isr_change(s.model, 1, TP, 0, shrink.partition_epoch, (1,), 1)
    assert change is not None
    s.leader.on_alter_isr_result(shrink, state_of(s.commit(change), ()), None, T0 + 2 * LAG)
    s.append("acks-1", T0 + 2 * LAG)
    assert (s.leader.elr, s.leader.high_watermark) == ((2, 3), 3)
    return s


def test_the_isr_growing_back_clears_the_elr_and_releases_the_hw_at_once() -> None:
    """Follower 2 catches up: the leader proposes ISR {1, 2}, which meets the controller's 2,
    so the controller commits it with the ELR cleared, and the answer moves the HW (the
    broker then completes the produces and fetches waiting on it)."""
    s = behind_an_elr()
    s.logs[2].append_as_follower(s.logs[1].read(3))
    now = T0 + 2 * LAG + 1
    outcome = s.leader.on_follower_fetch(FollowerFetch(2, 5, 0, 0, 0, broker_epoch(2)), now)
    expand = outcome.isr_proposal
    assert expand is not None and expand.new_isr == (1, 2)
    assert (outcome.high_watermark_changed, s.leader.high_watermark) == (False, 3)
    change = core.validate_isr_change(
        s.model, 1, TP, 0, expand.partition_epoch, expand.new_isr, 1, expand.new_isr_broker_epochs
    )
    assert change is not None
    committed = s.commit(change)
    assert (committed.isr, committed.elr) == ((1, 2), ())
    assert s.leader.on_alter_isr_result(expand, state_of(committed, ()), None, now) is True
    assert s.leader.high_watermark == 5
    assert s.leader.enough_replicas_for(5) is True
    s.leader.check_append(ACKS_ALL)


def test_a_lower_value_clears_the_elr_and_releases_the_hw_at_once() -> None:
    """The operator takes the raise back before the leader applied it: the controller clears
    the ELR alone (the leader epoch stays), and the leader, still on 1, advances the HW as it
    applies that LeaderAndIsr."""
    s = behind_an_elr()
    lowered = replace(s.model.topics["t"], configs={"min.insync.replicas": "1"})
    [change] = core.elr_changes_for_configs(s.model, lowered, 1)
    s.model.topics["t"] = lowered
    committed = s.commit(change)
    assert (committed.leader_epoch, committed.isr, committed.elr) == (0, (1,), ())
    state = state_of(committed, s.replicas)
    s.leader.check_newer(state)
    assert s.leader.make_leader(state, T0 + 2 * LAG + 1) is True
    assert s.leader.high_watermark == 5
    s.leader.check_append(ACKS_ALL)


def test_a_leader_and_isr_without_an_elr_is_as_before() -> None:
    """From a controller older than the field: no ELR, the leader's own value alone."""
    state = LeaderAndIsr(1, 0, (1,), (1, 2), 1)
    assert state.elr == ()
    leader = Partition("t", 0, 1, MemoryLog(), MIN_ISR_1, 0)
    leader.make_leader(state, T0)
    assert not leader.under_min_isr
    leader.check_append(ACKS_ALL)
