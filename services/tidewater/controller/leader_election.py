"""Partition leader selection: Kafka's five PartitionLeaderSelector strategies, as pure functions.

Each selector takes the partition's replicas in preference order (AR, or the target replicas of
a reassignment), its current LeaderAndIsr (the controller's `PartitionRecord`) and the live
brokers, and returns the new LeaderAndIsr with the replicas to send it to, or raises a named
error and changes nothing. Every election gives the new leader `leader_epoch + 1`. The result
keeps the current partition epoch and controller epoch: the caller stamps its controller epoch,
and the write to etcd compares against that partition epoch and assigns the next.

`imbalanced_brokers` is the periodic check behind auto.leader.rebalance.enable.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tidewater.controller.model import NO_LEADER, PartitionRecord, TopicPartition
from tidewater.errors import (
    ElectionNotNeeded,
    NoReplicaOnline,
    PreferredLeaderNotAvailable,
    StateChangeFailed,
)

DEFAULT_LEADER_IMBALANCE_PER_BROKER_PERCENTAGE = 10


@dataclass(frozen=True)
class ElectionResult:
    leader_and_isr: PartitionRecord
    # The live replicas that must receive the new LeaderAndIsr.
    replicas_to_notify: tuple[int, ...]
    # The leader was not in the ISR: records committed before may be lost (warn about it).
    unclean: bool = False


def _live(replicas: Sequence[int], live: Collection[int]) -> tuple[int, ...]:
    return tuple(r for r in replicas if r in live)


def _elect(current: PartitionRecord, leader: int, isr: Sequence[int]) -> PartitionRecord:
    return current.with_(leader=leader, leader_epoch=current.leader_epoch + 1, isr=tuple(isr))


def offline_partition_leader(
    assignment: Sequence[int],
    current: PartitionRecord,
    live: Collection[int],
    *,
    unclean_allowed: bool,
) -> ElectionResult:
    """Used when the leader is gone (failed, fenced) or a partition comes online: the first live
    ISR member in AR order leads; the new ISR is the live part of the current ISR.

    With an empty ISR (KIP-966, Kafka's PartitionChangeBuilder.electAnyLeader): the first live
    eligible leader replica leads, alone in the ISR, a clean election (it holds every committed
    record). With no ELR either, the last known leader leads alone once it is live, whether or
    not unclean election is enabled: it was the last ISR member (Kafka marks this election
    unclean: it may have come back from an unclean shutdown). Only then, and only if
    unclean.leader.election.enable is true for the topic, the first live replica leads alone.

    A partition that never had a leader (created, or recorded after a failover, while none of
    its replicas was usable: epoch 0, no leader) holds no record: it starts as a new one
    does, every live replica in its ISR."""
    live_replicas = _live(assignment, live)
    if current.leader == NO_LEADER and current.leader_epoch == 0 and live_replicas:
        return ElectionResult(_elect(current, live_replicas[0], live_replicas), live_replicas)
    clean = [r for r in live_replicas if r in current.isr]
    if clean:
        leader_and_isr = _elect(current, clean[0], _live(current.isr, live))
        return ElectionResult(leader_and_isr, live_replicas)
    if not current.isr:
        eligible = [r for r in live_replicas if r in current.elr]
        if eligible:
            return ElectionResult(_elect(current, eligible[0], eligible[:1]), live_replicas)
        last_known = current.last_known_elr
        if not current.elr and len(last_known) == 1 and last_known[0] in live_replicas:
            leader_and_isr = _elect(current, last_known[0], last_known)
            return ElectionResult(leader_and_isr, live_replicas, unclean=True)
    if not unclean_allowed:
        raise NoReplicaOnline(
            f"no ISR member of {list(current.isr)} (nor eligible leader replica of "
            f"{list(current.elr)}) is alive (replicas {list(assignment)}) and unclean leader "
            "election is disabled"
        )
    if not live_replicas:
        raise NoReplicaOnline(f"no replica of {list(assignment)} is alive")
    leader = live_replicas[0]
    return ElectionResult(_elect(current, leader, (leader,)), live_replicas, unclean=True)


def reassigned_partition_leader(
    target_replicas: Sequence[int], current: PartitionRecord, live: Collection[int]
) -> ElectionResult:
    """Used when a reassignment moves leadership to its target replicas (they have joined the
    ISR by then): the first live ISR member among them, in target order, leads; ISR kept."""
    candidates = [r for r in _live(target_replicas, live) if r in current.isr]
    if not candidates:
        raise NoReplicaOnline(
            f"none of the reassigned replicas {list(target_replicas)} is alive and in the ISR "
            f"{list(current.isr)}"
        )
    return ElectionResult(_elect(current, candidates[0], current.isr), _live(target_replicas, live))


def preferred_replica_leader(
    assignment: Sequence[int], current: PartitionRecord, live: Collection[int]
) -> ElectionResult:
    """Used by ElectLeaders (preferred) and the auto leader rebalance: the preferred replica
    (AR[0]) takes over if it is alive and in the ISR; ISR kept."""
    preferred = assignment[0]
    if current.leader == preferred:
        raise ElectionNotNeeded(f"preferred replica {preferred} already leads")
    if preferred not in live or preferred not in current.isr:
        raise PreferredLeaderNotAvailable(
            f"preferred replica {preferred} is not alive or not in the ISR {list(current.isr)}"
        )
    return ElectionResult(_elect(current, preferred, current.isr), _live(assignment, live))


def controlled_shutdown_leader(
    assignment: Sequence[int],
    current: PartitionRecord,
    live: Collection[int],
    shutting_down: Collection[int],
) -> ElectionResult:
    """Used when a broker asks for a controlled shutdown, for the partitions it leads: the first
    live ISR member in AR order that is not shutting down leads; the brokers shutting down
    leave the ISR. They still hear the decision, to become followers until they stop."""
    isr = [r for r in current.isr if r not in shutting_down]
    candidates = [r for r in _live(assignment, live) if r in isr]
    if not candidates:
        raise StateChangeFailed(
            f"no ISR member of {list(current.isr)} is alive besides the brokers shutting down "
            f"{sorted(shutting_down)}"
        )
    notify = tuple(r for r in assignment if r in live or r in shutting_down)
    return ElectionResult(_elect(current, candidates[0], isr), notify)


def no_op_leader(
    assignment: Sequence[int],
    current: PartitionRecord,
    live: Collection[int],
    *,
    bump_leader_epoch: bool = False,
) -> ElectionResult:
    """Used when the replicas must hear the partition's state again without a new leader (e.g.
    a replica set change): the leader and ISR stay; the epoch moves only if asked, to fence
    requests made under the old replica set."""
    leader_and_isr = (
        current.with_(leader_epoch=current.leader_epoch + 1) if bump_leader_epoch else current
    )
    return ElectionResult(leader_and_isr, _live(assignment, live))


def imbalanced_brokers(
    assignments: Mapping[TopicPartition, Sequence[int]],
    states: Mapping[TopicPartition, PartitionRecord],
    live: Collection[int],
    imbalance_percentage: float = DEFAULT_LEADER_IMBALANCE_PER_BROKER_PERCENTAGE,
) -> dict[int, tuple[TopicPartition, ...]]:
    """The auto leader rebalance check: for each broker, the share of the partitions it is the
    preferred replica of that it does not lead. Where that share exceeds
    leader.imbalance.per.broker.percentage, the partitions that a preferred replica election
    can move back now (preferred replica alive and in the ISR), by broker; brokers with none
    are left out."""
    preferred_of: dict[int, list[TopicPartition]] = {}
    for tp, replicas in sorted(assignments.items()):
        if tp in states and replicas:
            preferred_of.setdefault(replicas[0], []).append(tp)
    to_move = {}
    for broker, tps in preferred_of.items():
        not_led = [tp for tp in tps if states[tp].leader != broker]
        if len(not_led) * 100 <= imbalance_percentage * len(tps):
            continue
        movable = tuple(tp for tp in not_led if broker in live and broker in states[tp].isr)
        if movable:
            to_move[broker] = movable
    return to_move
