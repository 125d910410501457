"""One partition's log (Kafka's UnifiedLog and LocalLog): a directory `<topic>-<partition>` of
segments named by their 20-digit base offset, plus the partition's leader epoch history.

Appends go to the last (active) segment, which rolls on segment.bytes, segment.ms or a full
index. Reads serve whole stored batches without decoding them. Loading recovers what a crash
may have left half-written after the recovery point (the offset up to which everything was
fsynced). The log is not thread-safe: the broker drives it from its event loop, and only the
bytes of a large append (a produced batch, a follower's fetched data) are written by a worker
thread, which the log takes in on the loop.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tidewater.broker.log.checkpoints import TEMP_SUFFIX, LeaderEpochCheckpoint, fsync_dir
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.dir_failure import LogDirFailureChannel, guarded, reports_io_failures
from tidewater.broker.log.index import CorruptIndex
from tidewater.broker.log.leader_epoch_cache import LeaderEpochCache
from tidewater.broker.log.segment import (
    INDEX_SUFFIX,
    INT32_MAX,
    LOG_SUFFIX,
    TIME_INDEX_SUFFIX,
    LogSegment,
    segment_file_name,
)
from tidewater.broker.producer_state import ProducerStateManager
from tidewater.errors import (
    CorruptMessage,
    MessageTooLarge,
    OffsetOutOfRange,
    StorageError,
    TidewaterError,
)
from tidewater.records.header import (
    HEADER_SIZE,
    LOG_OVERHEAD,
    MAGIC,
    BatchHeader,
    crc_matches,
    patch_base_offset_and_epoch,
    read_header,
)

log = logging.getLogger(__name__)

LEADER_EPOCH_CHECKPOINT = "leader-epoch-checkpoint"
# A log directory being deleted is renamed `<topic>-<partition>.<id>-delete` first.
DELETE_DIR_SUFFIX = "-delete"
# A stray log (tidewater.broker.stray_logs) is renamed `<topic>-<partition>.<id>-stray`, and
# deleted after file.delete.delay.ms.
STRAY_DIR_SUFFIX = "-stray"
# A stray log of a topic the controller's view does not know: kept until an operator acts.
ORPHANED_DIR_SUFFIX = "-orphaned"
# Left by an interrupted delete, compaction or checkpoint write.
_STRAY_SUFFIXES = (".deleted", ".cleaned", TEMP_SUFFIX)
_SEGMENT_FILE = re.compile(r"([0-9]{20})(\.log|\.index|\.timeindex)")
_PARTITION = re.compile(r"[0-9]+")
# Threads that copy large appends into the page cache, off the event loop; each log has at
# most one write in flight. Followers' writes have threads of their own, as Kafka's fetcher
# threads write what they fetch: a follower's write stalled on the disk then holds up no
# produce. A fetcher writes one partition at a time: four fetchers can write at once.
_WRITERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="log-writer")
_FOLLOWER_WRITERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="follower-writer")
# Smaller batches are written on the loop: their write takes less than a hop to a thread.
OFF_LOOP_WRITE_BYTES = 64 * 1024


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def parse_partition_dir(name: str) -> tuple[str, int]:
    """`<topic>-<partition>` → (topic, partition), split at the last '-' (topics may hold '-')."""
    topic, sep, partition = name.rpartition("-")
    if not sep or not topic or not _PARTITION.fullmatch(partition):
        raise StorageError(f"{name!r} is not a partition directory (<topic>-<partition>)")
    return topic, int(partition)


class UnexpectedAppendOffset(TidewaterError):
    """A follower's batches do not continue this log (they must start at its LEO)."""


# A NamedTuple, not a frozen dataclass (about three times as dear to make): one per append.
class AppendInfo(NamedTuple):
    first_offset: int
    last_offset: int
    max_timestamp: int
    offset_of_max_timestamp: int
    size_bytes: int


@dataclass(frozen=True, slots=True)
class _PendingWrite:
    """Batches that a worker thread is writing to the end of `segment`."""

    segment: LogSegment
    headers: Sequence[BatchHeader]
    size: int
    # A produced batch, handed over to serve reads of it (keep_appended_batch).
    kept: bytearray | None
    write: Future[None]
    appended: asyncio.Future[AppendInfo]
    on_appended: Callable[[AppendInfo], None]


