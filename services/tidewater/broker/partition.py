"""A partition hosted on this broker: the pure replication state bound to its log on disk and
to its idempotent producers' state, which every append and truncation keeps in step with the
log (the fetcher appends and truncates through this class for that reason)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

from tidewater.broker.log.dir_failure import LogDirFailureChannel, reports_io_failures
from tidewater.broker.log.leader_epoch_cache import LeaderEpochCache
from tidewater.broker.log.log import AppendInfo, Log
from tidewater.broker.producer_state import ProducerStateManager, batch_headers
from tidewater.broker.topic_config import TopicConfig
from tidewater.errors import NotLeaderOrFollower
from tidewater.records.header import read_header
from tidewater.replication.partition import Partition, ReplicationConfig

log = logging.getLogger(__name__)


# A NamedTuple, not a frozen dataclass (about three times as dear to make): one per read of a
# partition for a fetch.
class LogReadResult(NamedTuple):
    # Whole batches, as the log read them: a view of a read or of the last batch appended.
    data: bytes | memoryview
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
    def __init__(
        self, state: Partition, log: Log, config: TopicConfig, time_ms: Callable[[], int]
    ) -> None:
        self.state = state
        self.log = log
        self.config = config
        # The broker's clock: when the producer state saw each producer last.
        self._time_ms = time_ms
        # Loaded with the log: hosting the partition reads none of it.
        self.producer_state = log.producer_state
        # The load's journal holds every batch after the snapshot: below the HW it serves no
        # truncation but an unclean one, and a partition with no appends would keep it.
        self.producer_state.release(state.high_watermark)
        self._leader_appends = asyncio.Lock()
        # Set when the broker stops hosting the partition: a produce still waiting for its
        # turn must not append after that.
        self.stopped = False
        # prepare_truncation's state for truncate_to: (offset, LEO then, the truncated log's
        # end, the producer state rebuilt for it).
        self._prepared_truncation: tuple[int, int, int, ProducerStateManager] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.state.topic, self.state.partition)

    @property
    def log_start_offset(self) -> int:
        return self.log.log_start_offset

    @property
    def log_end_offset(self) -> int:
        return self.log.log_end_offset

    @property
    def leader_epoch_cache(self) -> LeaderEpochCache:
        return self.log.leader_epoch_cache

    # The producer state's snapshots live in the log's directory: their I/O errors are the
    # log dir's too.
    @property
    def dir_failures(self) -> LogDirFailureChannel | None:
        return self.log.dir_failures

    @property
    def log_dir(self) -> Path:
        return self.log.log_dir

    def reconfigure(self, config: TopicConfig, replica_lag_time_max_ms: int, now_ms: int) -> bool:
        """New topic configs, in force from their next use (the log reads its config at
        each roll, retention and flush check). Returns whether the HW moved (a leader meeting
        a lower min.insync.replicas)."""
        self.config = config
        self.log.config = config.log
        return self.state.reconfigure(replication_config(config, replica_lag_time_max_ms), now_ms)

    async def append_as_leader(
        self,
        batch: bytearray,
        acks: int,
        now_ms: int,
        check: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[AppendInfo, int]:
        """Append a validated batch as leader; returns the append and the leader epoch it was
        made under (an acks=all ack must not outlive that epoch). A retry of an idempotent
        batch already in the log is not appended again: the answer carries the original
        offsets (Kafka's, with no timestamp). Appends wait their turn, taken at the call
        (first come, first served): each checks leadership and duplicates only after the one
        before it is in the log. `check`, the rest of the batch's validation, runs in the
        turn, as Kafka validates in the log's lock: a slow check does not let a later batch
        overtake this one."""
        async with self._leader_appends:
            if check is not None:
                await check()
            if self.stopped:
                raise NotLeaderOrFollower(f"{self.state.name} is no longer hosted here")
            self.state.check_append(acks)
            leader_epoch = self.state.leader_epoch
            header = read_header(batch)
            if header.producer_id >= 0:
                duplicate = self.producer_state.check(header)
                if duplicate is not None:
                    self.state.maybe_increment_high_watermark(now_ms)
                    info = AppendInfo(duplicate.first_offset, duplicate.last_offset, -1, -1, 0)
                    return info, leader_epoch
            active_segment = self._active_segment_base()

            def appended(info: AppendInfo) -> None:
                # Runs as the batch enters the log, before anything else changes it.
                if header.producer_id >= 0:
                    self.producer_state.update(header, info.first_offset, now_ms)
                    self.producer_state.release(self.state.high_watermark)
                self._snapshot_if_rolled(active_segment)
                self.state.after_leader_append(now_ms)

            try:
                info = await self.log.append_batch_off_loop(batch, leader_epoch, appended)
            except asyncio.CancelledError:
                # The batch lands all the same (its client went): the turn is kept until it
                # has, or the next batch (this one's retry) would be checked for duplicates
                # against a producer state without it, and appended twice (review 31 #1).
                await self.log.wait_written()
                raise
            return info, leader_epoch

    async def append_as_follower(self, batches: bytes | bytearray | memoryview) -> AppendInfo:
        """Append what the leader sent (large data on a worker thread) and replay it into the
        producer state, so this replica deduplicates retries if it becomes leader."""
        active_segment = self._active_segment_base()

        def appended(_: AppendInfo) -> None:
            # Runs as the data enters the log, before anything else changes it.
            self.producer_state.load_from_log(batch_headers(batches), self._time_ms())
            self.producer_state.release(self.state.high_watermark)
            self._snapshot_if_rolled(active_segment)

        return await self.log.append_as_follower_off_loop(batches, appended)

    async def prepare_truncation(self, offset: int) -> None:
        """Before a follower's truncation to `offset`: one below the producer state's journal
        (an unclean election's, below the HW) rebuilds the state from a snapshot and the log,
        about 4 us a batch on the event loop, up to a segment's; it is built here on a worker
        thread instead, while the caller's fetcher (the log's only writer) waits, and
        truncate_to takes it if the log is still as it was."""
        self.log.take_in_pending_write()
        log_end_offset = self.log.log_end_offset
        if offset >= min(self.producer_state.journal_floor, log_end_offset):
            return
        try:
            rebuilt, reached = await asyncio.to_thread(
                self.producer_state.rebuilt_below, self.log, offset, self._time_ms()
            )
        except Exception:
            # Retention changed the log under the read, say: truncate_to rebuilds on the loop.
            log.exception("%s: preparing the producer state for a truncation", self.state.name)
            return
        self._prepared_truncation = (offset, log_end_offset, reached, rebuilt)

    @reports_io_failures
    def truncate_to(self, offset: int) -> None:
        # A write under way enters the log (and the producer state) first: its batches are
        # among those to undo.
        self.log.take_in_pending_write()
        log_end_offset = self.log.log_end_offset
        prepared, self._prepared_truncation = self._prepared_truncation, None
        self.log.truncate_to(offset)
        truncated_to = self.log.log_end_offset
        # Undone from the producer state's journal; below its floor (an unclean election's
        # truncation) rebuilt as Kafka's truncateTo does, from a snapshot and the log after it.
        if truncated_to < log_end_offset and not self.producer_state.truncate(truncated_to):
            if prepared is not None and prepared[:3] == (offset, log_end_offset, truncated_to):
                self.producer_state.adopt(prepared[3], truncated_to)
            else:
                log.warning(
                    "%s: truncated below the producer state's journal (offset %d); "
                    "rebuilding it from the log",
                    self.state.name,
                    truncated_to,
                )
                self.producer_state.rebuild(self.log, self._time_ms())
            self.producer_state.release(self.state.high_watermark)

    @reports_io_failures
    def truncate_fully_and_start_at(self, offset: int) -> None:
        self.log.truncate_fully_and_start_at(offset)
        self.producer_state.clear()

    def advance_log_start(self, offset: int) -> None:
        # The producer state keeps producers whose batches lie before the log start: they
        # go only by expiry (ProducerStateManager.expire).
        self.log.advance_log_start(offset)
        self.snapshot_if_log_start_passed()

    @reports_io_failures
    def snapshot_if_log_start_passed(self) -> None:
        """Once the log starts after the newest producer snapshot (retention, or a leader's
        log start), a restart would load that snapshot and replay nothing of the producers
        since, who then look stale or unknown: snapshot the state at the LEO (review 31 #2;
        Kafka snapshots at every roll, retention's included)."""
        newest = self.producer_state.newest_snapshot_offset()
        if newest is None or newest < self.log.log_start_offset:
            leo = self.log.log_end_offset
            self.log.sync_files([self.producer_state.take_snapshot(leo, durable=False)])

    @reports_io_failures
    def take_producer_snapshot(self) -> None:
        """Snapshot the producer state at the LEO (clean shutdown)."""
        self.producer_state.take_snapshot(self.log.log_end_offset)

    def _active_segment_base(self) -> int:
        return self.log.active_segment_base

    @reports_io_failures
    def _snapshot_if_rolled(self, active_segment_before: int) -> None:
        # Kafka snapshots on segment roll, so a restart replays about one segment at most,
        # and since KAFKA-9693/KAFKA-15046 fsyncs it in the background: on a busy disk those
        # fsyncs took 35-67 ms here, with every request on the event loop waiting.
        if self._active_segment_base() != active_segment_before:
            leo = self.log.log_end_offset
            self.log.sync_files([self.producer_state.take_snapshot(leo, durable=False)])

    def read(
        self, fetch_offset: int, max_bytes: int, *, for_follower: bool, min_one_batch: bool
    ) -> LogReadResult:
        """Consumers read up to the HW, followers up to the LEO."""
        max_offset = None if for_follower else self.state.high_watermark
        data = self.log.read(fetch_offset, max_bytes, max_offset, min_one_batch)
        return LogReadResult(
            data=data,
            high_watermark=self.state.high_watermark,
            log_start_offset=self.log.log_start_offset,
            log_end_offset=self.log.log_end_offset,
        )
