"""A partition hosted on this broker: the pure replication state bound to its log on disk."""

from __future__ import annotations

from dataclasses import dataclass

from tidewater.broker.log.log import AppendInfo, Log
from tidewater.broker.topic_config import TopicConfig
from tidewater.replication.partition import Partition, ReplicationConfig


@dataclass(frozen=True)
class LogReadResult:
    data: bytes
    high_watermark: int
    log_start_offset: int
    log_end_offset: int


def replication_config(config: TopicConfig, replica_lag_time_max_ms: int) -> ReplicationConfig:
    return ReplicationConfig(
        replica_lag_time_max_ms=replica_lag_time_max_ms,
        min_insync_replicas=config.min_insync_replicas,
        unclean_leader_election_enable=config.unclean_leader_election_enable,
    )


class HostedPartition:
    def __init__(self, state: Partition, log: Log, config: TopicConfig) -> None:
        self.state = state
        self.log = log
        self.config = config

    @property
    def key(self) -> tuple[str, int]:
        return (self.state.topic, self.state.partition)

    def reconfigure(self, config: TopicConfig, replica_lag_time_max_ms: int) -> None:
        self.config = config
        self.state.config = replication_config(config, replica_lag_time_max_ms)

    def append_as_leader(self, batch: bytearray, acks: int, now_ms: int) -> tuple[AppendInfo, bool]:
        """Append a validated batch as leader; returns the append and whether the HW moved."""
        self.state.check_append(acks)
        info = self.log.append_as_leader(batch, self.state.leader_epoch)
        return info, self.state.after_leader_append(now_ms)

    def read(
        self, fetch_offset: int, max_bytes: int, *, for_follower: bool, min_one_batch: bool
    ) -> LogReadResult:
        """Consumers read up to the HW, followers up to the LEO."""
        max_offset = None if for_follower else self.state.high_watermark
        data = self.log.read(fetch_offset, max_bytes, max_offset, min_one_batch)
        return LogReadResult(
            data=bytes(data),
            high_watermark=self.state.high_watermark,
            log_start_offset=self.log.log_start_offset,
            log_end_offset=self.log.log_end_offset,
        )
