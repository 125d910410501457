"""One replica of a partition on this broker: its log, its role, and the leader's HW rule."""

from __future__ import annotations

from dataclasses import dataclass

from tidewater.broker.log.log import AppendInfo, Log
from tidewater.broker.topic_config import TopicConfig
from tidewater.errors import (
    FencedLeaderEpoch,
    NotEnoughReplicas,
    NotLeaderOrFollower,
    UnknownLeaderEpoch,
)

ACKS_ALL = -1
NO_LEADER = -1
UNKNOWN_OFFSET = -1


@dataclass(frozen=True)
class LeaderAndIsrState:
    """The controller's decision for one partition, as LeaderAndIsr carries it."""

    leader: int
    leader_epoch: int
    isr: tuple[int, ...]
    replicas: tuple[int, ...]
    partition_epoch: int
    controller_epoch: int


@dataclass(frozen=True)
class LogReadResult:
    data: bytes
    high_watermark: int
    log_start_offset: int
    log_end_offset: int


class Partition:
    def __init__(
        self,
        topic: str,
        partition: int,
        local_broker_id: int,
        log: Log,
        config: TopicConfig,
        checkpointed_high_watermark: int,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.local_broker_id = local_broker_id
        self.log = log
        self.epoch_cache = log.leader_epoch_cache
        self.config = config
        self.leader = NO_LEADER
        self.leader_epoch = -1
        self.partition_epoch = -1
        self.controller_epoch = -1
        self.isr: tuple[int, ...] = ()
        self.replicas: tuple[int, ...] = ()
        # A replica's HW after a restart is min(checkpoint, LEO): the checkpoint may be newer
        # than a log whose unflushed tail was lost.
        self.high_watermark = min(checkpointed_high_watermark, log.log_end_offset)
        # Followers' LEOs as the leader last learned them from their fetches; unknown = -1.
        self.remote_log_end_offsets: dict[int, int] = {}

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.partition)

    @property
    def is_leader(self) -> bool:
        return self.leader == self.local_broker_id

    def make_leader(self, state: LeaderAndIsrState) -> None:
        """Kafka's makeLeader: take the new epoch, start it at our LEO, reset follower state."""
        self._apply(state)
        self.epoch_cache.assign(state.leader_epoch, self.log.log_end_offset)
        self.remote_log_end_offsets = {
            replica: UNKNOWN_OFFSET for replica in state.replicas if replica != self.local_broker_id
        }
        # The ISR may now be just us, so the HW may move at once.
        self.maybe_increment_high_watermark()

    def make_follower(self, state: LeaderAndIsrState) -> None:
        self._apply(state)
        self.isr = ()
        self.remote_log_end_offsets = {}

    def _apply(self, state: LeaderAndIsrState) -> None:
        self.leader = state.leader
        self.leader_epoch = state.leader_epoch
        self.isr = state.isr
        self.replicas = state.replicas
        self.partition_epoch = state.partition_epoch
        self.controller_epoch = state.controller_epoch

    def check_current_leader_epoch(self, current_leader_epoch: int) -> None:
        """KIP-320: a request naming an older epoch is fenced, a newer one is not yet known."""
        if current_leader_epoch == -1:
            return
        if current_leader_epoch < self.leader_epoch:
            raise FencedLeaderEpoch(
                f"{self.topic}-{self.partition}: request epoch {current_leader_epoch} is older "
                f"than the current leader epoch {self.leader_epoch}"
            )
        if current_leader_epoch > self.leader_epoch:
            raise UnknownLeaderEpoch(
                f"{self.topic}-{self.partition}: request epoch {current_leader_epoch} is newer "
                f"than this replica's leader epoch {self.leader_epoch}"
            )

    def require_leader(self) -> None:
        if not self.is_leader:
            raise NotLeaderOrFollower(
                f"broker {self.local_broker_id} is not the leader of {self.topic}-{self.partition}"
                f" (leader: {self.leader}, epoch {self.leader_epoch})"
            )

    def append_as_leader(self, batch: bytearray, acks: int) -> AppendInfo:
        self.require_leader()
        if acks == ACKS_ALL and len(self.isr) < self.config.min_insync_replicas:
            raise NotEnoughReplicas(
                f"{self.topic}-{self.partition}: ISR {list(self.isr)} is smaller than "
                f"min.insync.replicas={self.config.min_insync_replicas}"
            )
        info = self.log.append_as_leader(batch, self.leader_epoch)
        self.maybe_increment_high_watermark()
        return info

    def maybe_increment_high_watermark(self) -> bool:
        """HW = min LEO over the ISR (leader included); it never moves back."""
        candidate = self.log.log_end_offset
        for replica in self.isr:
            if replica != self.local_broker_id:
                candidate = min(candidate, self.remote_log_end_offsets.get(replica, UNKNOWN_OFFSET))
        if candidate > self.high_watermark:
            self.high_watermark = candidate
            return True
        return False

    def has_enough_replicas_for(self, required_offset: int) -> bool | None:
        """acks=all completion: None while the HW is short of the offset, else whether the ISR
        still meets min.insync.replicas (False → NOT_ENOUGH_REPLICAS_AFTER_APPEND)."""
        if self.high_watermark < required_offset:
            return None
        return len(self.isr) >= self.config.min_insync_replicas

    def read(
        self, fetch_offset: int, max_bytes: int, *, for_follower: bool, min_one_batch: bool
    ) -> LogReadResult:
        """Consumers read up to the HW, followers up to the LEO."""
        max_offset = None if for_follower else self.high_watermark
        data = self.log.read(fetch_offset, max_bytes, max_offset, min_one_batch)
        return LogReadResult(
            data=bytes(data),
            high_watermark=self.high_watermark,
            log_start_offset=self.log.log_start_offset,
            log_end_offset=self.log.log_end_offset,
        )