class Log:
    """Use Log.open."""

    def __init__(
        self,
        directory: Path,
        config: LogConfig,
        segments: list[LogSegment],
        recovery_point: int,
        time_ms: Callable[[], int],
        unsynced_dirs: set[Path],
        log_start_offset: int,
    ) -> None:
        self.dir = directory
        self.topic, self.partition = parse_partition_dir(directory.name)
        self.config = config
        self._segments = segments
        self._bases = [segment.base_offset for segment in segments]
        self._time_ms = time_ms
        # Kafka's logStartOffset: the first offset the log serves, at or after the first
        # segment's base (records before it in that segment are gone for readers). Clamped:
        # a crash may have taken back the tail it was in, or kept a checkpoint older than the
        # segments' deletion.
        self._log_start_offset = min(
            max(log_start_offset, segments[0].base_offset), segments[-1].next_offset
        )
        self.recovery_point = min(recovery_point, self.log_end_offset)
        self._last_flush_ms = time_ms()
        # Directories whose entries (segment files, the log's own directory) changed since
        # they were last fsynced; the next flush syncs them.
        self._unsynced_dirs = unsynced_dirs
        # Set by the LogManager: takes the flush of a rolled segment off the append path
        # (Kafka flushes it on its scheduler). Unset, a roll flushes at once.
        self.flush_in_background: Callable[[Log, FlushJob], None] | None = None
        # Set by the LogManager: checkpoints the recovery point or log start offset that a
        # truncation lowered.
        self.offsets_lowered: Callable[[Log], None] | None = None
        # Bumped by whatever makes a flush job in flight describe the wrong files.
        self._generation = 0
        self._pending_write: _PendingWrite | None = None
        # Set by the LogManager: where an I/O error in this log is reported.
        self.dir_failures: LogDirFailureChannel | None = None
        # Set by the LogManager: the topic's id (KIP-516) from the log's partition.metadata;
        # empty when it has none (a log written before topic ids).
        self.topic_id = b""
        self.leader_epoch_cache = LeaderEpochCache(
            LeaderEpochCheckpoint(directory / LEADER_EPOCH_CHECKPOINT),
            # Written also from outside the log (a new leader's epoch).
            lambda: guarded(self.dir_failures, self.log_dir),
        )
        # The epoch checkpoint may know of data that the crash took back, or that retention
        # removed: Kafka trims it to the log on load (its epochs below the log start stay
        # on disk until the log start is checkpointed: see log_start_checkpointed).
        self.leader_epoch_cache.truncate_from_end(self.log_end_offset)
        self.leader_epoch_cache.truncate_from_start(self.log_start_offset)
        # Segments whose deletion a crash undid after the log start was checkpointed.
        self._delete_oldest_segments(
            self._wholly_before(self._log_start_offset), "the checkpointed log start offset"
        )
        # Its idempotent producers (Kafka's UnifiedLog.producerStateManager), loaded by open();
        # the partition hosting the log keeps them in step with its appends and truncations.
        self.producer_state = ProducerStateManager(directory)

    @classmethod
    def open(
        cls,
        directory: Path,
        config: LogConfig,
        recovery_point: int = 0,
        time_ms: Callable[[], int] = wall_clock_ms,
        log_start_offset: int = 0,
    ) -> Log:
        """Load (or create) the log in `directory`. Segments at or after `recovery_point`, and
        any whose indexes are missing or corrupt, are recovered; a torn or corrupt tail is
        truncated with a warning and the segments after it are deleted, as are those after a
        gap in the offsets (an error). `log_start_offset` (checkpointed) is kept within
        [first segment's base offset, LEO]. The producer state is loaded too."""
        directory = Path(directory)
        parse_partition_dir(directory.name)
        unsynced_dirs: set[Path] = set()
        if not directory.exists():
            directory.mkdir(parents=True)
            unsynced_dirs.add(directory.parent)
        now = time_ms()
        segments = _load_segments(directory, config, recovery_point, log_start_offset, now)
        try:
            if not segments:
                segments = [LogSegment.create(directory, 0, now)]
                unsynced_dirs.add(directory)
            opened = cls(
                directory,
                config,
                segments,
                recovery_point,
                time_ms,
                unsynced_dirs,
                log_start_offset,
            )
            # Here, as Kafka's log loading does (the broker loads its logs before it
            # registers), not when a LeaderAndIsr first hosts the partition: replaying up to a
            # segment of batch headers after a kill -9 (about a minute for 1 GiB of small
            # batches) then held up heartbeats and every other partition (review 14 M3).
            opened.producer_state.rebuild(opened, now)
            return opened
        except BaseException:
            for segment in segments:
                segment.close()
            raise

    # -- state ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def log_dir(self) -> Path:
        return self.dir.parent

    @property
    def log_start_offset(self) -> int:
        return self._log_start_offset

    @property
    def log_end_offset(self) -> int:
        """LEO: the offset the next appended record gets."""
        return self._segments[-1].next_offset

    @property
    def active_segment_base(self) -> int:
        """Base offset of the segment appends go to."""
        return self._segments[-1].base_offset

    @property
    def size_bytes(self) -> int:
        return sum(segment.size for segment in self._segments)

    @property
    def segments(self) -> Sequence[LogSegment]:
        return tuple(self._segments)

    def _floor(self, offset: int) -> int:
        """Index of the segment that would hold `offset` (the first one if it is below all)."""
        return max(bisect.bisect_right(self._bases, offset) - 1, 0)

    def bytes_from(self, offset: int) -> tuple[int, int] | None:
        """(active segment's base offset, position of the batch holding `offset` in it), or
        None when `offset` is not in the active segment: what `bytes_after` measures from."""
        segment = self._segments[-1]
        if not segment.base_offset <= offset <= self.log_end_offset:
            return None
        found = segment.find_batch(offset) if offset < self.log_end_offset else None
        return segment.base_offset, found[0] if found is not None else segment.size

    def bytes_after(self, start: tuple[int, int]) -> int | None:
        """Bytes in the log after `start` (from bytes_from), None once the segment rolled:
        an upper bound of what a read from there finds, without reading."""
        segment = self._segments[-1]
        return segment.size - start[1] if segment.base_offset == start[0] else None

    def in_an_older_segment(self, offset: int, than: int) -> bool:
        """Whether `offset` lies in an older segment than `than` does: a read at `offset`
        stops at its segment's end, short of `than`."""
        return self._floor(offset) < self._floor(than)

    # -- appends -------------------------------------------------------------------------

    @reports_io_failures
    def append_as_leader(self, batches: bytearray, leader_epoch: int) -> AppendInfo:
        """Append validated batches, assigning offsets from the LEO: each batch's base offset
        and partition leader epoch are patched in place (outside the CRC)."""
        self.take_in_pending_write()
        return self._append(batches, self._assign_offsets(batches, leader_epoch))

    @reports_io_failures
    async def append_batch_off_loop(
        self, batch: bytearray, leader_epoch: int, on_appended: Callable[[AppendInfo], None]
    ) -> AppendInfo:
        """append_as_leader for one batch, with the file write of a large one on a worker
        thread: copying a MiB into the OS page cache is the largest cost of a produce, and the
        event loop serves other requests meanwhile. A batch under OFF_LOOP_WRITE_BYTES is
        written inline, without yielding: the hop to a thread and back (about 0.1 ms) costs
        more than its write. The log itself changes only on the loop, when the write is done:
        the LEO moves, the batch is indexed, then `on_appended` runs, before any other change
        to the log (which waits for the write). Callers append one batch at a time per log,
        and hand `batch` over: reads of the log's last batch are served from it."""
        self.take_in_pending_write()
        (header,) = headers = self._assign_offsets(batch, leader_epoch)
        now = self._time_ms()
        self._assign_epochs(headers)
        segment = _aged_from_its_first_batch(self._segments[-1], now)
        if self._should_roll(segment, 0, header, now):
            segment = self._roll(header.base_offset, now)
        config = self.config
        if len(batch) < OFF_LOOP_WRITE_BYTES:
            segment.append(
                batch, headers, config.index_interval_bytes, config.cache_drop_behind_bytes
            )
            segment.keep_appended_batch(batch)
            info = self._appended(headers, header.size)
            on_appended(info)
            return info
        return await self._write_off_loop(_WRITERS, segment, batch, headers, batch, on_appended)

    @reports_io_failures
    async def append_as_follower_off_loop(
        self, batches: bytes | bytearray | memoryview, on_appended: Callable[[AppendInfo], None]
    ) -> AppendInfo:
        """append_as_follower, with the file write of large data on a worker thread, as for a
        produce: on a busy disk a write can wait 100 ms and more for the file's inode lock
        while writeback allocates its blocks, and the event loop goes on serving the
        partitions this broker leads. `on_appended` runs as the data enters the log, before
        any other change to it. Data that rolls a segment is written inline (once a segment)."""
        self.take_in_pending_write()
        headers = self._check_follower_batches(batches)
        view = memoryview(batches)
        now = self._time_ms()
        segment = _aged_from_its_first_batch(self._segments[-1], now)
        if len(view) < OFF_LOOP_WRITE_BYTES or self._rolls(segment, headers, now):
            info = self._append(view, headers)
            on_appended(info)
            return info
        self._assign_epochs(headers)
        return await self._write_off_loop(
            _FOLLOWER_WRITERS, segment, view, headers, None, on_appended
        )

    def _rolls(self, segment: LogSegment, headers: Sequence[BatchHeader], now_ms: int) -> bool:
        """Whether appending these batches would roll `segment` before any of them."""
        pending = 0
        for header in headers:
            if self._should_roll(segment, pending, header, now_ms):
                return True
            pending += header.size
        return False

    async def _write_off_loop(
        self,
        writers: ThreadPoolExecutor,
        segment: LogSegment,
        data: bytes | bytearray | memoryview,
        headers: Sequence[BatchHeader],
        kept: bytearray | None,
        on_appended: Callable[[AppendInfo], None],
    ) -> AppendInfo:
        """Write whole batches at the end of `segment` on a worker thread; the log takes them
        in on the loop (take_in_pending_write), and the caller resumes after on_appended."""
        loop = asyncio.get_running_loop()
        write = writers.submit(segment.write, data, self.config.cache_drop_behind_bytes)
        pending = _PendingWrite(
            segment, headers, len(data), kept, write, loop.create_future(), on_appended
        )
        self._pending_write = pending
        write.add_done_callback(lambda _: loop.call_soon_threadsafe(self._take_in_write, pending))
        return await asyncio.shield(pending.appended)

    def when_written(self, callback: Callable[[], object]) -> None:
        """Call `callback` once the write under way is in the log, or now if none is: an
        appender cancelled while its batch was written (its client went) has it land all the
        same."""
        pending = self._pending_write
        if pending is None:
            callback()
            return

        def written(appended: asyncio.Future[AppendInfo]) -> None:
            if not appended.cancelled() and appended.exception() is None:
                callback()

        pending.appended.add_done_callback(written)

    async def wait_written(self) -> None:
        """Until the write under way (if any) is in the log, whether or not this task is
        cancelled meanwhile: its caller holds what must not be let go before (the caller
        raises its cancellation after)."""
        pending = self._pending_write
        if pending is None:
            return
        while not pending.appended.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([pending.appended])

    def _take_in_write(self, pending: _PendingWrite) -> None:
        if self._pending_write is pending:
            self.take_in_pending_write()

    def take_in_pending_write(self) -> None:
        """Take in the batch a worker thread is writing, waiting for the write if need be:
        every other change to the log must see it, and so must a change of the partition's
        role (a new leader epoch starts at the LEO)."""
        pending, self._pending_write = self._pending_write, None
        if pending is None:
            return
        try:
            pending.write.result()
            # Writes the batches' index entries (and flush.messages may flush): the disk may
            # refuse those too.
            pending.segment.take_in(pending.headers, self.config.index_interval_bytes)
            info = self._appended(pending.headers, pending.size)
        except (StorageError, OSError) as e:
            # Reported first, before anything else writes to the disk; and here, since this
            # may run as a loop callback, and the appender may have gone (cancelled).
            failure = e if self.dir_failures is None else self.dir_failures.raised(self.log_dir, e)
            if not isinstance(failure, StorageError):
                failure = StorageError(f"{self.name}: write failed: {e}")
            pending.appended.set_exception(failure)
            # The epochs of the batches not written must not stay in the history.
            self.leader_epoch_cache.truncate_from_end(self.log_end_offset)
            return
        if pending.kept is not None:
            pending.segment.keep_appended_batch(pending.kept)
        # The appender resumes only after on_appended, which may not leave it waiting.
        pending.appended.set_result(info)
        pending.on_appended(info)

    def _assign_offsets(self, batches: bytearray, leader_epoch: int) -> list[BatchHeader]:
        """Patch each batch's base offset, counting from the LEO, and the leader epoch."""
        headers = _split_batches(batches)
        for header in headers:
            if header.size > self.config.segment_bytes:
                raise MessageTooLarge(
                    f"{self.name}: a {header.size}-byte batch cannot fit in a segment of "
                    f"segment.bytes={self.config.segment_bytes}"
                )
        offset = self.log_end_offset
        position = 0
        assigned = []
        for header in headers:
            patch_base_offset_and_epoch(batches, position, offset, leader_epoch)
            header = header._replace(base_offset=offset, partition_leader_epoch=leader_epoch)
            assigned.append(header)
            offset = header.next_offset
            position += header.size
        return assigned

    @reports_io_failures
    def append_as_follower(self, batches: bytes | bytearray | memoryview) -> AppendInfo:
        """Append batches copied from the leader, offsets already assigned: the first must
        start at our LEO and each must start after the previous one ends."""
        self.take_in_pending_write()
        return self._append(memoryview(batches), self._check_follower_batches(batches))

    def _check_follower_batches(self, batches: bytes | bytearray | memoryview) -> list[BatchHeader]:
        """The headers of a follower's batches, which must continue this log intact."""
        headers = _split_batches(batches)
        view = memoryview(batches)
        expected = self.log_end_offset
        if headers[0].base_offset != expected:
            raise UnexpectedAppendOffset(
                f"{self.name}: follower append starts at offset {headers[0].base_offset}, "
                f"but the log end offset is {expected}"
            )
        position = 0
        for header in headers:
            if header.base_offset < expected:
                raise UnexpectedAppendOffset(
                    f"{self.name}: batch at offset {header.base_offset} overlaps the previous "
                    f"one, which ends before {expected}"
                )
            if not crc_matches(view[position : position + header.size], header):
                raise CorruptMessage(
                    f"{self.name}: CRC mismatch in the batch at offset {header.base_offset}"
                )
            expected = header.next_offset
            position += header.size
        return headers

    def _append(
        self, data: bytes | bytearray | memoryview, headers: Sequence[BatchHeader]
    ) -> AppendInfo:
        now = self._time_ms()
        self._assign_epochs(headers)
        view = memoryview(data)
        interval = self.config.index_interval_bytes
        drop_behind = self.config.cache_drop_behind_bytes
        segment = _aged_from_its_first_batch(self._segments[-1], now)
        group: list[BatchHeader] = []
        group_start = position = 0
        for header in headers:
            if self._should_roll(segment, position - group_start, header, now):
                if group:
                    segment.append(view[group_start:position], group, interval, drop_behind)
                segment = self._roll(header.base_offset, now)
                group = []
                group_start = position
            group.append(header)
            position += header.size
        segment.append(view[group_start:position], group, interval, drop_behind)
        return self._appended(headers, position)

    def _assign_epochs(self, headers: Sequence[BatchHeader]) -> None:
        cache = self.leader_epoch_cache
        for header in headers:
            if header.partition_leader_epoch > cache.latest_epoch:
                cache.assign(header.partition_leader_epoch, header.base_offset)

    def _appended(self, headers: Sequence[BatchHeader], size_bytes: int) -> AppendInfo:
        """What an append added, once in the log; flush.messages may flush it."""
        top = headers[0] if len(headers) == 1 else max(headers, key=lambda h: h.max_timestamp)
        info = AppendInfo(
            first_offset=headers[0].base_offset,
            last_offset=headers[-1].last_offset,
            max_timestamp=top.max_timestamp,
            offset_of_max_timestamp=top.last_offset,
            size_bytes=size_bytes,
        )
        unflushed = self.log_end_offset - self.recovery_point
        if self.config.flush_messages is not None and unflushed >= self.config.flush_messages:
            self.flush()
        return info

    def _should_roll(
        self, segment: LogSegment, pending_bytes: int, header: BatchHeader, now_ms: int
    ) -> bool:
        """Kafka's shouldRoll, checked before each batch; an empty segment never rolls."""
        size = segment.size + pending_bytes
        if size == 0:
            return False
        config = self.config
        return (
            size + header.size > config.segment_bytes
            or now_ms - segment.created_ms > config.segment_ms
            or segment.indexes_full(config.segment_index_bytes)
            or header.last_offset - segment.base_offset > INT32_MAX
        )

    def _roll(self, base_offset: int, now_ms: int) -> LogSegment:
        self._segments[-1].deactivate()
        segment = LogSegment.create(self.dir, base_offset, now_ms)
        self._segments.append(segment)
        self._bases.append(base_offset)
        self._unsynced_dirs.add(self.dir)
        # The finished segment will not change again: make it durable (Kafka's flush on
        # roll), which also moves the recovery point to the new segment. While its fsync
        # waits in the background, nothing fsyncs a later segment before it: flush() and
        # flush_job() start at the recovery point's segment, which the job has not moved yet
        # (nor marked flushed); truncate_to fsyncs the segments before the truncated one
        # first; truncate_fully_and_start_at deletes them all; retention and
        # advance_log_start only delete the oldest segments. The OS may still write a later
        # segment's pages back first: a crash then leaves a gap, which loading cuts off.
        if self.flush_in_background is None:
            self.flush(base_offset)
        elif (job := self.flush_job(base_offset)) is not None:
            self.flush_in_background(self, job)
        log.debug("%s: rolled a new segment at offset %d", self.name, base_offset)
        return segment

    # -- reads ---------------------------------------------------------------------------

    @reports_io_failures
    def read(
        self,
        offset: int,
        max_bytes: int,
        max_offset: int | None = None,
        min_one_batch: bool = True,
    ) -> bytes | memoryview:
        """Whole batches from the one holding `offset`, up to max_bytes but at least one batch
        (unless min_one_batch is off: Kafka lets only a response's first data exceed the
        limit), none whose base offset is >= max_offset (consumers pass the HW). Empty at the
        LEO; OffsetOutOfRange outside [log start offset, LEO]. Reads one segment at most."""
        start, end = self.log_start_offset, self.log_end_offset
        if not start <= offset <= end:
            raise OffsetOutOfRange(
                f"{self.name}: offset {offset} is outside the log's range [{start}, {end}]"
            )
        if offset == end or (max_offset is not None and offset >= max_offset):
            return b""
        for i in range(self._floor(offset), len(self._segments)):
            segment = self._segments[i]
            found = segment.find_batch(offset)
            if found is not None:
                position, first = found
                if max_offset is not None and first.base_offset >= max_offset:
                    return b""
                return segment.read(position, first, max_bytes, max_offset, min_one_batch)
        return b""

    @reports_io_failures
    def fetch_offset_by_timestamp(self, target_ms: int) -> tuple[int, int] | None:
        """(offset, timestamp) of the first record at or after the log start offset whose
        timestamp is >= target_ms."""
        for segment in self._segments:
            if segment.max_timestamp >= target_ms:
                found = segment.find_offset_by_timestamp(target_ms, self._log_start_offset)
                if found is not None:
                    return found
        return None

    # -- truncation ----------------------------------------------------------------------

    @reports_io_failures
    def truncate_to(self, offset: int) -> None:
        """Drop every record at or after `offset` (a follower whose log diverged). Batches
        are whole: the LEO becomes the start of the batch holding `offset`."""
        self.take_in_pending_write()
        if offset < 0:
            raise ValueError(f"cannot truncate to negative offset {offset}")
        if offset >= self.log_end_offset:
            # The history may still name an epoch past our records: this replica led it and
            # wrote nothing before it followed again. Left there, every fetch would name it
            # and diverge again (Kafka's Log.truncateTo).
            self.leader_epoch_cache.truncate_from_end(self.log_end_offset)
            return
        if offset < self.log_start_offset:
            self.truncate_fully_and_start_at(offset)
            return
        self._generation += 1
        # The log below the new end is durable before the truncation is, and before the
        # checkpoint of a lowered recovery point (_after_truncation).
        _flush_in_order(self._segments, self.recovery_point, self._floor(offset))
        # Newest first, so that a crash midway leaves a shorter but whole log.
        while self._bases[-1] > offset:
            self._bases.pop()
            self._segments.pop().delete()
            self._unsynced_dirs.add(self.dir)
        truncated = self._segments[-1].truncate_to(
            offset, self.config.index_interval_bytes, self._time_ms()
        )
        # Batches are whole: the log may now end before a log start inside the last batch.
        log_start_lowered = self.log_end_offset < self._log_start_offset
        self._log_start_offset = min(self._log_start_offset, self.log_end_offset)
        # On disk before anything is appended again: records a crash brought back past the
        # new end would go on in the log, another leader's, if the appends after them did
        # not reach the disk, and recovery would find their CRCs good.
        self._segments[-1].flush()
        self._sync_dirs()
        self.leader_epoch_cache.truncate_from_end(self.log_end_offset)
        self._after_truncation(
            min(self.recovery_point, self.log_end_offset), log_start_lowered=log_start_lowered
        )
        log.info(
            "%s: truncated to offset %d (%d bytes of the last segment)",
            self.name,
            self.log_end_offset,
            truncated,
        )

    @reports_io_failures
    def truncate_fully_and_start_at(self, offset: int) -> None:
        """Delete every segment and start empty at `offset`: log start = LEO = offset."""
        self._generation += 1
        self.take_in_pending_write()
        for segment in reversed(self._segments):
            segment.delete()
        self._segments = [LogSegment.create(self.dir, offset, self._time_ms())]
        self._bases = [offset]
        log_start_lowered = offset < self._log_start_offset
        self._log_start_offset = offset
        # Now, not at the next flush: old segments must not come back after a crash.
        fsync_dir(self.dir)
        self.leader_epoch_cache.clear_and_flush()
        self._after_truncation(offset, log_start_lowered=log_start_lowered)
        log.info("%s: deleted every segment, starting again at offset %d", self.name, offset)

    def _after_truncation(self, recovery_point: int, *, log_start_lowered: bool) -> None:
        """Set the recovery point; a lowered one, or a lowered log start offset, is
        checkpointed at once: after a crash, the older one checkpointed would have the next
        start trust bytes appended since unchecked, or hide records below it."""
        lowered = recovery_point < self.recovery_point or log_start_lowered
        self.recovery_point = recovery_point
        if lowered and self.offsets_lowered is not None:
            self.offsets_lowered(self)

    # -- retention -----------------------------------------------------------------------

    @reports_io_failures
    def delete_retention_segments(self, now_ms: int, high_watermark: int) -> int:
        """Delete the oldest segments that retention.ms or retention.bytes let go, among those
        the HW has passed (Kafka's deletableSegments: the next segment's base offset is at or
        below the HW, or for the active one the LEO), so that no record goes before every ISR
        member has it, and the log start never passes the HW. The log start offset moves to
        the first kept segment (if it was not past it already). Returns how many segments
        went. The active segment goes too once the HW covers it, after an empty one is rolled
        at the LEO, as Kafka's deleteSegments does (review 21 #3: an idle partition kept its
        last segment, up to segment.bytes, for ever)."""
        self.take_in_pending_write()
        everything = high_watermark >= self.log_end_offset and self._segments[-1].size > 0
        candidates = (
            self._segments[:]
            if everything
            else self._segments[: self._wholly_before(high_watermark)]
        )
        deletable = 0
        retention_ms = self.config.retention_ms
        if retention_ms >= 0:
            while (
                deletable < len(candidates)
                and now_ms - candidates[deletable].largest_timestamp > retention_ms
            ):
                deletable += 1
        retention_bytes = self.config.retention_bytes
        if retention_bytes >= 0:
            excess = sum(s.size for s in self._segments[deletable:]) - retention_bytes
            while deletable < len(candidates) and excess >= candidates[deletable].size:
                excess -= candidates[deletable].size
                deletable += 1
        if deletable == len(self._segments):
            self._roll(self.log_end_offset, now_ms)
        self._delete_oldest_segments(deletable, "retention")
        return deletable

    @reports_io_failures
    def advance_log_start(self, offset: int) -> None:
        """Move the log start offset up to `offset` (at most the LEO), which may fall inside a
        segment, and delete the segments wholly before it (never the active one): a
        follower's log starts where its leader's does (Kafka's maybeIncrementLogStartOffset,
        then deleteLogStartOffsetBreachedSegments)."""
        self.take_in_pending_write()
        if offset > self.log_end_offset:
            raise ValueError(
                f"{self.name}: cannot start the log at {offset}, past its end {self.log_end_offset}"
            )
        if offset <= self._log_start_offset:
            return
        self._log_start_offset = offset
        self.leader_epoch_cache.truncate_from_start(offset)
        self._delete_oldest_segments(
            self._wholly_before(offset), f"the leader's log start offset {offset}"
        )

    def log_start_checkpointed(self, offset: int) -> None:
        """The LogManager's log-start-offset-checkpoint holds `offset` for this log now (at
        most the log start): the leader epoch checkpoint may let go of the epochs before it.
        Kafka trims that file as the log start moves, while its own checkpoint waits for the
        next period: a crash in between brings the records below back with no epoch."""
        self.leader_epoch_cache.log_start_checkpointed(offset)

    def _wholly_before(self, offset: int) -> int:
        """How many segments end at or before `offset` (all but the one holding it)."""
        return max(bisect.bisect_right(self._bases, offset) - 1, 0)

    def _delete_oldest_segments(self, count: int, why: str) -> None:
        if not count:
            return
        # Oldest first: a crash midway leaves a log that merely starts later.
        for segment in self._segments[:count]:
            segment.delete()
        del self._segments[:count]
        del self._bases[:count]
        self._unsynced_dirs.add(self.dir)
        first_base = self._bases[0]
        # Over the deleted segments only, not up to a log start inside a segment: the bytes
        # below it there may not be on disk yet, and recovery must still check them.
        self.recovery_point = max(self.recovery_point, first_base)
        self._log_start_offset = max(self._log_start_offset, first_base)
        self.leader_epoch_cache.truncate_from_start(self._log_start_offset)
        log.info(
            "%s: %s deleted %d segments; the log now starts at offset %d",
            self.name,
            why,
            count,
            self.log_start_offset,
        )

    # -- durability ----------------------------------------------------------------------

    @reports_io_failures
    def flush(self, offset: int | None = None) -> None:
        """fsync everything below `offset` (default: the LEO) and move the recovery point."""
        target = self.log_end_offset if offset is None else min(offset, self.log_end_offset)
        if target <= self.recovery_point:
            return
        for i in range(self._floor(self.recovery_point), len(self._segments)):
            segment = self._segments[i]
            if segment.base_offset >= target:
                break
            segment.flush()
        self._sync_dirs()
        self.recovery_point = target
        self._last_flush_ms = self._time_ms()

    def _sync_dirs(self) -> None:
        for directory in self._unsynced_dirs:
            fsync_dir(directory)
        self._unsynced_dirs.clear()

    def flush_job(self, offset: int) -> FlushJob | None:
        """flush(offset) as a job for another thread; finish_flush() applies its outcome."""
        target = min(offset, self.log_end_offset)
        if target <= self.recovery_point:
            return None
        job = FlushJob(target, self._generation, [], [], sorted(self._unsynced_dirs))
        for i in range(self._floor(self.recovery_point), len(self._segments)):
            segment = self._segments[i]
            if segment.base_offset >= target:
                break
            fds, paths = segment.unflushed_files()
            job.fds += fds
            job.paths += paths
        return job

    @reports_io_failures
    async def write_out(self) -> None:
        """flush() on a worker thread: a truncation fsyncs the log below its new end on the
        event loop (see truncate_to), and after this it finds nothing left to write. Without
        it, a follower that diverged with a segment's worth of unflushed data held every
        partition up for that segment's writeback."""
        self.take_in_pending_write()
        job = self.flush_job(self.log_end_offset)
        if job is not None:
            await asyncio.to_thread(job.run)  # which closes the job's descriptors
            self.finish_flush(job)

    @reports_io_failures
    def sync_files(self, paths: Sequence[Path]) -> None:
        """fsync files written into the log's directory without it (and the directory): in
        the background after any rolled segment's flush when a log manager runs the log,
        else now. Moves no recovery point."""
        job = FlushJob(None, self._generation, [], list(paths), [self.dir])
        if self.flush_in_background is None:
            job.run()
        else:
            self.flush_in_background(self, job)

    def finish_flush(self, job: FlushJob) -> None:
        """A flush job ran: move the recovery point, unless the log changed under it."""
        if (
            job.offset is None
            or job.generation != self._generation
            or job.offset <= self.recovery_point
        ):
            return
        for i in range(self._floor(self.recovery_point), len(self._segments)):
            segment = self._segments[i]
            if segment.base_offset >= job.offset:
                break
            segment.mark_flushed()
        self.recovery_point = job.offset
        self._last_flush_ms = self._time_ms()

    def flush_if_due(self, now_ms: int) -> None:
        """flush.ms: flush when unflushed data has waited that long since the last flush."""
        flush_ms = self.config.flush_ms
        if (
            flush_ms is not None
            and now_ms - self._last_flush_ms >= flush_ms
            and self.log_end_offset > self.recovery_point
        ):
            self.flush()

    @reports_io_failures
    def close(self) -> None:
        """Flush, then close every file."""
        self.take_in_pending_write()
        self.flush()
        self._generation += 1
        for segment in self._segments:
            segment.close()

    @reports_io_failures
    def rename_for_deletion(self) -> Path:
        """Close the log and rename its directory `<topic>-<partition>.<id>-delete`, which the
        next start removes rather than load a half-deleted log; the caller removes it."""
        return self._close_and_rename(DELETE_DIR_SUFFIX)

    @reports_io_failures
    def rename_stray(self, orphaned: bool = False) -> Path:
        """Close the log and rename its directory `<topic>-<partition>.<id>-stray` (or
        `-orphaned`), which no start loads. Returns the new path."""
        return self._close_and_rename(ORPHANED_DIR_SUFFIX if orphaned else STRAY_DIR_SUFFIX)

    def _close_and_rename(self, suffix: str) -> Path:
        """Close every file, unflushed (the log is going), and rename the directory out of
        the way, to a name no partition directory has."""
        self.take_in_pending_write()
        for segment in self._segments:
            segment.close()
        self._generation += 1
        renamed = self.dir.with_name(f"{self.dir.name}.{uuid.uuid4().hex}{suffix}")
        os.rename(self.dir, renamed)
        fsync_dir(self.dir.parent)
        return renamed


