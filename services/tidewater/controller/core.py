"""The controller's decisions, as pure functions of the cluster model.

Each returns the partition changes to commit (to etcd, fenced by controller epoch and partition
epoch) and whom to tell; the Controller (controller.py) commits them and sends the requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tidewater.controller.leader_election import (
    controlled_shutdown_leader,
    offline_partition_leader,
    preferred_replica_leader,
    reassigned_partition_leader,
)
from tidewater.controller.model import (
    NO_BROKER_EPOCH,
    NO_LEADER,
    ClusterModel,
    PartitionRecord,
    Reassignment,
    TopicPartition,
    TopicState,
)
from tidewater.errors import NoReplicaOnline, TidewaterError
from tidewater.v1.errors_pb2 import ErrorCode


@dataclass(frozen=True)
class PartitionChange:
    tp: TopicPartition
    before: PartitionRecord | None
    after: PartitionRecord
    unclean: bool = False

    @property
    def expected_partition_epoch(self) -> int | None:
        """The mod_revision the write compares against; None: the key must not exist."""
        return self.before.partition_epoch if self.before is not None else None


def changes_for_unusable_broker(
    model: ClusterModel,
    broker_id: int,
    controller_epoch: int,
    *,
    unclean_restart: bool = False,
    in_grace: bool = False,
) -> list[PartitionChange]:
    """A broker was fenced, or registered a new incarnation: elect new leaders where it led,
    and take it out of every ISR it was in (Kafka's OnlineReplica → OfflineReplica), the
    last member too: the ISR may become empty, and the partition offline (KIP-966). Where that
    leaves the ISR below min.insync.replicas, it joins the eligible leader replicas (with_elr),
    so it may lead again, cleanly, once it is back.

    `unclean_restart`: its new incarnation registered without proof of a clean shutdown, so it
    may have lost an unflushed log tail: it leaves the eligible leader replicas too, and can
    lead again only as the last known leader (an empty ISR and ELR) or by unclean election.
    `in_grace`: a new controller has not heard from every broker yet, and those it has not
    may be alive and in sync: no unclean election until the grace period ends."""
    usable = model.usable_brokers() - {broker_id}
    unclean_shutdown = frozenset({broker_id}) if unclean_restart else frozenset()
    changes = []
    for tp, record in sorted(model.partitions.items()):
        if broker_id not in model.replicas(tp):
            continue
        others = tuple(b for b in record.isr if b != broker_id)
        if record.leader == broker_id:
            # Elected from the ISR without it, as Kafka's builder: emptied, its ELR may lead.
            without = record.with_(isr=others)
            change = _elect(model, tp, without, usable, controller_epoch, unclean=not in_grace)
            change = replace(change, before=record)
        elif broker_id in record.isr:
            after = record.with_(
                isr=others, leader_epoch=record.leader_epoch + 1, controller_epoch=controller_epoch
            )
            change = PartitionChange(tp, record, after)
        elif unclean_restart and broker_id in record.elr:
            # Leader and ISR stay; only the ELR shrinks.
            change = PartitionChange(tp, record, _elr_only(record, controller_epoch))
        else:
            continue
        changes.append(with_elr(model, change, unclean_shutdown))
    return changes


def changes_for_controlled_shutdown(
    model: ClusterModel, broker_id: int, controller_epoch: int
) -> list[PartitionChange]:
    """A broker asked to shut down: hand each partition it leads to another ISR member, and
    take it out of the ISRs it follows in. Partitions with no other ISR member keep it as
    leader (they stay available until it stops; the caller reports them as remaining)."""
    usable = model.usable_brokers() - {broker_id}
    changes = []
    for tp, record in sorted(model.partitions.items()):
        if broker_id not in record.isr:
            continue
        if record.leader == broker_id:
            try:
                result = controlled_shutdown_leader(model.replicas(tp), record, usable, {broker_id})
            except TidewaterError:
                continue
            after = result.leader_and_isr
        elif len(record.isr) > 1:
            after = record.with_(
                isr=tuple(b for b in record.isr if b != broker_id),
                leader_epoch=record.leader_epoch + 1,
            )
        else:
            continue
        change = PartitionChange(tp, record, after.with_(controller_epoch=controller_epoch))
        changes.append(with_elr(model, change))
    return changes


def preferred_leader_change(
    model: ClusterModel, tp: TopicPartition, controller_epoch: int
) -> PartitionChange:
    """ElectLeaders (preferred) and the auto rebalance; ElectionNotNeeded or
    PreferredLeaderNotAvailable when it cannot or need not happen."""
    record = model.partitions[tp]
    result = preferred_replica_leader(model.replicas(tp), record, model.usable_brokers())
    after = result.leader_and_isr.with_(controller_epoch=controller_epoch)
    return with_elr(model, PartitionChange(tp, record, after))


def unclean_leader_change(
    model: ClusterModel, tp: TopicPartition, controller_epoch: int, *, in_grace: bool = False
) -> PartitionChange:
    """ElectLeaders (unclean): an operator accepts data loss to bring a leaderless partition
    back; ELECTION_NOT_NEEDED while it has a leader, as Kafka's (review 23 #1: a leader not
    heard from yet after a failover, or one in controlled shutdown, was replaced by a replica
    out of the ISR). `in_grace`: refused, as the offline elections then are: an ISR member
    not heard from yet may be alive."""
    record = model.partitions[tp]
    if record.leader != NO_LEADER:
        raise TidewaterError(
            f"{tp[0]}-{tp[1]} has a leader ({record.leader})", ErrorCode.ELECTION_NOT_NEEDED
        )
    if in_grace:
        raise TidewaterError(
            f"{tp[0]}-{tp[1]}: the controller has not heard from every broker since its "
            "election (its grace period, up to one broker session timeout): retry after it",
            ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE,
        )
    usable = model.usable_brokers()
    try:
        result = offline_partition_leader(model.replicas(tp), record, usable, unclean_allowed=True)
    except NoReplicaOnline as e:
        raise TidewaterError(str(e), ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE) from None
    after = result.leader_and_isr.with_(controller_epoch=controller_epoch)
    return with_elr(model, PartitionChange(tp, record, after, result.unclean))


def changes_for_offline_partitions(
    model: ClusterModel, controller_epoch: int, *, in_grace: bool = False
) -> list[PartitionChange]:
    """Partitions without a usable leader that could get one now (a broker came back, or a
    new controller found leaders dead).

    `in_grace`: a new controller has not heard from every broker yet. A leader it has not
    heard from may be alive, so only partitions without any leader (offline) are elected, and
    only cleanly: the first ISR member it has heard from leads. The ISR keeps the members it
    has not heard from (they may be alive and in sync; those that never heartbeat leave it
    when the grace period ends)."""
    usable = model.usable_brokers()
    # A leader in controlled shutdown serves until it stops (review 23 #5: it was replaced
    # at the next broker's return, and the partition went offline).
    live = model.unfenced_brokers()
    changes = []
    for tp, record in sorted(model.partitions.items()):
        if record.leader in live or (in_grace and record.leader != NO_LEADER):
            continue
        change = _elect(model, tp, record, usable, controller_epoch, unclean=not in_grace)
        if change.after.leader == NO_LEADER and record.leader == NO_LEADER:
            continue  # offline, and already recorded as such
        if in_grace and change.after.leader in record.isr:
            change = replace(change, after=change.after.with_(isr=record.isr))
        changes.append(with_elr(model, change))
    return changes


def _elect(
    model: ClusterModel,
    tp: TopicPartition,
    record: PartitionRecord,
    usable: set[int],
    controller_epoch: int,
    unclean: bool = True,
) -> PartitionChange:
    """Offline election; unclean only if `unclean` and the topic allows it."""
    try:
        result = offline_partition_leader(
            model.replicas(tp),
            record,
            usable,
            unclean_allowed=unclean and model.topics[tp[0]].unclean_leader_election_enable,
        )
        after, unclean = result.leader_and_isr, result.unclean
    except NoReplicaOnline:
        # No eligible leader: stay offline, keeping the ISR (and ELR) so its members can lead
        # on return (an unclean election would lose acknowledged data).
        after, unclean = record.with_(leader=NO_LEADER, leader_epoch=record.leader_epoch + 1), False
    return PartitionChange(tp, record, after.with_(controller_epoch=controller_epoch), unclean)


def with_elr(
    model: ClusterModel,
    change: PartitionChange,
    unclean_shutdown: frozenset[int] = frozenset(),
    replicas: tuple[int, ...] | None = None,
) -> PartitionChange:
    """The change with its eligible leader replicas and last known leader (KIP-966, Kafka's
    PartitionChangeBuilder with ELR enabled), for every change the controller makes:

    - an ISR at or above min.insync.replicas (the topic's, else the controller's default; at
      most the replication factor: Kafka's effective min ISR) clears the ELR;
    - below it, the ELR is the replicas in the previous ISR or ELR that are not in the new
      ISR: they left the ISR while it was too small for the HW to advance (the leaders' HW
      rule), so each holds every committed record. `unclean_shutdown` (a broker whose new
      incarnation may have lost its unflushed tail) is left out;
    - an unclean election clears it: what the new leader lacks is no longer committed;
    - the ELR and the last known leader hold replicas only (`replicas`: a reassignment's), in
      replica order.

    An ISR that becomes empty records its last leader (or, without one, its last member) as
    the last known leader; a leader clears it. Kafka keeps the ELR of an election from it
    even when the one-member ISR meets min.insync.replicas=1; here it is cleared, because
    that leader advances the HW alone and the others fall behind."""
    before, after = change.before, change.after
    replicas = model.replicas(change.tp) if replicas is None else replicas
    if change.unclean or len(after.isr) >= _effective_min_isr(
        model, model.topics[change.tp[0]], replicas
    ):
        elr: tuple[int, ...] = ()
    else:
        was = set(before.isr + before.elr) if before is not None else set()
        left = was - set(after.isr) - unclean_shutdown
        elr = tuple(r for r in replicas if r in left)
    if not after.isr and before is not None and before.isr:
        last_known_elr = (before.leader if before.leader != NO_LEADER else before.isr[0],)
    elif after.leader != NO_LEADER or before is None:
        last_known_elr = ()
    else:
        last_known_elr = before.last_known_elr
    last_known_elr = tuple(r for r in last_known_elr if r in replicas)
    return replace(change, after=after.with_(elr=elr, last_known_elr=last_known_elr))


def elr_changes_for_configs(
    model: ClusterModel, topic: TopicState, controller_epoch: int
) -> list[PartitionChange]:
    """A topic's configs change (`topic`: with the new ones): partitions whose ISR meets the
    new min.insync.replicas clear their ELR, as Kafka's controller does on a min ISR change.
    Their leaders may advance the HW without the ELR members once they learn the new value,
    so the caller commits these first. A higher value changes no ELR."""
    changes = []
    for tp in model.partitions_of(topic.name):
        record = model.partitions.get(tp)
        if record is None or not record.elr:
            continue
        if len(record.isr) >= _effective_min_isr(model, topic, model.replicas(tp)):
            after = _elr_only(record, controller_epoch).with_(elr=())
            changes.append(PartitionChange(tp, record, after))
    return changes


def stale_elr_changes(model: ClusterModel, controller_epoch: int) -> list[PartitionChange]:
    """A new controller's first changes: every ELR whose ISR meets the effective min ISR goes,
    by the config path's rule (elr_changes_for_configs). Such an ELR is stale: it was recorded
    under a higher min ISR (the controller's --min-insync-replicas lowered across a restart),
    and the leader may advance the HW without its members, so none of them may be elected."""
    return [
        c
        for topic in model.topics.values()
        for c in elr_changes_for_configs(model, topic, controller_epoch)
    ]


def _effective_min_isr(model: ClusterModel, topic: TopicState, replicas: tuple[int, ...]) -> int:
    """Kafka's effective min ISR: the topic's min.insync.replicas (or the controller's
    default), at most its replication factor, as the leaders' HW rule takes it."""
    return min(model.min_insync_replicas_of(topic), len(replicas))


def _elr_only(record: PartitionRecord, controller_epoch: int) -> PartitionRecord:
    """The record for a change of its ELR alone: the leader epoch stays, as Kafka's, and only
    the partition epoch (the etcd write's revision) moves. Brokers apply a LeaderAndIsr in the
    leader epoch they have with a newer partition epoch without a new role: followers neither
    restart their fetch nor truncate, and the leader learns the partition epoch its next
    AlterIsr must name."""
    return record.with_(controller_epoch=controller_epoch)


def validate_isr_change(
    model: ClusterModel,
    leader_id: int,
    tp: TopicPartition,
    leader_epoch: int,
    partition_epoch: int,
    new_isr: tuple[int, ...],
    controller_epoch: int,
    new_isr_broker_epochs: tuple[int, ...] = (),
) -> PartitionChange | None:
    """AlterIsr for one partition: the proposer must lead it in the current epoch, name the
    current partition epoch, and propose only usable replicas that include itself. None: the
    partition already has that leader, leader epoch and ISR (a retry of a proposal whose answer
    was lost), so the caller answers with the current state (Kafka's equalsIgnoreZk).

    `new_isr_broker_epochs`: the broker epoch of each member as the leader saw it in its
    fetches (empty: none given; NO_BROKER_EPOCH: that member's not given). A member that has
    registered again since is ineligible (KIP-903, Kafka's ineligibleReplicasForIsr): the new
    incarnation may have lost its unflushed tail, so what the old one fetched vouches for
    nothing."""
    record = model.partitions.get(tp)
    if record is None or tp[0] not in model.topics:
        raise TidewaterError(
            f"{tp[0]}-{tp[1]} does not exist", ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        )
    if record.leader != leader_id or record.leader_epoch != leader_epoch:
        raise TidewaterError(
            f"{tp[0]}-{tp[1]}: broker {leader_id} at leader epoch {leader_epoch} is not the "
            f"leader (leader {record.leader}, epoch {record.leader_epoch})",
            ErrorCode.FENCED_LEADER_EPOCH,
        )
    if set(record.isr) == set(new_isr) and partition_epoch <= record.partition_epoch:
        return None
    if record.partition_epoch != partition_epoch:
        raise TidewaterError(
            f"{tp[0]}-{tp[1]}: partition epoch {partition_epoch} is stale (current "
            f"{record.partition_epoch})",
            ErrorCode.INVALID_UPDATE_VERSION,
        )
    if new_isr_broker_epochs and len(new_isr_broker_epochs) != len(new_isr):
        raise TidewaterError(
            f"{tp[0]}-{tp[1]}: {len(new_isr_broker_epochs)} broker epochs for the "
            f"{len(new_isr)} members of the proposed ISR {list(new_isr)}",
            ErrorCode.INVALID_REQUEST,
        )
    replicas = model.replicas(tp)
    usable = model.usable_brokers()
    ineligible = [b for b in new_isr if b not in replicas or b not in usable]
    if leader_id not in new_isr or ineligible or len(set(new_isr)) != len(new_isr):
        raise TidewaterError(
            f"{tp[0]}-{tp[1]}: proposed ISR {list(new_isr)} must include the leader and only "
            f"live, unfenced replicas (ineligible: {ineligible})",
            ErrorCode.INELIGIBLE_REPLICA,
        )
    stale = [
        f"broker {b} at epoch {e} (registered at {model.brokers[b].epoch})"
        for b, e in zip(new_isr, new_isr_broker_epochs, strict=False)  # empty: none given
        if e != NO_BROKER_EPOCH and e != model.brokers[b].epoch
    ]
    if stale:
        raise TidewaterError(
            f"{tp[0]}-{tp[1]}: proposed ISR {list(new_isr)} names stale incarnations: "
            + ", ".join(stale),
            ErrorCode.INELIGIBLE_REPLICA,
        )
    after = record.with_(isr=tuple(new_isr), controller_epoch=controller_epoch)
    return with_elr(model, PartitionChange(tp, record, after))


def initial_partition_records(
    replicas_by_partition: dict[int, tuple[int, ...]],
    topic: str,
    usable: set[int],
    controller_epoch: int,
) -> list[PartitionChange]:
    """New partitions: the first usable replica leads, the usable replicas form the ISR."""
    changes = []
    for partition, replicas in sorted(replicas_by_partition.items()):
        live = [b for b in replicas if b in usable]
        after = PartitionRecord(
            leader=live[0] if live else NO_LEADER,
            leader_epoch=0,
            isr=tuple(live),
            controller_epoch=controller_epoch,
        )
        changes.append(PartitionChange((topic, partition), None, after))
    return changes


def changes_for_unrecorded_partitions(
    model: ClusterModel, controller_epoch: int
) -> list[PartitionChange]:
    """Partitions whose assignment etcd holds without a LeaderAndIsr: a controller failed over
    between storing a topic (or partitions added to it) and their state. They start as new
    partitions do, as Kafka's new controller brings its NewPartitions online."""
    usable = model.usable_brokers()
    changes = []
    for name, topic in sorted(model.topics.items()):
        missing = {p: r for p, r in topic.assignment.items() if (name, p) not in model.partitions}
        changes += initial_partition_records(missing, name, usable, controller_epoch)
    return changes


# -- reassignment (KIP-455) ------------------------------------------------------------------


@dataclass(frozen=True)
class ReassignmentStep:
    """One step of a reassignment (KIP-455), written in one etcd txn as KRaft writes one
    record: the partition's state and the topic's assignment, so no failover stores one
    without the other. `in_flight` None: the reassignment is over (completed or cancelled).
    `stopping`: replicas it removes, sent StopReplica once it has committed (one that misses
    it finds its log stray at its next FULL metadata view)."""

    change: PartitionChange
    replicas: tuple[int, ...]
    in_flight: Reassignment | None
    stopping: tuple[int, ...]


def start_reassignment(
    model: ClusterModel,
    tp: TopicPartition,
    target: tuple[int, ...],
    controller_epoch: int,
    *,
    in_grace: bool = False,
) -> ReassignmentStep:
    """Assign the partition to original + target replicas, so the new ones start following;
    the leader epoch moves so every replica hears of the change. Cancelling or re-targeting a
    reassignment drops replicas it was adding: they leave the ISR too, and if one of them
    led, the first live ISR member among the remaining replicas leads (KIP-455). With no such
    member left, ELIGIBLE_LEADERS_NOT_AVAILABLE unless the topic allows unclean election.
    A cancel (back to the original replicas) is over in this one step, as Kafka's revert.

    `in_grace`: as for changes_for_offline_partitions, a new controller that has not heard
    from every broker elects no unclean leader, and the ISR keeps the members it has not
    heard from."""
    if not target or len(set(target)) != len(target):
        raise TidewaterError(
            f"{tp[0]}-{tp[1]}: target replicas {list(target)} must be distinct and non-empty",
            ErrorCode.INVALID_REQUEST,
        )
    unknown = [b for b in target if b not in model.brokers]
    if unknown:
        raise TidewaterError(
            f"{tp[0]}-{tp[1]}: brokers {unknown} are not registered", ErrorCode.BROKER_NOT_AVAILABLE
        )
    topic = model.topics[tp[0]]
    current = topic.reassignments.get(tp[1])
    original = current.original if current else model.replicas(tp)
    reassignment = Reassignment(original, target)
    replicas = reassignment.replicas
    record = model.partitions[tp]
    kept = record.with_(isr=tuple(b for b in record.isr if b in replicas))
    unclean_allowed = topic.unclean_leader_election_enable and not in_grace
    if record.leader == NO_LEADER or record.leader in replicas:
        # Who holds every committed record: the ISR; with none (offline), the eligible
        # leader replicas and the last leader (KIP-966). Dropping them all loses those records.
        holders = record.isr or record.elr + record.last_known_elr
        if holders and not set(holders) & set(replicas) and not unclean_allowed:
            raise TidewaterError(
                f"{tp[0]}-{tp[1]}: none of {list(holders)}, the replicas holding every "
                f"committed record, would remain a replica of {list(replicas)}",
                ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE,
            )
        # A partition that never led stays so (its epoch 0 says it, for its election once a
        # replica is usable: review 24 #6); every other change moves the epoch.
        never_led = record.leader_epoch == 0 and not holders
        after = kept if never_led else kept.with_(leader_epoch=record.leader_epoch + 1)
        unclean = False
    else:
        try:
            result = offline_partition_leader(
                replicas, kept, model.usable_brokers(), unclean_allowed=unclean_allowed
            )
        except NoReplicaOnline as e:
            raise TidewaterError(
                f"{tp[0]}-{tp[1]}: leader {record.leader} would no longer be a replica: {e}",
                ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE,
            ) from None
        after, unclean = result.leader_and_isr, result.unclean
        if in_grace and after.leader in kept.isr:
            after = after.with_(isr=kept.isr)
    change = PartitionChange(tp, record, after.with_(controller_epoch=controller_epoch), unclean)
    cancelled = set(target) == set(original)
    return _step(model, change, replicas, None if cancelled else reassignment)


def complete_reassignment(
    model: ClusterModel, tp: TopicPartition, controller_epoch: int, *, in_grace: bool = False
) -> ReassignmentStep | None:
    """Once every target replica is in the ISR: the targets alone are the replicas, the ISR
    keeps only them, and leadership moves to one of them if the leader is being removed (or
    is not usable). None while the targets are still catching up, or while none of them
    could lead (a new controller that has not heard from them yet, or a leader shutting
    down): it stays in flight, and completes at a later ISR change or once a new
    controller's grace period is over.

    `in_grace`: a new controller moves no leader it has not heard from yet (as
    changes_for_offline_partitions): None until the grace period is over."""
    reassignment = model.topics[tp[0]].reassignments[tp[1]]
    record = model.partitions[tp]
    # A cancel stored in flight is a version's before 0f6f378 (whose cancel took two steps):
    # it completes at once, as that version's did.
    cancelled = set(reassignment.target) == set(reassignment.original)
    if not cancelled and not set(reassignment.target) <= set(record.isr):
        return None
    usable = model.usable_brokers()
    if in_grace and record.leader not in usable:
        return None
    isr = tuple(b for b in record.isr if b in reassignment.target)
    after = record.with_(isr=isr, leader_epoch=record.leader_epoch + 1)
    if record.leader not in reassignment.target or record.leader not in usable:
        try:
            result = reassigned_partition_leader(reassignment.target, after, usable)
        except NoReplicaOnline:
            return None
        after = result.leader_and_isr.with_(leader_epoch=record.leader_epoch + 1)
    change = PartitionChange(tp, record, after.with_(controller_epoch=controller_epoch))
    return _step(model, change, reassignment.target, None)


def _step(
    model: ClusterModel,
    change: PartitionChange,
    replicas: tuple[int, ...],
    in_flight: Reassignment | None,
) -> ReassignmentStep:
    """The step that assigns the partition to `replicas`, its ELR among them, and stops the
    replicas it had that are not."""
    return ReassignmentStep(
        with_elr(model, change, replicas=replicas),
        replicas,
        in_flight,
        tuple(b for b in model.replicas(change.tp) if b not in replicas),
    )
