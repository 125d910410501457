"""One replica of a partition: Kafka's Partition rules as a pure state machine.

It knows the partition's role, AR, ISR (committed and proposed), the leader epoch and its start
offset, the HW, and, as leader, every follower's fetch state. It reads the local log's offsets
and leader epoch cache through `ReplicaLog` and never changes the log: appends and truncations
are the caller's, who tells the partition afterwards. Time is an argument. So every rule here
runs in a unit test in microseconds, with no files, sockets or event loop.

Inputs:  check_newer + make_leader / make_follower (LeaderAndIsr), check_append +
         after_leader_append (produce), on_follower_fetch (a follower's fetch, on the leader),
         maybe_shrink_isr (the periodic check), on_alter_isr_result (the controller's answer,
         or its absence), update_follower_high_watermark (a fetch response, on a follower).
Outputs: return values — whether the HW moved (so delayed operations can complete), ISR
         change proposals for the controller and whether one awaits an answer still (to be
         sent again), diverging epochs for followers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

from tidewater.errors import (
    FencedLeaderEpoch,
    NotEnoughReplicas,
    NotLeaderOrFollower,
    OffsetOutOfRange,
    TidewaterError,
    UnknownLeaderEpoch,
)
from tidewater.replication.replica import UNKNOWN_OFFSET, FetchClock, Replica
from tidewater.v1.errors_pb2 import ErrorCode

NO_LEADER = -1
ACKS_ALL = -1
NO_EPOCH = -1
# A member's broker epoch in an ISR proposal when the leader knows none: the controller skips
# its check (Kafka's -1).
NO_BROKER_EPOCH = -1
# Kafka's Partition.handleAlterPartitionError. The controller's answer that the proposal was
# checked against the current state and not applied: the committed ISR stands.
ALTER_ISR_NOT_APPLIED = frozenset({ErrorCode.INELIGIBLE_REPLICA})
# Its answers that its state is newer than the leader's (another leader epoch or partition
# epoch, the topic gone): after an earlier answer was lost, the proposal may have committed
# before that, so the proposal stays pending (the HW counts the maximal ISR), not sent again,
# until the LeaderAndIsr (or StopReplica) the controller sent for its state arrives. Any other
# failure (a timeout, a lost connection, NOT_CONTROLLER after a failover) leaves the outcome
# unknown: the proposal is sent again.
ALTER_ISR_STATE_STALE = frozenset(
    {
        ErrorCode.FENCED_LEADER_EPOCH,
        ErrorCode.INVALID_UPDATE_VERSION,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    }
)


class EpochHistory(Protocol):
    """What the partition needs of the leader epoch cache."""

    @property
    def latest_epoch(self) -> int: ...

    def assign(self, epoch: int, start_offset: int) -> None: ...

    def end_offset_for(self, requested_epoch: int, log_end_offset: int) -> tuple[int, int]: ...


# The broker epoch of a broker as the leader's metadata knows it (UpdateMetadata's live
# brokers): None when the broker may not join an ISR (not alive, fenced or shutting down:
# KIP-841), 0 when it may but its epoch is not known (no UpdateMetadata yet, or one without
# epochs), which skips the epoch check.
UsableBrokerEpoch = Callable[[int], int | None]


class ReplicaLog(Protocol):
    """What the partition reads of the local log."""

    @property
    def log_start_offset(self) -> int: ...

    @property
    def log_end_offset(self) -> int: ...

    @property
    def leader_epoch_cache(self) -> EpochHistory: ...


@dataclass(frozen=True)
class ReplicationConfig:
    replica_lag_time_max_ms: int = 30000
    min_insync_replicas: int = 1
    unclean_leader_election_enable: bool = False


@dataclass(frozen=True)
class LeaderAndIsr:
    """The controller's decision for one partition."""

    leader: int
    leader_epoch: int
    isr: tuple[int, ...]
    replicas: tuple[int, ...]
    partition_epoch: int
    controller_epoch: int = 0
    # The eligible leader replicas (KIP-966) committed with `isr`: non-empty only while the
    # controller counts the ISR as below ITS min.insync.replicas (see Partition.under_min_isr).
    # Empty from a controller that sends none (older than the field).
    elr: tuple[int, ...] = ()


