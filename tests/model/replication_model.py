"""A model check of the replication and controller rules together: Hypothesis plays one
partition on four brokers (three of them its first replicas) and their controller through any
order of produces, fetches, message deliveries, crashes, restarts, session expiries, controller
failovers, min.insync.replicas changes and reassignments (KIP-455: started, re-targeted,
cancelled, completed, resumed by a new controller), and after every step checks that nothing
committed or acknowledged is lost (the invariants at the end of ReplicationModel).

The rules under test are the real ones: the controller's pure decisions
(tidewater.controller.core) and the replica's state machine (tidewater.replication: Partition,
the follower's functions), over tests/replication/in_memory.py's MemoryLog. Around them, this
module plays what the services do with I/O, as small classes:

- ModelController: the controller's event handling as controller.py and service.py do it:
  commit a change (with the partition epoch compare), then tell the brokers; a reassignment's
  steps (the assignment and the partition's state in one txn), after which it may fail over
  before telling anyone;
- ModelBroker: a broker's log (it outlives a crash) and partition state (it does not), and
  what the replica manager does on a LeaderAndIsr, a StopReplica (its log deleted) or a
  topic config update (a FULL one also removes a stray log: broker/stray_logs.py's rule);
- the channels: each broker's control queue (LeaderAndIsr, StopReplica and metadata updates,
  in the order the controller sent them), and AlterIsr requests and answers, which arrive in
  any order; an answer may be lost after the controller committed (the leader sends the
  proposal again);
- History: what the checks hold the cluster to: the committed records (those the controller's
  leader's HW covered) and the acknowledged acks=all ones.

What the model leaves out: the network never cuts a live broker off the controller (a live
broker always heartbeats in time, so only a dead broker's session expires), retention, more
than one partition, unclean.leader.election.enable.

Run by tests/model/test_replication_model.py (and test_broken_rules.py, which shows it
catches deliberately broken rules); README, Tests and their helpers, says how to run it
longer.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Concatenate, ParamSpec, TypeVar

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from tests.replication.in_memory import MemoryLog, fetch_once
from tidewater.broker.stray_logs import ClusterView, find_stray_logs
from tidewater.controller import core
from tidewater.controller.core import PartitionChange
from tidewater.controller.model import (
    BrokerState,
    ClusterModel,
    PartitionRecord,
    Reassignment,
    TopicState,
)
from tidewater.errors import FencedLeaderEpoch, RequestTimedOut, TidewaterError
from tidewater.replication.partition import (
    ACKS_ALL,
    NO_LEADER,
    AlterIsrProposal,
    FollowerFetchOutcome,
    LeaderAndIsr,
    Partition,
    ReplicationConfig,
)
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "orders"
TP = (TOPIC, 0)
BROKER_IDS = (1, 2, 3, 4)
FIRST_REPLICAS = (1, 2, 3)  # the topic's assignment at creation; broker 4 is not a replica
LAG_MS = 1_000  # replica.lag.time.max.ms

# A record as the checks compare them: (the leader epoch of its batch, its payload).
Record = tuple[int, str]


def records_of(log: MemoryLog) -> list[Record]:
    return [(batch.epoch, payload) for batch in log.batches for payload in batch.payload]


# -- the channels ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LeaderAndIsrMessage:
    controller_epoch: int
    broker_epoch: int  # the registration it is meant for
    state: LeaderAndIsr
    # The topic's min.insync.replicas as the controller knew it when sending: a LeaderAndIsr
    # carries the topic's configs.
    min_insync_replicas: int


@dataclass(frozen=True)
class ConfigMessage:
    """An UpdateMetadata with the topic's configs (changed, or a FULL view's)."""

    controller_epoch: int
    broker_epoch: int
    min_insync_replicas: int
    # A FULL view's replicas of the partition and its leader epoch (the stray log rule reads
    # them); None: a delta.
    replicas: tuple[int, ...] | None = None
    leader_epoch: int = -1


@dataclass(frozen=True)
class StopReplicaMessage:
    """StopReplica (delete): the broker is no longer a replica."""

    controller_epoch: int
    broker_epoch: int


ControlMessage = LeaderAndIsrMessage | ConfigMessage | StopReplicaMessage


@dataclass(frozen=True)
class AlterIsrRequest:
    broker_id: int
    broker_epoch: int
    proposal: AlterIsrProposal


@dataclass(frozen=True)
class AlterIsrAnswer:
    request: AlterIsrRequest
    committed: LeaderAndIsr | None  # the partition's state after the request, if no error
    error: TidewaterError | None


@dataclass(frozen=True)
class Election:
    """A committed change of leader, for the check that the new leader holds every committed
    record (unclean: the last known leader's election, which Kafka marks unclean)."""

    leader: int
    unclean: bool


# -- the controller --------------------------------------------------------------------------


class ControllerFailed(Exception):
    """The controller fails over after a reassignment's step, before it tells the brokers (as
    planned by the machine's reassign rule)."""


P = ParamSpec("P")
R = TypeVar("R")


def controller_event(
    method: Callable[Concatenate[ModelController, P], R],
) -> Callable[Concatenate[ModelController, P], R | None]:
    """An event the controller handles from start to end, unless it fails over midway
    (ControllerFailed): then a new controller takes over from what etcd holds, and the event's
    answer is lost (None)."""

    @functools.wraps(method)
    def handle(self: ModelController, *args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return method(self, *args, **kwargs)
        except ControllerFailed:
            self.fail_over()
            return None

    return handle


class ModelController:
    """The active controller (any one of them: a failover keeps the model, as a new controller
    loads it from etcd). Partition epochs and broker epochs come from one counter, as both are
    etcd revisions."""

    def __init__(self) -> None:
        self.model = ClusterModel()
        self.epoch = 1
        self.revision = 0
        self.in_grace = False
        self.outbox: dict[int, deque[ControlMessage]] = {b: deque() for b in BROKER_IDS}
        self.elections: list[Election] = []  # committed, not yet checked
        # The reassignments whose completion committed: their targets, not yet checked.
        self.completions: list[Reassignment] = []
        # This controller fails over after the next completion's txn, before telling anyone.
        self.fails_completing = False

    @property
    def min_insync_replicas(self) -> int:
        return self.model.min_insync_replicas_of(self.model.topics[TOPIC])

    @property
    def record(self) -> PartitionRecord:
        return self.model.partitions[TP]

    @property
    def replicas(self) -> tuple[int, ...]:
        """The partition's assigned replicas (during a reassignment, targets and originals)."""
        return self.model.replicas(TP)

    def usable_broker_epoch(self, broker_id: int) -> int | None:
        """What a leader's metadata says of a follower (Partition's UsableBrokerEpoch)."""
        state = self.model.brokers.get(broker_id)
        return state.epoch if state is not None and state.usable else None

    def _next_revision(self) -> int:
        self.revision += 1
        return self.revision

    # -- what brokers ask ------------------------------------------------------------------

    def register(self, broker_id: int, clean_shutdown_epoch: int) -> int:
        """A broker (re)starts: a new incarnation, fenced until its first heartbeat. Its old
        one leaves every ISR and leadership; without proof that the old one stopped cleanly
        (`clean_shutdown_epoch`: its broker epoch) it leaves the ELR too. Returns the new
        broker epoch."""
        old = self.model.brokers.get(broker_id)
        if old is not None:
            clean = clean_shutdown_epoch == old.epoch
            self.fence(broker_id, unclean_restart=not clean)
        epoch = self._next_revision()
        self.model.brokers[broker_id] = BrokerState(
            broker_id, "localhost", 9092, "", f"incarnation-{epoch}", epoch
        )
        return epoch

    @controller_event
    def heartbeat(self, broker_id: int) -> None:
        self._heartbeat(broker_id)

    def _heartbeat(self, broker_id: int) -> None:
        """Its first heartbeat unfences it (controller.unfence): offline partitions may get a
        leader, and it learns the partition's state (if a replica) and a FULL view (the
        topic's configs and replicas). The last broker a new controller hears from ends its
        grace period, and what its predecessor cut short goes on."""
        state = self.model.brokers[broker_id]
        if not state.fenced or state.shutting_down:
            return
        state.fenced = False
        if TP not in self.model.partitions:
            return  # the cluster is starting: nothing to tell yet
        grace_ends = self.in_grace and not any(s.fenced for s in self.model.brokers.values())
        if grace_ends:
            self.in_grace = False
        changes = core.changes_for_offline_partitions(
            self.model, self.epoch, in_grace=self.in_grace
        )
        if not self.commit_and_send(changes):
            self.send_leader_and_isr([broker_id])
        self.outbox[broker_id].append(
            ConfigMessage(
                self.epoch,
                state.epoch,
                self.min_insync_replicas,
                self.replicas,
                self.record.leader_epoch,
            )
        )
        if grace_ends:
            self.finish_what_was_cut_short()

    def controlled_shutdown(self, broker_id: int) -> None:
        changes = core.changes_for_controlled_shutdown(self.model, broker_id, self.epoch)
        self.model.brokers[broker_id].shutting_down = True
        self.commit_and_send(changes)

    @controller_event
    def alter_isr(self, request: AlterIsrRequest) -> AlterIsrAnswer:
        """service.AlterIsr: a fenced or stale incarnation is refused whole; a valid change
        is committed (no LeaderAndIsr: the leader learns it from the answer), and completes a
        reassignment whose targets are all in the ISR now."""
        state = self.model.brokers.get(request.broker_id)
        if state is None or state.epoch != request.broker_epoch or state.fenced:
            refused = TidewaterError("stale or fenced broker", ErrorCode.STALE_BROKER_EPOCH)
            return AlterIsrAnswer(request, None, refused)
        p = request.proposal
        try:
            change = core.validate_isr_change(
                self.model,
                request.broker_id,
                TP,
                p.leader_epoch,
                p.partition_epoch,
                p.new_isr,
                self.epoch,
                p.new_isr_broker_epochs,
            )
        except TidewaterError as e:
            return AlterIsrAnswer(request, None, e)
        # None: a retry of what is committed already
        if change is not None and self.commit([change]):
            self.maybe_complete_reassignment()
        record = self.record
        committed = LeaderAndIsr(
            record.leader,
            record.leader_epoch,
            record.isr,
            (),
            record.partition_epoch,
            elr=record.elr,
        )
        return AlterIsrAnswer(request, committed, None)

    # -- what the controller decides on its own --------------------------------------------

    def create_topic(self, min_insync_replicas: int) -> None:
        configs = {"min.insync.replicas": str(min_insync_replicas)}
        self.model.topics[TOPIC] = TopicState(TOPIC, configs, {0: FIRST_REPLICAS})
        self.commit_and_send(
            core.initial_partition_records(
                {0: FIRST_REPLICAS}, TOPIC, self.model.usable_brokers(), self.epoch
            )
        )

    def fence(self, broker_id: int, unclean_restart: bool = False) -> None:
        """A session expired, or a new incarnation registered."""
        changes = core.changes_for_unusable_broker(
            self.model,
            broker_id,
            self.epoch,
            unclean_restart=unclean_restart,
            in_grace=self.in_grace,
        )
        self.model.brokers[broker_id].fenced = True
        self.commit_and_send(changes)

    def set_min_insync_replicas(self, value: int) -> None:
        """controller.alter_topic_configs: the ELRs a lower value makes stale go in the txn
        that stores it (their LeaderAndIsr carries the new value), then every broker gets
        it."""
        after = replace(self.model.topics[TOPIC], configs={"min.insync.replicas": str(value)})
        changes = core.elr_changes_for_configs(self.model, after, self.epoch)
        self.model.topics[TOPIC] = after
        self.commit_and_send(changes)
        for state in self.model.brokers.values():
            if state.usable:
                self.outbox[state.broker_id].append(ConfigMessage(self.epoch, state.epoch, value))

    def fail_over(self) -> None:
        """A new controller (epoch + 1) loads the model: every broker fenced until it
        heartbeats, no unclean election until the grace period ends, and stale ELRs cleared."""
        self.epoch += 1
        for state in self.model.brokers.values():
            state.fenced = True
            state.shutting_down = False
        self.in_grace = True
        self.fails_completing = False
        self.commit_and_send(core.stale_elr_changes(self.model, self.epoch))

    @controller_event
    def end_grace(self, live: set[int]) -> None:
        """The grace period is over: the `live` brokers have heartbeated by now (the last of
        them may have ended it); the others are gone and leave their ISRs and leaderships,
        and what the predecessor cut short goes on."""
        for broker_id in sorted(live):
            self._heartbeat(broker_id)
        if not self.in_grace:
            return
        self.in_grace = False
        for state in list(self.model.brokers.values()):
            if state.fenced:
                self.commit_and_send(
                    core.changes_for_unusable_broker(self.model, state.broker_id, self.epoch)
                )
        self.commit_and_send(core.changes_for_offline_partitions(self.model, self.epoch))
        self.finish_what_was_cut_short()

    # -- reassignment (controller.reassign and what follows) --------------------------------

    @controller_event
    def reassign(self, target: tuple[int, ...] | None, fails: bool = False) -> None:
        """AlterPartitionReassignments (`target` None: cancel, back to the original replicas):
        one step, the partition's state in a new leader epoch and the assignment in one txn,
        then StopReplica to the replicas it drops; it completes at once if its targets are in
        the ISR. Refused (nothing changes) as the controller refuses it. `fails`: the
        controller fails over after the txn, before telling anyone; "completing" is
        `fails_completing`'s."""
        topic = self.model.topics[TOPIC]
        if target is None:
            ongoing = topic.reassignments.get(TP[1])
            if ongoing is None:
                return  # NO_REASSIGNMENT_IN_PROGRESS
            target = ongoing.original
        try:
            step = core.start_reassignment(
                self.model, TP, target, self.epoch, in_grace=self.in_grace
            )
        except TidewaterError:
            return
        self.take_step(step, fails=fails)
        self.maybe_complete_reassignment()

    def maybe_complete_reassignment(self) -> None:
        if TP[1] not in self.model.topics[TOPIC].reassignments:
            return
        step = core.complete_reassignment(self.model, TP, self.epoch, in_grace=self.in_grace)
        if step is not None:
            self.completions.append(self.model.topics[TOPIC].reassignments[TP[1]])
            self.take_step(step, fails=self.fails_completing)

    def take_step(self, step: core.ReassignmentStep, *, fails: bool) -> None:
        """controller._take_step: the partition's state and the assignment in one txn (made
        from the current state: it commits), then the LeaderAndIsr and the StopReplica to the
        replicas it removes, unless the controller fails over first."""
        topic = self.model.topics[TOPIC]
        topic.assignment[TP[1]] = step.replicas
        if step.in_flight is None:
            topic.reassignments.pop(TP[1], None)
        else:
            topic.reassignments[TP[1]] = step.in_flight
        if fails:
            self.commit([step.change])
            raise ControllerFailed
        self.commit_and_send([step.change])
        for broker_id in step.stopping:
            self.stop_replica(broker_id)

    def finish_what_was_cut_short(self) -> None:
        """controller._finish_what_was_cut_short: once the grace period is over, a
        reassignment in flight whose targets are in the ISR completes."""
        self.maybe_complete_reassignment()

    def stop_replica(self, broker_id: int) -> None:
        """To its registered incarnation: the sender tries once even if fenced (a broker
        that misses it deletes the log as a stray one when it comes back)."""
        broker = self.model.brokers.get(broker_id)
        if broker is not None:
            self.outbox[broker_id].append(StopReplicaMessage(self.epoch, broker.epoch))

    # -- committing and telling ------------------------------------------------------------

    def commit(self, changes: list[PartitionChange]) -> list[PartitionChange]:
        """The etcd write: a change applies only over the partition epoch it was made from,
        and its revision is the new partition epoch."""
        committed = []
        for change in changes:
            current = self.model.partitions.get(change.tp)
            if (current.partition_epoch if current else None) != change.expected_partition_epoch:
                continue
            after = change.after.with_(partition_epoch=self._next_revision())
            self.model.partitions[change.tp] = after
            committed.append(replace(change, after=after))
            if after.leader != NO_LEADER and (
                change.before is None or change.before.leader != after.leader
            ):
                self.elections.append(Election(after.leader, change.unclean))
        return committed

    def commit_and_send(self, changes: list[PartitionChange]) -> list[PartitionChange]:
        committed = self.commit(changes)
        if committed:
            self.send_leader_and_isr(self.replicas)
        return committed

    def send_leader_and_isr(self, broker_ids: tuple[int, ...] | list[int]) -> None:
        """To each registered, unfenced broker (shutting down too: it follows until it
        stops) that is a replica, with the assigned replicas."""
        record = self.record
        replicas = self.replicas
        state = LeaderAndIsr(
            record.leader,
            record.leader_epoch,
            record.isr,
            replicas,
            record.partition_epoch,
            self.epoch,
            record.elr,
        )
        for broker_id in broker_ids:
            broker = self.model.brokers.get(broker_id)
            if broker is not None and not broker.fenced and broker_id in replicas:
                message = LeaderAndIsrMessage(
                    self.epoch, broker.epoch, state, self.min_insync_replicas
                )
                self.outbox[broker_id].append(message)


# -- a broker --------------------------------------------------------------------------------


class ModelBroker:
    def __init__(self, broker_id: int, controller: ModelController) -> None:
        self.broker_id = broker_id
        self.controller = controller
        self.log = MemoryLog()
        self.partition: Partition | None = None  # created by its first LeaderAndIsr
        self.alive = True
        self.epoch = 0  # the broker epoch of this incarnation's registration
        # The proof of a clean stop its next registration presents (the stopped incarnation's
        # broker epoch); 0: none, it crashed.
        self.clean_shutdown_epoch = 0
        self.checkpointed_high_watermark = 0
        self.controller_epoch = 0  # the newest controller it has heard from
        self.min_insync_replicas = 1  # the topic's, as this broker knows it
        self.lost_tail = False  # a crash cut its log once: an unclean election may lose data

    @property
    def leads(self) -> bool:
        """It is alive and believes it leads (perhaps deposed without knowing yet)."""
        return self.alive and self.partition is not None and self.partition.is_leader

    def config(self) -> ReplicationConfig:
        return ReplicationConfig(
            replica_lag_time_max_ms=LAG_MS, min_insync_replicas=self.min_insync_replicas
        )

    def take(self, message: ControlMessage, now_ms: int) -> None:
        """A control message: one from an older controller than it has heard from, or meant
        for another incarnation, is ignored."""
        if message.controller_epoch < self.controller_epoch or message.broker_epoch != self.epoch:
            return
        if isinstance(message, ConfigMessage) and message.replicas is not None:
            self._remove_stray_log(message)
        self.controller_epoch = message.controller_epoch
        if isinstance(message, StopReplicaMessage):
            self.delete_replica()
        elif isinstance(message, ConfigMessage):
            self.min_insync_replicas = message.min_insync_replicas
            if self.partition is not None:
                self.partition.reconfigure(self.config(), now_ms)
        else:
            self._leader_and_isr(message, now_ms)

    def _remove_stray_log(self, full: ConfigMessage) -> None:
        """replica_manager.update_metadata: a FULL view that no longer names this broker a
        replica finds its log stray (a StopReplica it missed while down, or lost while up:
        then it hosts the partition, in an older leader epoch than the view's)."""
        view = ClusterView(
            full=True,
            controller_epoch=full.controller_epoch,
            broker_epoch=full.broker_epoch,
            replicas={TP: full.replicas},
            leader_epochs={TP: full.leader_epoch},
            deleting_topics=frozenset(),
        )
        hosted = {} if self.partition is None else {TP: self.partition.leader_epoch}
        if find_stray_logs([TP], view, hosted, self.broker_id, self.epoch, self.controller_epoch):
            self.delete_replica()

    def delete_replica(self) -> None:
        """StopReplica (delete), or a stray log removed: no partition state, no log, no HW
        checkpoint; if it becomes a replica again, it starts from an empty log."""
        self.partition = None
        self.log = MemoryLog()
        self.checkpointed_high_watermark = 0
        self.lost_tail = False

    def _leader_and_isr(self, message: LeaderAndIsrMessage, now_ms: int) -> None:
        """replica_manager: a state that is no news changes nothing (not even the configs);
        else the configs first, then the role (or the ISR alone, in the same leader epoch)."""
        state = message.state
        if self.partition is not None:
            try:
                self.partition.check_newer(state)
            except FencedLeaderEpoch:
                return
        self.min_insync_replicas = message.min_insync_replicas
        if self.partition is None:
            self.partition = Partition(
                TOPIC,
                0,
                self.broker_id,
                self.log,
                self.config(),
                self.checkpointed_high_watermark,
                self.controller.usable_broker_epoch,
            )
        else:
            self.partition.reconfigure(self.config(), now_ms)
        if state.leader == self.broker_id:
            self.partition.make_leader(state, now_ms)
        else:
            self.partition.make_follower(state)

    def stop(self, lose_unflushed: int | None) -> None:
        """A clean stop (None), or a crash that loses the last `lose_unflushed` records."""
        self.alive = False
        if lose_unflushed is None:
            self.clean_shutdown_epoch = self.epoch
        else:
            self.clean_shutdown_epoch = 0
            cut = max(self.log.log_end_offset - lose_unflushed, 0)
            if cut < self.log.log_end_offset:
                self.log.crash_losing_tail(cut)
                self.lost_tail = True
        if self.partition is not None:
            self.checkpointed_high_watermark = self.partition.high_watermark
        self.partition = None

    def start(self) -> None:
        self.alive = True
        self.epoch = self.controller.register(self.broker_id, self.clean_shutdown_epoch)
        self.clean_shutdown_epoch = 0
        self.controller_epoch = 0


# -- what the checks hold the cluster to ------------------------------------------------------


@dataclass
class PendingProduce:
    """An acks=all produce waiting for the HW (Kafka's DelayedProduce)."""

    broker_id: int
    partition: Partition  # the partition state (of that incarnation) it was appended to
    leader_epoch: int
    offset: int
    payload: str


class History:
    def __init__(self) -> None:
        # Offset -> record: what the controller's leader's HW has covered.
        self.committed: list[Record] = []
        self.acknowledged: list[tuple[int, str]] = []  # (offset, payload) of acks=all records
        self.pending: list[PendingProduce] = []
        # An unclean election of a replica whose crash cut its log: what it lacks is lost, as
        # Kafka allows; nothing is checked from then on.
        self.data_loss_allowed = False


# -- which broker a rule acts on -------------------------------------------------------------

BrokerTest = Callable[["ReplicationModel", ModelBroker], bool]


def some_broker(test: BrokerTest) -> Callable[[ReplicationModel], bool]:
    """A rule's precondition: a broker passes `test` now."""
    return lambda machine: any(test(machine, b) for b in machine.brokers.values())


def a_broker(test: BrokerTest) -> st.SearchStrategy[int]:
    """A rule's broker argument: one that passes `test` now (the rule's precondition says one
    does), so no step is spent on a broker the rule cannot act on."""
    return st.runner().flatmap(
        lambda machine: st.sampled_from(
            [b.broker_id for b in machine.brokers.values() if test(machine, b)]
        )
    )


def leads(machine: ReplicationModel, b: ModelBroker) -> bool:
    return b.leads


def follows_a_live_leader(machine: ReplicationModel, b: ModelBroker) -> bool:
    return machine.leader_of(b) is not None


def has_control_messages(machine: ReplicationModel, b: ModelBroker) -> bool:
    return b.alive and bool(machine.controller.outbox[b.broker_id])


def is_alive(machine: ReplicationModel, b: ModelBroker) -> bool:
    return b.alive


def is_stopped(machine: ReplicationModel, b: ModelBroker) -> bool:
    return not b.alive


def is_stopped_and_unfenced(machine: ReplicationModel, b: ModelBroker) -> bool:
    return not b.alive and not machine.controller.model.brokers[b.broker_id].fenced


def is_alive_and_fenced(machine: ReplicationModel, b: ModelBroker) -> bool:
    state = machine.controller.model.brokers[b.broker_id]
    return b.alive and state.fenced and not state.shutting_down


def new_min_insync_replicas(machine: ReplicationModel) -> list[int]:
    current = machine.controller.min_insync_replicas
    return [v for v in (1, 2, 3) if v != current]


def reassignment_targets(machine: ReplicationModel) -> st.SearchStrategy[tuple[int, ...] | None]:
    """Any replicas, in any order (the first is the preferred leader); with one in flight,
    None too: cancel it."""
    targets = st.lists(st.sampled_from(BROKER_IDS), min_size=1, max_size=4, unique=True).map(tuple)
    if machine.controller.model.topics[TOPIC].reassignments:
        return st.none() | targets
    return targets


# How many of the rare events one run may have: more add little, and crowd out the produces
# and fetches between them that a failure needs.
MAX_STOPS = 4
MAX_FAILOVERS = 2
MAX_CONFIG_CHANGES = 3
MAX_REASSIGNMENTS = 3


# -- the state machine -----------------------------------------------------------------------


class ReplicationModel(RuleBasedStateMachine):
    """The cluster, what can happen to it next (the rules, each enabled only while it can
    act), and what must hold after every step (the invariants)."""

    alter_requests = Bundle("alter_requests")
    alter_answers = Bundle("alter_answers")

    def __init__(self) -> None:
        super().__init__()
        self.now_ms = 1_000_000
        self.controller = ModelController()
        self.brokers = {b: ModelBroker(b, self.controller) for b in BROKER_IDS}
        self.history = History()
        self.produced = 0
        self.stops = self.failovers = self.config_changes = self.reassignments = 0
        # What the monotonicity invariants saw last, per broker: (partition state, ...).
        self.leader_high_watermarks: dict[int, tuple[Partition, int]] = {}
        self.partition_epochs: dict[int, tuple[Partition, int, int]] = {}

    @initialize(min_insync_replicas=st.sampled_from([1, 2, 3]))
    def create_cluster(self, min_insync_replicas: int) -> None:
        """Four brokers register and heartbeat, the topic is created on the first three and
        they hear of it: broker 1 leads, every replica is in the ISR."""
        for broker in self.brokers.values():
            broker.start()
            self.controller.heartbeat(broker.broker_id)
        self.controller.create_topic(min_insync_replicas)
        for broker_id in BROKER_IDS:
            self.deliver_control_messages(broker_id, all_queued=True)

    # -- produce and replicate -------------------------------------------------------------

    @precondition(some_broker(leads))
    @rule(broker=a_broker(leads), acks_all=st.booleans())
    def produce(self, broker: int, acks_all: bool) -> None:
        """A client produces one record to a broker that believes it leads (perhaps deposed
        without knowing yet: the client's metadata is as old)."""
        b = self.brokers[broker]
        p = b.partition
        try:
            p.check_append(ACKS_ALL if acks_all else 1)
        except TidewaterError:
            return  # NOT_ENOUGH_REPLICAS
        self.produced += 1
        payload = f"r{self.produced}"
        batch = b.log.append_as_leader([payload], p.leader_epoch)
        p.after_leader_append(self.now_ms)
        if acks_all:
            pending = PendingProduce(broker, p, p.leader_epoch, batch.base_offset, payload)
            self.history.pending.append(pending)
        self._complete_produces()

    @precondition(some_broker(follows_a_live_leader))
    @rule(target=alter_requests, follower=a_broker(follows_a_live_leader))
    def fetch(self, follower: int) -> MultipleResults[AlterIsrRequest]:
        """One fetch by the follower from the leader it knows, and its answer: the leader
        records its progress (and may propose it joins the ISR) and serves what follows;
        a follower whose log diverges truncates instead."""
        f = self.brokers[follower]
        leader = self.leader_of(f)
        outcomes: list[FollowerFetchOutcome] = []

        def on_outcome(outcome: FollowerFetchOutcome) -> None:
            outcomes.append(outcome)
            self._complete_produces()

        try:
            fetch_once(
                f.partition,
                f.log,
                leader.partition,
                leader.log,
                self.now_ms,
                broker_epoch=f.epoch,
                on_outcome=on_outcome,
            )
        except TidewaterError:
            return multiple()  # not (or no longer) the leader, or another leader epoch
        if not outcomes:
            return multiple()  # out of the leader's range: truncated, or stopped replicating
        return self._send(leader, outcomes[0].isr_proposal)

    @rule(target=alter_requests, ms=st.sampled_from([100, 600, 1_500]))
    def time_passes(self, ms: int) -> MultipleResults[AlterIsrRequest]:
        """Time passes, and every leader runs its periodic ISR check: followers that have not
        caught up within replica.lag.time.max.ms are proposed out of the ISR."""
        self.now_ms += ms
        requests: list[AlterIsrRequest] = []
        for b in self.brokers.values():
            if b.leads:
                requests += self._send(b, b.partition.maybe_shrink_isr(self.now_ms)).values
        return multiple(*requests)

    # -- the channels ------------------------------------------------------------------------

    @precondition(some_broker(has_control_messages))
    @rule(broker=a_broker(has_control_messages), all_queued=st.booleans())
    def deliver_control_messages(self, broker: int, all_queued: bool) -> None:
        """The broker gets the oldest message in its control queue, or all of them."""
        queue = self.controller.outbox[broker]
        while queue:
            self.brokers[broker].take(queue.popleft(), self.now_ms)
            self._complete_produces()
            if not all_queued:
                break

    @rule(target=alter_answers, request=consumes(alter_requests), answer_lost=st.booleans())
    def controller_handles_alter_isr(
        self, request: AlterIsrRequest, answer_lost: bool
    ) -> AlterIsrAnswer:
        """The controller decides an ISR proposal. Its answer may be lost on the way back:
        the outcome is unknown to the leader, which sends the proposal again."""
        answer = self.controller.alter_isr(request)
        if answer is None or answer_lost:  # None: the controller failed over answering
            return AlterIsrAnswer(request, None, RequestTimedOut("the answer was lost"))
        return answer

    @rule(target=alter_requests, answer=consumes(alter_answers))
    def leader_gets_alter_isr_answer(
        self, answer: AlterIsrAnswer
    ) -> MultipleResults[AlterIsrRequest]:
        """The proposing incarnation, if it still runs, applies the answer; a proposal whose
        outcome is unknown goes to the controller again."""
        b = self.brokers[answer.request.broker_id]
        if not b.alive or b.epoch != answer.request.broker_epoch or b.partition is None:
            return multiple()
        proposal = answer.request.proposal
        b.partition.on_alter_isr_result(proposal, answer.committed, answer.error, self.now_ms)
        self._complete_produces()
        if b.partition.awaits_answer(proposal):
            return multiple(answer.request)
        return multiple()

    # -- brokers stop and start ------------------------------------------------------------

    @precondition(lambda self: self.stops < MAX_STOPS and some_broker(is_alive)(self))
    @rule(
        broker=a_broker(is_alive),
        how=st.sampled_from(["controlled", "clean", "kill"]),
        lose_unflushed=st.integers(0, 3),
    )
    def stop(self, broker: int, how: str, lose_unflushed: int) -> None:
        """The broker stops. Controlled: it first asks the controller to move its leadership
        and take it out of the ISR (where another ISR member remains), then stops cleanly.
        Clean: its log is flushed, and its next registration proves it stopped cleanly.
        Kill (-9): its last `lose_unflushed` records are gone, if it has that many."""
        self.stops += 1
        b = self.brokers[broker]
        if how == "controlled" and self.controller.model.brokers[broker].usable:
            self.controller.controlled_shutdown(broker)
        b.stop(lose_unflushed if how == "kill" else None)
        self._complete_produces()

    @precondition(
        lambda self: not self.controller.in_grace and some_broker(is_stopped_and_unfenced)(self)
    )
    @rule(broker=a_broker(is_stopped_and_unfenced))
    def session_expires(self, broker: int) -> None:
        """The controller fences a stopped broker whose session expired (not in a grace
        period: a new controller waits until it ends)."""
        self.controller.fence(broker)

    @precondition(some_broker(is_stopped))
    @rule(broker=a_broker(is_stopped))
    def restart(self, broker: int) -> None:
        """A stopped broker starts with its log and checkpointed HW, registers anew and
        heartbeats. What the controller sent the stopped one never arrived."""
        self.controller.outbox[broker].clear()
        self.brokers[broker].start()
        self.controller.heartbeat(broker)

    @precondition(some_broker(is_alive_and_fenced))
    @rule(broker=a_broker(is_alive_and_fenced))
    def heartbeat(self, broker: int) -> None:
        """A live broker's heartbeat reaches a controller that fences it (a new one)."""
        self.controller.heartbeat(broker)

    # -- the controller --------------------------------------------------------------------

    @precondition(
        lambda self: (
            self.config_changes < MAX_CONFIG_CHANGES and bool(new_min_insync_replicas(self))
        )
    )
    @rule(value=st.runner().flatmap(lambda self: st.sampled_from(new_min_insync_replicas(self))))
    def set_min_insync_replicas(self, value: int) -> None:
        """An operator changes the topic's min.insync.replicas."""
        self.config_changes += 1
        self.controller.set_min_insync_replicas(value)

    @precondition(lambda self: self.failovers < MAX_FAILOVERS and not self.controller.in_grace)
    @rule(heartbeats=st.lists(st.sampled_from(BROKER_IDS), unique=True))
    def controller_fails_over(self, heartbeats: list[int]) -> None:
        """Another controller takes over. The live brokers among `heartbeats` reach it at
        once, in that order; the others later (heartbeat, grace_period_ends)."""
        self.failovers += 1
        self.controller.fail_over()
        for broker in heartbeats:
            if is_alive_and_fenced(self, self.brokers[broker]):
                self.controller.heartbeat(broker)

    @precondition(lambda self: self.reassignments < MAX_REASSIGNMENTS)
    @rule(
        # Not `target`: a rule's target is the bundle its result goes to.
        replicas=st.runner().flatmap(reassignment_targets),
        # Half of them run through; the others fail over after a step's txn.
        controller_fails=st.sampled_from(["", "", "", "starting", "completing"]),
    )
    def reassign(self, replicas: tuple[int, ...] | None, controller_fails: str) -> None:
        """An operator reassigns the partition to `replicas` (None: cancels the reassignment in
        flight). The controller may fail over after the txn of its start, or of its completion
        (whenever that comes: at once, after an AlterIsr or once a new controller's grace
        period ends), before it tells the brokers; the next one goes on."""
        self.reassignments += 1
        if self.failovers >= MAX_FAILOVERS:
            controller_fails = ""
        if controller_fails:
            self.failovers += 1
        self.controller.fails_completing = controller_fails == "completing"
        self.controller.reassign(replicas, fails=controller_fails == "starting")

    @precondition(lambda self: self.controller.in_grace)
    @rule()
    def grace_period_ends(self) -> None:
        """The new controller's grace period ends: the live brokers have heartbeated by
        then, and the others leave their ISRs and leaderships."""
        self.controller.end_grace({b.broker_id for b in self.brokers.values() if b.alive})

    # -- what the rules share --------------------------------------------------------------

    def leader_of(self, b: ModelBroker) -> ModelBroker | None:
        """The live leader the broker follows, if any."""
        p = b.partition
        if not b.alive or p is None or p.is_leader or p.leader == NO_LEADER:
            return None
        leader = self.brokers[p.leader]
        return leader if leader.alive and leader.partition is not None else None

    @staticmethod
    def _send(b: ModelBroker, proposal: AlterIsrProposal | None) -> MultipleResults:
        if proposal is None:
            return multiple()
        return multiple(AlterIsrRequest(b.broker_id, b.epoch, proposal))

    def _complete_produces(self) -> None:
        """Each pending acks=all produce whose leader's HW covers it succeeds if the ISR
        still meets min.insync.replicas; it fails once its leader stopped, lost the record or
        no longer leads. Only the controller's leader's acknowledgements are held to the
        invariants: a deposed leader that has not heard yet is not."""
        self._record_commits()
        waiting = []
        record = self.controller.record
        for pending in self.history.pending:
            b = self.brokers[pending.broker_id]
            p = pending.partition
            if not b.alive or b.partition is not p or not p.is_leader:
                continue
            if not p.holds_append(pending.leader_epoch, pending.offset + 1):
                continue
            enough = p.enough_replicas_for(pending.offset + 1)
            if enough is None:
                waiting.append(pending)
            elif enough and (record.leader, record.leader_epoch) == (b.broker_id, p.leader_epoch):
                self.history.acknowledged.append((pending.offset, pending.payload))
        self.history.pending = waiting

    def _record_commits(self) -> None:
        """The controller's leader, once it knows it leads, commits what its HW covers: the
        committed history grows to its HW (the invariants check what it had agrees)."""
        record = self.controller.record
        b = self.brokers.get(record.leader)
        if b is None or not b.leads or b.partition.leader_epoch != record.leader_epoch:
            return
        committed = self.history.committed
        committed += records_of(b.log)[len(committed) : b.partition.high_watermark]

    def _lacking(self, b: ModelBroker) -> list[int]:
        """The committed offsets whose record the broker's log does not hold."""
        held = records_of(b.log)
        return [
            offset
            for offset, record in enumerate(self.history.committed)
            if offset >= len(held) or held[offset] != record
        ]

    def _lacking_if_registered(self, b: ModelBroker) -> list[int]:
        """What the broker lacks of the committed records, if it runs as the incarnation the
        controller knows (a stopped one's next registration fences what it held)."""
        registered = self.controller.model.brokers[b.broker_id]
        return self._lacking(b) if b.alive and registered.epoch == b.epoch else []

    def _live_partitions(self) -> list[tuple[ModelBroker, Partition]]:
        return [(b, b.partition) for b in self.brokers.values() if b.alive and b.partition]

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def acknowledged_records_are_committed(self) -> None:
        self._record_commits()
        if self.history.data_loss_allowed:
            return
        committed = self.history.committed
        for offset, payload in self.history.acknowledged:
            assert offset < len(committed) and committed[offset][1] == payload, (
                f"the acks=all record {payload} acknowledged at offset {offset} is not in the "
                f"committed history {committed}"
            )

    @invariant()
    def eligible_replicas_hold_every_committed_record(self) -> None:
        """Every live replica the controller could elect cleanly, an ISR member or an
        eligible leader replica (KIP-966: the HW does not move while they are out), holds
        every committed record. A stopped one is left out: its next registration fences
        what it held, and takes it out of the ELR if it lost a tail."""
        self._record_commits()
        if self.history.data_loss_allowed:
            return
        record = self.controller.record
        for broker_id in record.isr + record.elr:
            b = self.brokers[broker_id]
            lacking = self._lacking_if_registered(b)
            role = "ISR member" if broker_id in record.isr else "eligible leader replica"
            assert not lacking, (
                f"{role} {broker_id} (ISR {list(record.isr)}, ELR {list(record.elr)}) lacks "
                f"the committed offsets {lacking}: it holds {records_of(b.log)}, the "
                f"committed history is {self.history.committed}"
            )

    @invariant()
    def only_replicas_lead_or_are_in_the_isr_or_elr(self) -> None:
        """A replica removed by a reassignment (or a cancelled one) leaves the leadership, ISR,
        ELR and last known leader with it, and none is ever added to them, whatever failover
        cuts its writes short (a cancel or re-target keeps the replicas it drops assigned
        until the partition's state without them has committed)."""
        record = self.controller.record
        replicas = set(self.controller.replicas)
        members = set(record.isr + record.elr + record.last_known_elr) | (
            {record.leader} - {NO_LEADER}
        )
        assert members <= replicas, (
            f"leader {record.leader}, ISR {list(record.isr)}, ELR {list(record.elr)} or last "
            f"known leader {list(record.last_known_elr)} names "
            f"brokers {sorted(members - replicas)} that are not replicas "
            f"{list(self.controller.replicas)}"
        )

    @invariant()
    def completed_reassignments_hold_every_committed_record(self) -> None:
        """A reassignment completes only when each of its targets holds every committed
        record: they alone are the replicas then (a stopped one is left out, as above). A
        cancel's replicas are the original ones, as they were before it: any may lag."""
        self._record_commits()
        completions, self.controller.completions = self.controller.completions, []
        if self.history.data_loss_allowed:
            return
        for reassignment in completions:
            target = reassignment.target
            if set(target) == set(reassignment.original):
                continue
            for broker_id in target:
                b = self.brokers[broker_id]
                lacking = self._lacking_if_registered(b)
                assert not lacking, (
                    f"the reassignment to {list(target)} completed while its target {broker_id} "
                    f"lacks the committed offsets {lacking}: it holds {records_of(b.log)}, the "
                    f"committed history is {self.history.committed}"
                )

    @invariant()
    def elected_leaders_hold_every_committed_record(self) -> None:
        """A clean election, and the last known leader's (unless a crash cut its log),
        elects a replica that holds every committed record."""
        self._record_commits()
        elections, self.controller.elections = self.controller.elections, []
        for election in elections:
            b = self.brokers[election.leader]
            if self.history.data_loss_allowed or not b.alive:
                continue  # stopped: the controller has not seen it yet, and it never leads so
            if election.unclean and b.lost_tail:
                self.history.data_loss_allowed = True
                continue
            lacking = self._lacking(b)
            kind = "unclean (last known leader)" if election.unclean else "clean"
            assert not lacking, (
                f"the {kind} election of broker {election.leader} elected a replica that lacks "
                f"the committed offsets {lacking}: it holds {records_of(b.log)}, the committed "
                f"history is {self.history.committed}"
            )

    @invariant()
    def replicas_agree_with_the_committed_history_below_their_high_watermarks(self) -> None:
        """No live replica holds another record than the committed one below its HW (a
        follower truncates a diverging tail before its HW covers it)."""
        self._record_commits()
        if self.history.data_loss_allowed:
            return
        committed = self.history.committed
        for b, p in self._live_partitions():
            records = records_of(b.log)
            for offset in range(min(p.high_watermark, len(committed))):
                assert records[offset] == committed[offset], (
                    f"broker {b.broker_id} holds {records[offset]} at offset {offset}, below its "
                    f"HW {p.high_watermark}, where the committed record is {committed[offset]}"
                )

    @invariant()
    def leader_high_watermarks_never_move_back(self) -> None:
        for b, p in self._live_partitions():
            if not p.is_leader:
                self.leader_high_watermarks.pop(b.broker_id, None)
                continue
            seen, hw = self.leader_high_watermarks.get(b.broker_id, (p, p.high_watermark))
            assert seen is not p or p.high_watermark >= hw, (
                f"leader {b.broker_id}'s HW moved back from {hw} to {p.high_watermark}"
            )
            self.leader_high_watermarks[b.broker_id] = (p, p.high_watermark)

    @invariant()
    def partition_epochs_never_move_back_within_a_leader_epoch(self) -> None:
        """A replica's partition epoch only grows while its leader epoch stays (an answer or
        a LeaderAndIsr older than what it applied is ignored)."""
        for b, p in self._live_partitions():
            seen = self.partition_epochs.get(b.broker_id)
            if seen is not None and seen[0] is p and seen[1] == p.leader_epoch:
                assert p.partition_epoch >= seen[2], (
                    f"broker {b.broker_id}'s partition epoch moved back from {seen[2]} to "
                    f"{p.partition_epoch} in leader epoch {p.leader_epoch}"
                )
            self.partition_epochs[b.broker_id] = (p, p.leader_epoch, p.partition_epoch)


class Replay:
    """The machine stepped by hand through a story (a shrunk failure Hypothesis printed, its
    bundle values unpacked), each step followed by every invariant as Hypothesis checks them:
    `Replay().time_passes(ms=1500)`."""

    def __init__(self) -> None:
        self.machine = ReplicationModel()

    def __getattr__(self, rule: str) -> Callable[..., object]:
        step = getattr(self.machine, rule)

        def checked(**arguments: object) -> object:
            result = step(**arguments)
            for check in self.machine.invariants:  # Hypothesis's, in its order
                check.function(self.machine)
            return result

        return checked


# -- how long it runs --------------------------------------------------------------------------

# The default run: the same examples every time (derandomize), in about ten seconds.
DEFAULT_EXAMPLES = 500
STEPS = 50
# TIDEWATER_MODEL_EXAMPLES=N: N examples, new ones every run (0: the default run).
EXAMPLES_ON_DEMAND = int(os.environ.get("TIDEWATER_MODEL_EXAMPLES", "0"))


def model_settings() -> settings:
    """The default run's settings, or a run on demand's (a failure prints its story and how
    to reproduce it)."""
    return settings(
        max_examples=EXAMPLES_ON_DEMAND or DEFAULT_EXAMPLES,
        stateful_step_count=STEPS,
        derandomize=not EXAMPLES_ON_DEMAND,
        database=None,
        deadline=None,
        # Not Phase.explain: it traces every line of every replay of a failure (minutes).
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        print_blob=True,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
