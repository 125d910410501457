"""Real test doubles for the replication core: an in-memory log over the real leader epoch
cache, and a small deterministic cluster that plays brokers, fetchers and the controller.

Nothing here runs on its own: every fetch, produce, crash and election is one call, and time
moves only when a test says so."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePath

from tidewater.broker.log.checkpoints import EpochEntry
from tidewater.broker.log.leader_epoch_cache import LeaderEpochCache
from tidewater.errors import OffsetOutOfRange, RequestTimedOut
from tidewater.replication.follower import (
    FetchedPartition,
    StopReplicating,
    apply_out_of_range,
    follow_leader_log_start,
    next_fetch,
    on_offset_out_of_range,
    truncate_if_diverged,
)
from tidewater.replication.partition import (
    ACKS_ALL,
    NO_EPOCH,
    NO_LEADER,
    AlterIsrProposal,
    FollowerFetchOutcome,
    LeaderAndIsr,
    Partition,
    ReplicationConfig,
)

# Not 0: a replica that never caught up has last_caught_up_time_ms 0, which must be older than
# any lag window.
START_MS = 1_000_000
TOPIC = "orders"
PARTITION = 0
_MAX_ROUNDS = 20


class MemoryCheckpoint:
    """The leader-epoch-checkpoint file, in memory. It outlives a simulated crash."""

    path = PurePath("memory", "leader-epoch-checkpoint")  # the cache names it in its logs

    def __init__(self) -> None:
        self._entries: list[EpochEntry] = []

    def read(self) -> list[EpochEntry]:
        return list(self._entries)

    def write(self, entries: Sequence[EpochEntry]) -> None:
        self._entries = list(entries)


@dataclass(frozen=True)
class Batch:
    """A record batch as the log stores it: offsets and epoch assigned, records opaque."""

    base_offset: int
    last_offset: int
    epoch: int
    payload: tuple[str, ...]


class MemoryLog:
    """A partition's log in memory, with the real Log's rules for offsets and leader epochs."""

    def __init__(self) -> None:
        self.checkpoint = MemoryCheckpoint()
        self.leader_epoch_cache = LeaderEpochCache(self.checkpoint)
        self.batches: list[Batch] = []
        self._log_start_offset = 0

    @property
    def log_start_offset(self) -> int:
        return self._log_start_offset

    @property
    def log_end_offset(self) -> int:
        return self.batches[-1].last_offset + 1 if self.batches else self._log_start_offset

    def append_as_leader(self, records: Sequence[str], leader_epoch: int) -> Batch:
        """One batch of `records` at the LEO, stamped with the leader epoch."""
        base = self.log_end_offset
        batch = Batch(base, base + len(records) - 1, leader_epoch, tuple(records))
        self._append([batch])
        return batch

    def append_as_follower(self, batches: Sequence[Batch]) -> None:
        """Batches copied from the leader, offsets and epochs kept; they must continue the log."""
        expected = self.log_end_offset
        for batch in batches:
            if batch.base_offset != expected:
                raise ValueError(f"batch at {batch.base_offset} does not start at {expected}")
            expected = batch.last_offset + 1
        self._append(batches)

    def _append(self, batches: Sequence[Batch]) -> None:
        for batch in batches:
            if batch.epoch > self.leader_epoch_cache.latest_epoch:
                self.leader_epoch_cache.assign(batch.epoch, batch.base_offset)
            self.batches.append(batch)

    def read(self, offset: int, max_offset: int | None = None) -> list[Batch]:
        """Whole batches from the one holding `offset`, none starting at or after max_offset."""
        if not self.log_start_offset <= offset <= self.log_end_offset:
            raise OffsetOutOfRange(
                f"offset {offset} is outside [{self.log_start_offset}, {self.log_end_offset}]"
            )
        return [
            b
            for b in self.batches
            if b.last_offset >= offset and (max_offset is None or b.base_offset < max_offset)
        ]

    def truncate_to(self, offset: int) -> None:
        """Drop the batch holding `offset` and every later one."""
        if offset < 0:
            raise ValueError(f"cannot truncate to negative offset {offset}")
        if offset < self.log_start_offset:
            self.truncate_fully_and_start_at(offset)
            return
        self.batches = [b for b in self.batches if b.last_offset < offset]
        self.leader_epoch_cache.truncate_from_end(self.log_end_offset)

    def truncate_fully_and_start_at(self, offset: int) -> None:
        self.batches = []
        self._log_start_offset = offset
        self.leader_epoch_cache.clear_and_flush()

    def advance_log_start(self, offset: int) -> None:
        """Retention: the batches wholly before `offset` are deleted."""
        self.batches = [b for b in self.batches if b.last_offset >= offset]
        self._log_start_offset = offset
        self.leader_epoch_cache.truncate_from_start(offset)

    def crash_losing_tail(self, offset: int) -> None:
        """A crash lost the unflushed batches from the one holding `offset` on. The epoch
        checkpoint survives (it is written on every change, but for the epochs below the log
        start); reopening the log trims it to the LEO and the log start, as Log does on load."""
        self.batches = [b for b in self.batches if b.last_offset < offset]
        self.leader_epoch_cache = LeaderEpochCache(self.checkpoint)
        self.leader_epoch_cache.truncate_from_end(self.log_end_offset)
        self.leader_epoch_cache.truncate_from_start(self.log_start_offset)


def fetch_once(
    follower: Partition,
    follower_log: MemoryLog,
    leader: Partition,
    leader_log: MemoryLog,
    now_ms: int,
    *,
    broker_epoch: int = 0,
    unclean_leader_election_enable: bool = False,
    on_outcome: Callable[[FollowerFetchOutcome], None] = lambda outcome: None,
) -> StopReplicating | None:
    """One fetch by a follower and its answer, as the fetcher and the leader make them: the
    leader validates it and records the follower's progress (`on_outcome` gets what it decided,
    an ISR proposal say, before the answer is made), then serves whole batches from the fetch
    offset up to its LEO unless the follower's history diverges; the follower truncates, or
    appends and takes the HW. A fetch offset out of the leader's range truncates the follower
    if it must; StopReplicating if that would lose data. Other refusals of the fetch (another
    leader epoch, not the leader) raise, as on_follower_fetch does."""
    request = next_fetch(follower)._replace(broker_epoch=broker_epoch)
    try:
        outcome = leader.on_follower_fetch(request, now_ms)
    except OffsetOutOfRange:
        action = on_offset_out_of_range(
            follower.name,
            follower_log.log_end_offset,
            leader_log.log_end_offset,
            leader_log.log_start_offset,
            unclean_leader_election_enable,
        )
        if isinstance(action, StopReplicating):
            return action
        if action is not None:
            apply_out_of_range(follower, follower_log, action)
        return None
    on_outcome(outcome)
    diverging = outcome.diverging_epoch
    records = [] if diverging is not None else leader_log.read(request.fetch_offset)
    response = FetchedPartition(leader.high_watermark, diverging, records)
    if not truncate_if_diverged(follower, follower_log, response):
        if records:
            follower_log.append_as_follower(records)
        follower.update_follower_high_watermark(response.high_watermark)
        follow_leader_log_start(follower, follower_log, leader_log.log_start_offset)
    return None


@dataclass
class Broker:
    broker_id: int
    log: MemoryLog
    partition: Partition
    alive: bool = True
    # What the periodic replication-offset-checkpoint task last wrote for this partition.
    checkpointed_high_watermark: int = 0


class Cluster:
    """Replicas 1..N of one partition, and the controller, driven step by step.

    The controller's committed state is `state`; it elects leaders only from the ISR and
    commits every ISR proposal at once. `acked` lists the acks=all batches whose produce
    succeeded (Kafka's DelayedProduce), in order."""

    def __init__(self, replicas: int = 3, config: ReplicationConfig | None = None) -> None:
        self.now_ms = START_MS
        self.config = config or ReplicationConfig()
        ids = tuple(range(1, replicas + 1))
        self.brokers: dict[int, Broker] = {}
        for broker_id in ids:
            log = MemoryLog()
            self.brokers[broker_id] = Broker(broker_id, log, self._new_partition(broker_id, log, 0))
        self.state = LeaderAndIsr(
            leader=NO_LEADER, leader_epoch=NO_EPOCH, isr=ids, replicas=ids, partition_epoch=0
        )
        self.acked: list[Batch] = []
        self._awaiting_acks: list[Batch] = []
        # How many of the controller's next AlterIsr answers get lost after it committed (a
        # timeout, a failover); the leader's channel sends those proposals again.
        self.answers_to_lose = 0
        self._unanswered: list[AlterIsrProposal] = []

    def _new_partition(self, broker_id: int, log: MemoryLog, checkpointed_hw: int) -> Partition:
        return Partition(
            TOPIC,
            PARTITION,
            broker_id,
            log,
            self.config,
            checkpointed_hw,
            # A dead broker is fenced: it may not join an ISR.
            usable_broker_epoch=lambda b: 0 if self.brokers[b].alive else None,
        )

    # -- views ---------------------------------------------------------------------------

    @property
    def leader(self) -> Broker:
        return self.brokers[self.state.leader]

    @property
    def live(self) -> list[Broker]:
        return [b for b in self.brokers.values() if b.alive]

    def logs(self) -> dict[int, tuple[int, list[Batch]]]:
        """(log start offset, batches) of every live replica."""
        return {b.broker_id: (b.log.log_start_offset, b.log.batches) for b in self.live}

    # -- time, crashes, the controller ----------------------------------------------------

    def advance(self, ms: int) -> None:
        self.now_ms += ms

    def crash(self, broker_id: int, lose_from: int | None = None) -> None:
        """The broker dies; with `lose_from`, its log loses the unflushed tail from there."""
        broker = self.brokers[broker_id]
        broker.alive = False
        if lose_from is not None:
            broker.log.crash_losing_tail(lose_from)
        self._complete_produces()

    def restart(self, broker_id: int) -> None:
        """The broker comes back with its log and its checkpointed HW, and learns the current
        state. A restarted leader of record waits for `elect`, which bumps the epoch."""
        broker = self.brokers[broker_id]
        broker.alive = True
        broker.partition = self._new_partition(
            broker_id, broker.log, broker.checkpointed_high_watermark
        )
        if self.state.leader != broker_id:
            broker.partition.make_follower(self.state)

    def checkpoint_high_watermarks(self, *broker_ids: int) -> None:
        """The periodic HW checkpoint task runs on these brokers (default: every live one)."""
        for broker in [self.brokers[b] for b in broker_ids] or self.live:
            broker.checkpointed_high_watermark = broker.partition.high_watermark

    def elect(self, leader: int) -> None:
        """Clean election of an ISR member with a new leader epoch; dead brokers leave the ISR.
        Every live replica gets the LeaderAndIsr."""
        assert self.brokers[leader].alive and leader in self.state.isr, "unclean election"
        self.state = replace(
            self.state,
            leader=leader,
            leader_epoch=self.state.leader_epoch + 1,
            isr=tuple(b for b in self.state.isr if self.brokers[b].alive),
            partition_epoch=self.state.partition_epoch + 1,
        )
        for broker in self.live:
            if broker.broker_id == leader:
                broker.partition.make_leader(self.state, self.now_ms)
            else:
                broker.partition.make_follower(self.state)
        self._complete_produces()

    def _alter_isr(self, proposal: AlterIsrProposal) -> None:
        """The controller commits a proposal with partition_epoch + 1 and answers the leader;
        a proposal it already committed (a retry) gets the committed state as its answer."""
        already_committed = (proposal.leader_epoch, proposal.new_isr) == (
            self.state.leader_epoch,
            self.state.isr,
        )
        if not already_committed:
            assert (proposal.leader_epoch, proposal.partition_epoch) == (
                self.state.leader_epoch,
                self.state.partition_epoch,
            ), "proposals are answered at once, so they are never stale here"
            self.state = replace(
                self.state, isr=proposal.new_isr, partition_epoch=self.state.partition_epoch + 1
            )
        partition = self.leader.partition
        if self.answers_to_lose:
            self.answers_to_lose -= 1
            self._unanswered.append(proposal)
            lost = RequestTimedOut("the AlterIsr answer was lost")
            partition.on_alter_isr_result(proposal, None, lost, self.now_ms)
        else:
            partition.on_alter_isr_result(proposal, self.state, None, self.now_ms)

    def retry_alter_isr(self) -> None:
        """The leader's channel sends again every proposal still awaiting an answer."""
        unanswered, self._unanswered = self._unanswered, []
        for proposal in unanswered:
            if self.leader.partition.awaits_answer(proposal):
                self._alter_isr(proposal)
        self._complete_produces()

    # -- the data path --------------------------------------------------------------------

    def produce(self, *records: str, acks: int = ACKS_ALL) -> Batch:
        leader = self.leader
        assert leader.alive
        leader.partition.check_append(acks)
        batch = leader.log.append_as_leader(records, leader.partition.leader_epoch)
        leader.partition.after_leader_append(self.now_ms)
        if acks == ACKS_ALL:
            self._awaiting_acks.append(batch)
        self._complete_produces()
        return batch

    def _complete_produces(self) -> None:
        """An acks=all batch is acknowledged once its leader's HW covers it; it fails if the
        leadership it was written under ended first or the ISR fell below the minimum."""
        leader = self.brokers.get(self.state.leader)
        waiting = []
        for batch in self._awaiting_acks:
            if leader is None or not leader.alive or leader.partition.leader_epoch != batch.epoch:
                continue
            enough = leader.partition.enough_replicas_for(batch.last_offset + 1)
            if enough is None:
                waiting.append(batch)
            elif enough:
                self.acked.append(batch)
        self._awaiting_acks = waiting

    def fetch(self, follower_id: int) -> None:
        """One fetch by a follower from the leader it knows (fetch_once); the controller
        commits an ISR proposal it makes at once."""
        follower = self.brokers[follower_id]
        leader = self.brokers[follower.partition.leader]
        assert follower.alive and leader.alive

        def on_outcome(outcome: FollowerFetchOutcome) -> None:
            if outcome.isr_proposal is not None:
                self._alter_isr(outcome.isr_proposal)
            self._complete_produces()

        stop = fetch_once(
            follower.partition,
            follower.log,
            leader.partition,
            leader.log,
            self.now_ms,
            unclean_leader_election_enable=self.config.unclean_leader_election_enable,
            on_outcome=on_outcome,
        )
        assert stop is None, stop.reason

    def check_isr(self) -> None:
        """The leader's periodic ISR check."""
        proposal = self.leader.partition.maybe_shrink_isr(self.now_ms)
        if proposal is not None:
            self._alter_isr(proposal)
        self._complete_produces()

    def replicate(self) -> None:
        """Fetch rounds by every live follower of the live leader until a round changes
        nothing: logs caught up, ISR expanded, HW known everywhere."""
        assert self.leader.alive
        for _ in range(_MAX_ROUNDS):
            before = self._progress()
            for broker in self.live:
                if broker.broker_id != self.state.leader:
                    self.fetch(broker.broker_id)
            if self._progress() == before:
                return
        raise AssertionError(f"replication did not settle in {_MAX_ROUNDS} rounds")

    def _progress(self) -> tuple[object, ...]:
        return (
            self.state,
            tuple(
                (b.broker_id, b.log.log_end_offset, b.partition.high_watermark) for b in self.live
            ),
        )