@dataclass(frozen=True)
class IsrState:
    """The committed ISR and ELR, and the proposed ISR while an AlterIsr is in flight (Kafka's
    PendingExpandIsr / PendingShrinkIsr). While pending, the HW uses the union of both, so a
    shrink cannot commit data the old ISR has not all got, nor an expansion skip a member."""

    isr: frozenset[int]
    partition_epoch: int
    proposed: frozenset[int] | None = None
    elr: tuple[int, ...] = ()
    # The controller answered that its state is newer (ALTER_ISR_STATE_STALE): the proposal
    # stays pending, unsent, until a LeaderAndIsr.
    awaiting_leader_and_isr: bool = False

    @property
    def maximal_isr(self) -> frozenset[int]:
        return self.isr | self.proposed if self.proposed is not None else self.isr

    @property
    def in_flight(self) -> bool:
        return self.proposed is not None


@dataclass(frozen=True)
class AlterIsrProposal:
    topic: str
    partition: int
    leader_epoch: int
    new_isr: tuple[int, ...]
    partition_epoch: int
    # The broker epoch of each member of new_isr, in its order (Kafka's NewIsrWithEpochs,
    # KIP-903): a follower's from its fetches, NO_BROKER_EPOCH where the leader has none (for
    # itself: the AlterIsr request carries its epoch). The controller refuses a member whose
    # registration is no longer that epoch.
    new_isr_broker_epochs: tuple[int, ...]


# NamedTuples rather than frozen dataclasses: made for every partition of every fetch, where
# a frozen dataclass's construction costs three times as much.
class FollowerFetch(NamedTuple):
    """A follower's fetch of one partition, as the leader sees it."""

    replica_id: int
    fetch_offset: int
    log_start_offset: int
    last_fetched_epoch: int
    current_leader_epoch: int
    # The follower's broker epoch, from the fetch request (KIP-903); 0 when it sent none.
    broker_epoch: int = 0
    # The topic id the follower holds (KIP-516), empty when none: a fetch session sends the
    # partition again when it changes, as when its position does.
    topic_id: bytes = b""


class FollowerFetchOutcome(NamedTuple):
    # (epoch, end offset) when the follower's log diverges from ours: it must truncate and
    # fetch again; no data is served.
    diverging_epoch: tuple[int, int] | None = None
    high_watermark_changed: bool = False
    isr_proposal: AlterIsrProposal | None = None