@dataclass
class FlushJob:
    """The fsyncs that make a log durable below `offset` (None: files that move no recovery
    point, see Log.sync_files), runnable in a worker thread: it holds its own descriptors of
    the segment files, and other files (`paths`) or directories deleted meanwhile need no
    fsync. `generation` tells the log whether it still applies."""

    offset: int | None
    generation: int
    fds: list[int]
    paths: list[Path]
    dirs: list[Path]

    def run(self) -> None:
        try:
            for fd in self.fds:
                os.fsync(fd)
            for path in self.paths:
                with contextlib.suppress(FileNotFoundError):
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            for directory in self.dirs:
                with contextlib.suppress(FileNotFoundError):
                    fsync_dir(directory)
        finally:
            self.close()

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _aged_from_its_first_batch(segment: LogSegment, now_ms: int) -> LogSegment:
    """`segment`, whose segment.ms clock starts now if it is empty (Kafka's
    rollingBasedTimestamp: from its first batch; review 21 #4: an empty segment left idle past
    segment.ms rolled right after its first batch)."""
    if segment.size == 0:
        segment.created_ms = now_ms
    return segment


def _flush_in_order(segments: Sequence[LogSegment], recovery_point: int, end: int) -> None:
    """fsync segments[:end] in order, from the one holding `recovery_point` (those before it
    are on disk): what a truncation does first, before it fsyncs the truncated segment. A
    rolled segment's fsync may still wait in the background (Log._roll), or the process
    that wrote it was killed, and the truncated segment would otherwise reach the disk
    before the earlier one's end: a machine crash then left a hole in the offsets with
    records after it, which the next load cuts off with them (review 13)."""
    first = max(bisect.bisect_right(segments, recovery_point, key=lambda s: s.base_offset) - 1, 0)
    for segment in segments[first:end]:
        segment.flush()


