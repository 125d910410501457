"""The leader's view of one follower replica (Kafka's Replica / ReplicaState)."""

from __future__ import annotations

from dataclasses import dataclass, field

UNKNOWN_OFFSET = -1
TopicPartition = tuple[str, int]


@dataclass
class FetchClock:
    """A fetch session as the leader's replicas see it: the time of its last fetch, and the
    session partitions to process at its next one (the others are quiet: nothing in them
    changed since the session's fetches last found their follower caught up and in sync).

    A follower replica that a session keeps fetching at the leader's LEO is attached to the
    session's clock instead of being told of each fetch: every one of them would find it
    caught up, so its fetch and caught-up times are the clock's. Any change to the partition
    (an append, an ISR or role change, a fetch of it processed again) detaches it: it takes
    the clock's time then, and its partition goes back to `unsettled`. So an idle session's
    fetch costs the same for ten partitions as for ten thousand.

    `now_ms` takes a fetch's time only once the partitions it processes are: one of them it
    names, behind the LEO, wakes with the previous fetch's time, the last that found it
    caught up."""

    now_ms: int = 0
    unsettled: set[TopicPartition] = field(default_factory=set)


@dataclass
class Replica:
    broker_id: int
    log_start_offset: int = UNKNOWN_OFFSET
    log_end_offset: int = UNKNOWN_OFFSET
    # The leader's LEO and the time at the follower's previous fetch: a follower that fetched
    # up to what the leader had then was caught up then, even if the leader has moved on.
    last_fetch_leader_log_end_offset: int = UNKNOWN_OFFSET
    last_fetch_time_ms: int = 0
    last_caught_up_time_ms: int = 0
    # The follower's broker epoch in its last fetch (KIP-903): which incarnation of the broker
    # the state above describes. 0: none yet, or its fetches carry none.
    broker_epoch: int = 0
    # The last non-zero one: a fetch at 0 comes from a broker between two registrations
    # (told to register again, lifecycle), the same process and log, not a new incarnation.
    last_broker_epoch: int = 0
    # The clock of the fetch session that keeps this follower quiet (FetchClock), if any.
    clock: FetchClock | None = None

    def wake(self, key: TopicPartition) -> None:
        """Detach from a quiet session's clock, taking its fetches' time: each found this
        follower caught up. Its partition is processed at the session's next fetch."""
        clock = self.clock
        if clock is None:
            return
        self.clock = None
        self.last_fetch_time_ms = max(self.last_fetch_time_ms, clock.now_ms)
        self.last_caught_up_time_ms = max(self.last_caught_up_time_ms, clock.now_ms)
        clock.unsettled.add(key)

    def update_fetch_state(
        self,
        fetch_offset: int,
        log_start_offset: int,
        fetch_time_ms: int,
        leader_end_offset: int,
        broker_epoch: int,
    ) -> None:
        """Kafka's Replica#updateFetchState (updateLogReadResult in older releases). A fetch
        from another incarnation of the follower than the last one's starts afresh: what the
        old one had fetched, and when it was caught up, says nothing of a broker that may have
        lost its unflushed log tail since."""
        if broker_epoch:
            if self.last_broker_epoch and broker_epoch != self.last_broker_epoch:
                self.reset(fetch_time_ms, leader_end_offset, is_new_leader=True, in_sync=False)
            self.last_broker_epoch = broker_epoch
        self.broker_epoch = broker_epoch
        if fetch_offset >= leader_end_offset:
            self.last_caught_up_time_ms = max(self.last_caught_up_time_ms, fetch_time_ms)
        elif fetch_offset >= self.last_fetch_leader_log_end_offset:
            self.last_caught_up_time_ms = max(self.last_caught_up_time_ms, self.last_fetch_time_ms)
        self.log_start_offset = log_start_offset
        self.log_end_offset = fetch_offset
        self.last_fetch_leader_log_end_offset = leader_end_offset
        self.last_fetch_time_ms = fetch_time_ms

    def reset(
        self, now_ms: int, leader_end_offset: int, is_new_leader: bool, in_sync: bool
    ) -> None:
        """On becoming leader: ISR members count as caught up now, others not at all; a new
        leader knows nothing of the followers' logs until they fetch (nor does any leader of a
        follower's new incarnation: update_fetch_state resets it as for a new leader)."""
        self.last_caught_up_time_ms = now_ms if in_sync else 0
        if is_new_leader:
            self.broker_epoch = self.last_broker_epoch = 0
            self.log_start_offset = UNKNOWN_OFFSET
            self.log_end_offset = UNKNOWN_OFFSET
            self.last_fetch_leader_log_end_offset = UNKNOWN_OFFSET
            self.last_fetch_time_ms = 0
        else:
            self.last_fetch_leader_log_end_offset = leader_end_offset
            self.last_fetch_time_ms = now_ms

    def is_caught_up(
        self, leader_end_offset: int, now_ms: int, replica_lag_time_max_ms: int
    ) -> bool:
        """In sync by the lag rule: at the leader's LEO, or caught up within the lag time."""
        return (
            leader_end_offset == self.log_end_offset
            or now_ms - self.last_caught_up_time_ms <= replica_lag_time_max_ms
        )