class Partition:
    def __init__(
        self,
        topic: str,
        partition: int,
        local_broker_id: int,
        log: ReplicaLog,
        config: ReplicationConfig,
        checkpointed_high_watermark: int,
        usable_broker_epoch: UsableBrokerEpoch = lambda broker_id: 0,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.key = (topic, partition)
        self.local_broker_id = local_broker_id
        self.log = log
        self.config = config
        # Fenced or shutting-down brokers do not join an ISR (KIP-841), nor an incarnation of
        # a broker other than the one registered (KIP-903); the broker's metadata answers.
        self.usable_broker_epoch = usable_broker_epoch
        self.leader = NO_LEADER
        self.leader_epoch = NO_EPOCH
        self.leader_epoch_start_offset = UNKNOWN_OFFSET
        self.controller_epoch = 0
        self.replicas: tuple[int, ...] = ()
        self.remote_replicas: dict[int, Replica] = {}
        self._isr_state = IsrState(frozenset(), -1)
        # After a restart the checkpoint may be past the LEO (an unflushed tail is gone) or
        # before the log start (retention or a full truncation passed it).
        self.high_watermark = self._within_log(checkpointed_high_watermark)

    @property
    def name(self) -> str:
        return f"{self.topic}-{self.partition}"

    @property
    def is_leader(self) -> bool:
        return self.leader == self.local_broker_id

    @property
    def isr_state(self) -> IsrState:
        return self._isr_state

    @isr_state.setter
    def isr_state(self, state: IsrState) -> None:
        self._wake_followers()  # an ISR change may change what a follower's fetch does
        self._isr_state = state

    @property
    def isr(self) -> frozenset[int]:
        return self.isr_state.isr

    @property
    def partition_epoch(self) -> int:
        return self.isr_state.partition_epoch

    # -- LeaderAndIsr ------------------------------------------------------------------------

    def check_newer(self, state: LeaderAndIsr) -> None:
        """Whether a LeaderAndIsr is news to this replica (Kafka's checks before makeLeader /
        makeFollower): a newer leader epoch, or the leader epoch it has in a newer partition
        epoch, where the controller changed the ISR or ELR alone and kept the leader (KRaft's
        partition change). Anything else is FENCED_LEADER_EPOCH and changes nothing: the same
        state again (a new controller's resend), an older one, or the partition epoch an
        AlterIsr answer taught this leader already."""
        if state.leader_epoch > self.leader_epoch:
            return
        if state.leader_epoch < self.leader_epoch or state.partition_epoch <= self.partition_epoch:
            raise FencedLeaderEpoch(
                f"{self.name}: leader epoch {state.leader_epoch}, partition epoch "
                f"{state.partition_epoch} is not newer than the current leader epoch "
                f"{self.leader_epoch}, partition epoch {self.partition_epoch}; ignored"
            )
        if state.leader != self.leader:
            # A leader change always comes in a new leader epoch: followers must truncate.
            raise FencedLeaderEpoch(
                f"{self.name}: leader {state.leader} in leader epoch {state.leader_epoch}, "
                f"which leader {self.leader} has; ignored"
            )

    def make_leader(self, state: LeaderAndIsr, now_ms: int) -> bool:
        """Kafka's makeLeader. Returns whether the HW moved. A new leader epoch starts at the
        LEO, in the epoch cache too, and the followers' fetch state starts over; in the leader
        epoch this leader has (a newer partition epoch: the ISR or ELR changed alone) only
        the replicas, committed ISR, ELR and partition epoch change, as Kafka's isNewLeaderEpoch
        false. A proposal in flight is superseded either way (its answer is ignored)."""
        is_new_leader = not self.is_leader
        is_new_leader_epoch = is_new_leader or state.leader_epoch != self.leader_epoch
        self._apply(state)
        followers = [r for r in state.replicas if r != self.local_broker_id]
        known = {} if is_new_leader else self.remote_replicas
        self.remote_replicas = {r: known.get(r) or Replica(r) for r in followers}
        if is_new_leader_epoch:
            leader_end_offset = self.log.log_end_offset
            self.leader_epoch_start_offset = leader_end_offset
            self.log.leader_epoch_cache.assign(state.leader_epoch, leader_end_offset)
            for replica in self.remote_replicas.values():
                replica.reset(
                    now_ms, leader_end_offset, is_new_leader, replica.broker_id in self.isr
                )
        # The ISR may be just us now, so the HW may move at once; or it meets a lower
        # min.insync.replicas now, or the controller cleared its ELR.
        return self.maybe_increment_high_watermark(now_ms)

    def make_follower(self, state: LeaderAndIsr) -> bool:
        """Kafka's makeFollower. Returns whether the fetcher must (re)start: the leader or its
        epoch changed, even when the leader id is the same (an update we missed). A newer
        partition epoch alone (the ISR or ELR changed) restarts nothing and truncates
        nothing."""
        changed = state.leader != self.leader or state.leader_epoch != self.leader_epoch
        self._apply(state)
        self.isr_state = IsrState(frozenset(), state.partition_epoch)
        self.remote_replicas = {}
        self.leader_epoch_start_offset = UNKNOWN_OFFSET
        return changed

    def _apply(self, state: LeaderAndIsr) -> None:
        # Setting isr_state wakes the quiet followers: a role change reaches every session.
        self.leader = state.leader
        self.leader_epoch = state.leader_epoch
        self.controller_epoch = state.controller_epoch
        self.replicas = state.replicas
        self.isr_state = IsrState(frozenset(state.isr), state.partition_epoch, elr=state.elr)

    # -- requests ----------------------------------------------------------------------------

    def check_current_leader_epoch(self, current_leader_epoch: int) -> None:
        """KIP-320: an older epoch is fenced, a newer one not known here yet."""
        if current_leader_epoch == NO_EPOCH:
            return
        if current_leader_epoch < self.leader_epoch:
            raise FencedLeaderEpoch(
                f"{self.name}: request epoch {current_leader_epoch} is older than the "
                f"current leader epoch {self.leader_epoch}"
            )
        if current_leader_epoch > self.leader_epoch:
            raise UnknownLeaderEpoch(
                f"{self.name}: request epoch {current_leader_epoch} is newer than this "
                f"replica's leader epoch {self.leader_epoch}"
            )

    def require_leader(self) -> None:
        if not self.is_leader:
            raise NotLeaderOrFollower(
                f"broker {self.local_broker_id} is not the leader of {self.name} "
                f"(leader: {self.leader}, epoch {self.leader_epoch})"
            )

    def check_append(self, acks: int) -> None:
        """Before a produce appends: leader, and for acks=all an ISR of the effective min ISR."""
        self.require_leader()
        if acks == ACKS_ALL and self.under_min_isr:
            raise NotEnoughReplicas(f"{self.name}: {self.min_isr_shortfall}")

    def reconfigure(self, config: ReplicationConfig, now_ms: int) -> bool:
        """The topic's configs changed. Returns whether the HW moved: a leader whose ISR meets
        a lower min.insync.replicas now advances it at once, not at the next append or fetch
        that moves a LEO (acks=1 records readable, acks=all produces answered)."""
        self.config = config
        return self.maybe_increment_high_watermark(now_ms)

    def after_leader_append(self, now_ms: int) -> bool:
        """The leader's LEO moved. Returns whether the HW moved (an ISR of one)."""
        # Fetches from here on no longer find the followers caught up.
        self._wake_followers()
        return self.maybe_increment_high_watermark(now_ms)

    def holds_append(self, leader_epoch: int, required_offset: int) -> bool:
        """Whether the records this leader appended in `leader_epoch` below `required_offset`
        are still at their offsets: the epoch has not moved since, or the log's epoch history
        still runs that epoch up to them. A bump that kept this broker the leader (the
        controller fencing a follower) truncates nothing; a leader that lost the partition
        and truncated the batch began a later epoch below its end."""
        if leader_epoch == self.leader_epoch:
            return True
        epoch, end_offset = self.log.leader_epoch_cache.end_offset_for(
            leader_epoch, self.log.log_end_offset
        )
        return epoch == leader_epoch and end_offset >= required_offset

    @property
    def effective_min_isr(self) -> int:
        """Kafka's effectiveMinIsr: min.insync.replicas, at most the replica count (a value
        above the replication factor asks for replicas the partition does not have). Every
        min ISR rule of the leader uses it: the acks=all checks and the HW rule."""
        return min(self.config.min_insync_replicas, len(self.replicas))

    @property
    def elr(self) -> tuple[int, ...]:
        """The eligible leader replicas committed with the ISR (leaders only)."""
        return self.isr_state.elr

    @property
    def under_min_isr(self) -> bool:
        """Kafka's isUnderMinIsr, on the committed ISR; and while the committed ELR is not
        empty. The controller keeps an ELR only while the ISR is below its min.insync.replicas
        (it clears it once the ISR meets that value, or the value is lowered), so a non-empty
        ELR says the controller counts this ISR as below min ISR, whatever value this broker
        has: a topic's value raised before this broker applied it, or the controller's
        default above this broker's. It comes with the ISR, in the same LeaderAndIsr or
        AlterIsr answer, so no order of those and UpdateMetadata lets the HW pass an ELR
        member (KIP-966: each holds every record below the HW)."""
        return len(self.isr) < self.effective_min_isr or bool(self.elr)

    @property
    def min_isr_shortfall(self) -> str:
        """Why the ISR is below min ISR (under_min_isr), for the acks=all refusals."""
        if len(self.isr) < self.effective_min_isr:
            return (
                f"ISR {sorted(self.isr)} is smaller than "
                f"min.insync.replicas={self.effective_min_isr}"
            )
        return (
            f"ISR {sorted(self.isr)} is below min.insync.replicas as the controller counts it "
            f"(eligible leader replicas {list(self.elr)})"
        )

    def enough_replicas_for(self, required_offset: int) -> bool | None:
        """acks=all completion (checkEnoughReplicasReachOffset): None while the HW is short of
        the offset; else whether the maximal ISR (a member being added holds the batch too)
        still meets the effective min ISR, with no ELR (the controller counts the ISR as
        below min ISR while it has one)."""
        if self.high_watermark < required_offset:
            return None
        return len(self.isr_state.maximal_isr) >= self.effective_min_isr and not self.elr

    # -- the leader's side of a follower fetch -----------------------------------------------

    def on_follower_fetch(
        self, fetch: FollowerFetch, now_ms: int, clock: FetchClock | None = None
    ) -> FollowerFetchOutcome:
        """Validate a follower's fetch and record its progress. On a normal outcome the caller
        serves data from fetch.fetch_offset up to the LEO. `clock`: the fetch's session, if
        any; a follower this fetch finds caught up, in the ISR and with nothing left to do
        stays quiet in it (FetchClock) until the partition changes."""
        self.check_current_leader_epoch(fetch.current_leader_epoch)  # first, as Kafka
        self.require_leader()
        replica = self.remote_replicas.get(fetch.replica_id)
        if replica is None:
            raise NotLeaderOrFollower(
                f"broker {fetch.replica_id} is not a replica of {self.name} "
                f"(replicas {list(self.replicas)}; a consumer sends replica_id -1)"
            )
        replica.wake(self.key)
        leader_end_offset = self.log.log_end_offset
        if fetch.last_fetched_epoch != NO_EPOCH:
            epoch, end_offset = self.log.leader_epoch_cache.end_offset_for(
                fetch.last_fetched_epoch, leader_end_offset
            )
            # KIP-595-style divergence check: our history of that epoch ends before the
            # follower's log does, or we never had that epoch.
            if epoch < fetch.last_fetched_epoch or end_offset < fetch.fetch_offset:
                return FollowerFetchOutcome(diverging_epoch=(epoch, end_offset))
        if not self.log.log_start_offset <= fetch.fetch_offset <= leader_end_offset:
            raise OffsetOutOfRange(
                f"{self.name}: follower {fetch.replica_id} fetch offset {fetch.fetch_offset} is "
                f"outside [{self.log.log_start_offset}, {leader_end_offset}]"
            )
        previous_end_offset = replica.log_end_offset
        replica.update_fetch_state(
            fetch.fetch_offset,
            fetch.log_start_offset,
            now_ms,
            leader_end_offset,
            fetch.broker_epoch,
        )
        proposal = self._maybe_expand_isr(replica)
        hw_changed = False
        if replica.log_end_offset != previous_end_offset or proposal is not None:
            hw_changed = self.maybe_increment_high_watermark(now_ms)
        if (
            clock is not None
            and replica.log_end_offset == leader_end_offset
            and replica.broker_id in self.isr_state.isr
            and not self.isr_state.in_flight
        ):
            # The same fetch again would only find it caught up again.
            replica.clock = clock
        return FollowerFetchOutcome(high_watermark_changed=hw_changed, isr_proposal=proposal)

    def wake_follower(self, replica_id: int) -> None:
        """The follower's session no longer fetches the partition: it is quiet no more."""
        replica = self.remote_replicas.get(replica_id)
        if replica is not None:
            replica.wake(self.key)

    def quiet_in(self, replica_id: int, clock: FetchClock) -> bool:
        """Whether the follower is quiet in the fetch session of `clock`."""
        replica = self.remote_replicas.get(replica_id)
        return replica is not None and replica.clock is clock

    def _wake_followers(self) -> None:
        for replica in self.remote_replicas.values():
            replica.wake(self.key)

    # -- ISR ---------------------------------------------------------------------------------

    def _maybe_expand_isr(self, replica: Replica) -> AlterIsrProposal | None:
        """Kafka's maybeExpandIsr: a follower joins once it has reached the HW and the start
        of the current leader epoch, so it holds everything committed under this leader."""
        state = self.isr_state
        if state.in_flight or replica.broker_id in state.isr:
            return None
        if not self._isr_eligible(replica):
            return None
        if replica.log_end_offset < self.high_watermark:
            return None
        if replica.log_end_offset < self.leader_epoch_start_offset:
            return None
        return self._propose(state.isr | {replica.broker_id})

    def _isr_eligible(self, replica: Replica) -> bool:
        """Kafka's isReplicaIsrEligible: the follower's broker is usable (KIP-841) and its
        fetches come from the incarnation the metadata knows (KIP-903). A broker that restarted
        may have lost its unflushed tail: what its old incarnation fetched must not let the new
        one in, nor may the new one's fetches before the leader knows its registration."""
        known = self.usable_broker_epoch(replica.broker_id)
        return known is not None and (known == 0 or replica.broker_epoch == known)

    def maybe_shrink_isr(self, now_ms: int) -> AlterIsrProposal | None:
        """Kafka's maybeShrinkIsr, run every replica.lag.time.max.ms / 2: drop ISR members
        that have not caught up within replica.lag.time.max.ms."""
        if not self.is_leader or self.isr_state.in_flight:
            return None
        out_of_sync = self.out_of_sync_replicas(now_ms)
        if not out_of_sync:
            return None
        return self._propose(self.isr - out_of_sync)

    def out_of_sync_replicas(self, now_ms: int) -> frozenset[int]:
        """ISR members not caught up by the lag rule, and any that is not a replica (the
        controller left it in the ISR): it fetches nothing from us."""
        leader_end_offset = self.log.log_end_offset
        lag = self.config.replica_lag_time_max_ms
        out_of_sync: set[int] = set()
        for broker_id in self.isr - {self.local_broker_id}:
            replica = self.remote_replicas.get(broker_id)
            if replica is None or not replica.is_caught_up(leader_end_offset, now_ms, lag):
                out_of_sync.add(broker_id)
        return frozenset(out_of_sync)

    def _propose(self, new_isr: frozenset[int]) -> AlterIsrProposal:
        self.isr_state = replace(self.isr_state, proposed=frozenset(new_isr))
        members = tuple(sorted(new_isr))
        return AlterIsrProposal(
            topic=self.topic,
            partition=self.partition,
            leader_epoch=self.leader_epoch,
            new_isr=members,
            partition_epoch=self.partition_epoch,
            new_isr_broker_epochs=tuple(self._member_epoch(b) for b in members),
        )

    def _member_epoch(self, broker_id: int) -> int:
        replica = self.remote_replicas.get(broker_id)
        if replica is None or not replica.broker_epoch:
            return NO_BROKER_EPOCH  # the leader itself, or no fetch with an epoch yet
        return replica.broker_epoch

    def on_alter_isr_result(
        self,
        proposal: AlterIsrProposal,
        answer: LeaderAndIsr | None,
        error: TidewaterError | None,
        now_ms: int,
    ) -> bool:
        """The controller's answer to our proposal: its state (`answer`: what it committed, or
        with a refusal, the state it refused against, if it has one) and its refusal, or the
        failure to get an answer (`error`). Committed: adopt its ISR, ELR and partition epoch.
        Not applied (ALTER_ISR_NOT_APPLIED): drop the proposal and keep the last committed
        ISR; the next check proposes again if still needed. The controller's state is newer
        (ALTER_ISR_STATE_STALE with a newer state or none, or committed in another leader
        epoch): the proposal stays pending, not sent again, until the LeaderAndIsr that
        brings that state (review 22 L1: it was dropped, and the HW counted an ISR without a
        member the controller had committed). Refused against a state no newer than ours, a
        deposed controller's that has not noticed yet, or outcome unknown: the controller may
        have committed it, so it stays pending (the HW keeps counting the maximal ISR) and
        awaits_answer says to send it again, until a definite answer (Kafka's
        AlterPartitionManager; review 24 #5: it waited for a LeaderAndIsr already applied).
        Returns whether the HW moved."""
        if not self.awaits_answer(proposal):
            return False  # a newer LeaderAndIsr superseded this proposal
        if error is not None:
            if error.code in ALTER_ISR_NOT_APPLIED:
                self.isr_state = replace(self.isr_state, proposed=None)
            elif error.code in ALTER_ISR_STATE_STALE and (
                answer is None or self._newer_than_ours(answer)
            ):
                self.isr_state = replace(self.isr_state, awaiting_leader_and_isr=True)
            return False
        if answer is None:
            return False
        if answer.leader_epoch != self.leader_epoch:
            self.isr_state = replace(self.isr_state, awaiting_leader_and_isr=True)
            return False
        self.isr_state = IsrState(frozenset(answer.isr), answer.partition_epoch, elr=answer.elr)
        # An ISR that meets min ISR again comes with its ELR cleared: the HW moves now.
        return self.maybe_increment_high_watermark(now_ms)

    def _newer_than_ours(self, controller_state: LeaderAndIsr) -> bool:
        """Whether the controller's state is newer than ours."""
        return (
            controller_state.leader_epoch > self.leader_epoch
            or controller_state.partition_epoch > self.partition_epoch
        )

    def awaits_answer(self, proposal: AlterIsrProposal) -> bool:
        """Whether this proposal is the one in flight, with no definite answer yet."""
        state = self.isr_state
        return (
            self.is_leader
            and self.leader_epoch == proposal.leader_epoch
            and state.partition_epoch == proposal.partition_epoch
            and state.proposed == frozenset(proposal.new_isr)
            and not state.awaiting_leader_and_isr
        )

    # -- HW ----------------------------------------------------------------------------------

    def maybe_increment_high_watermark(self, now_ms: int) -> bool:
        """Kafka's maybeIncrementLeaderHW: the HW is the smallest LEO among the leader, the
        maximal ISR, and followers caught up within the lag time (which are about to join);
        it never moves back. Besides each event that moves a LEO or the ISR, run after a
        duplicate append (as Kafka's after every append), at the periodic ISR check and when
        the usable brokers change: a follower out of the ISR stops holding the HW when its
        lag time passes or it stops being usable, neither of which moves a LEO (review 22 M1:
        an idle partition's HW stayed short of its LEO for good).

        It does not move while the committed ISR is below min.insync.replicas (at most the
        replication factor: Kafka's effective min ISR), here or as the controller counts it
        (under_min_isr), for every acks (KIP-966 with ELR enabled): the replicas that left the
        ISR then hold every committed record, so the controller may elect them (eligible
        leader replicas)."""
        if not self.is_leader or self.under_min_isr:
            return False
        maximal_isr = self.isr_state.maximal_isr
        lag = self.config.replica_lag_time_max_ms
        new_hw = self.log.log_end_offset
        for replica in self.remote_replicas.values():
            if replica.log_end_offset < new_hw and (
                replica.broker_id in maximal_isr
                or (now_ms - replica.last_caught_up_time_ms <= lag and self._isr_eligible(replica))
            ):
                new_hw = replica.log_end_offset
        if new_hw > self.high_watermark:
            self._wake_followers()
            self.high_watermark = new_hw
            return True
        return False

    def update_follower_high_watermark(self, leader_high_watermark: int) -> None:
        """A follower's HW is the leader's, within its own log."""
        self.high_watermark = self._within_log(leader_high_watermark)

    def after_truncation(self) -> None:
        """The caller truncated the log: the HW stays within it."""
        self.high_watermark = self._within_log(self.high_watermark)

    def _within_log(self, high_watermark: int) -> int:
        """Kafka's bounds of a HW: [log start offset, LEO]."""
        return max(min(high_watermark, self.log.log_end_offset), self.log.log_start_offset)