def _split_batches(buf: bytes | bytearray | memoryview) -> list[BatchHeader]:
    """Headers of the whole batches that make up `buf`; CorruptMessage if there is none or a
    batch is malformed or cut short."""
    headers = []
    position = 0
    while position < len(buf):
        header = read_header(buf, position)
        if header.magic != MAGIC or header.batch_length < HEADER_SIZE - LOG_OVERHEAD:
            raise CorruptMessage(
                f"malformed batch at byte {position}: magic {header.magic}, "
                f"batch_length {header.batch_length}"
            )
        if position + header.size > len(buf):
            raise CorruptMessage(
                f"the batch at byte {position} needs {header.size} bytes, "
                f"{len(buf) - position} remain"
            )
        headers.append(header)
        position += header.size
    if not headers:
        raise CorruptMessage("no record batch to append")
    return headers


def _load_segments(
    directory: Path, config: LogConfig, recovery_point: int, log_start_offset: int, now_ms: int
) -> list[LogSegment]:
    """The segments of `directory`, loaded or recovered, up to the first one that ends early:
    its torn or corrupt tail truncated, or ending before the next segment's base offset (a
    crash kept a later segment's records and lost this one's end at a batch boundary; the
    offsets of a log are contiguous, without compaction). The segments after it are deleted,
    unless it lies wholly before the log start offset (checkpointed): its end then does not
    matter, and the log drops it (Log.__init__)."""
    bases = _segment_bases(directory)
    segments: list[LogSegment] = []
    interval = config.index_interval_bytes
    try:
        for i, base in enumerate(bases):
            segments.append(LogSegment.open(directory, base, now_ms))
            segment = segments[-1]
            next_base = bases[i + 1] if i + 1 < len(bases) else None
            unflushed = next_base is None or next_base > recovery_point
            truncated = _load_segment(segment, interval, recovery_point if unflushed else None)
            if truncated:
                # On disk before the log takes appends, as truncate_to does: a crash could
                # otherwise bring back the dropped tail and later segments, CRCs good, around
                # records appended since. The segments before it first, as there.
                _flush_in_order(segments, recovery_point, i + 1)
            if next_base is not None and segment.next_offset > next_base:
                raise StorageError(
                    f"{segment.log_path} holds offsets up to {segment.next_offset - 1}, past "
                    f"the next segment's base offset {next_base}"
                )
            if next_base is None or next_base <= log_start_offset:
                continue  # the last segment, or one the log drops
            if truncated:
                log.warning(
                    "%s: deleting the %d segments after the truncated %s",
                    directory.name,
                    len(bases) - i - 1,
                    segment.log_path.name,
                )
            elif segment.next_offset < next_base:
                # Loud: acknowledged records may be gone. Not fsynced yet, this segment's end
                # was lost while the OS had written the next one's pages back.
                log.error(
                    "%s: offsets %d to %d are missing, %s ends before %s starts: deleting "
                    "the %d segments from offset %d on",
                    directory.name,
                    segment.next_offset,
                    next_base - 1,
                    segment.log_path.name,
                    segment_file_name(next_base, LOG_SUFFIX),
                    len(bases) - i - 1,
                    next_base,
                )
            else:
                continue
            for later in bases[i + 1 :]:
                LogSegment.open(directory, later, now_ms).delete()
            fsync_dir(directory)
            break
    except BaseException:
        for loaded in segments:
            loaded.close()
        raise
    return segments


def _load_segment(segment: LogSegment, interval: int, recover_from: int | None) -> int:
    """Load or recover one segment; return the bytes recovery truncated."""
    if not segment.indexes_exist:
        log.warning("%s: index files missing, rebuilding them", segment.log_path)
        return segment.recover(interval)
    if recover_from is not None:
        return segment.recover(interval, recover_from)
    try:
        segment.load(interval)
    except CorruptIndex as e:
        log.warning("%s; recovering the segment", e)
        return segment.recover(interval)
    return 0


def _segment_bases(directory: Path) -> list[int]:
    """Base offsets of the segments in `directory`, after removing stray and orphan files."""
    logs: set[int] = set()
    indexes: list[tuple[int, Path]] = []
    for entry in os.scandir(directory):
        path = Path(entry.path)
        if entry.name.endswith(_STRAY_SUFFIXES):
            log.info("%s: removing stray file", path)
            path.unlink()
            continue
        match = _SEGMENT_FILE.fullmatch(entry.name)
        if match is None:
            continue
        base = int(match[1])
        if match[2] == LOG_SUFFIX:
            logs.add(base)
        elif match[2] in (INDEX_SUFFIX, TIME_INDEX_SUFFIX):
            indexes.append((base, path))
    for base, path in indexes:
        if base not in logs:
            log.info("%s: removing index without a segment", path)
            path.unlink()
    return sorted(logs)
