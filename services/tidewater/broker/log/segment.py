"""One segment of a partition log: `<base>.log`, a file of whole record batches, and its indexes.

The segment reads only batch headers. Its `.log` file stays open for the segment's life and is
read with os.pread, so reads need no seek and no lock. Loading or recovering a segment walks
its batches once and re-derives what Kafka keeps in memory: the next offset, the largest
timestamp (and where it was reached), and the bytes since the last index entry.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tidewater.broker.log.index import CorruptIndex, OffsetIndex, TimeIndex
from tidewater.errors import StorageError
from tidewater.records.header import (
    HEADER_SIZE,
    LOG_OVERHEAD,
    MAGIC,
    NO_TIMESTAMP,
    BatchHeader,
    crc_matches,
    read_header,
    read_offset_and_length,
)

log = logging.getLogger(__name__)

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
TIME_INDEX_SUFFIX = ".timeindex"
INT32_MAX = 2**31 - 1
_TRUST_ALL = 2**63  # above any offset: verify no CRC
_HEADER_READAHEAD = 16 * 1024
_BATCH_READAHEAD = 4 * 1024 * 1024
# The largest last batch a segment keeps a copy of for reads (see _last_batch_data): at most
# this much per partition being written.
KEPT_BATCH_BYTES = 16 * 1024
# What the larger last batches a leader keeps (without a copy, see keep_appended_batch) may
# hold in memory together, in a process: beyond it the longest kept goes.
KEPT_LARGE_BATCHES_BYTES = 32 * 1024 * 1024
# Drop-behind asks the OS once per this many bytes written: one syscall per several MiB.
_DROP_STEP = 4 * 1024 * 1024
# DONTNEED starts writeback of the dirty pages it covers and may wait for the disk's queue
# (p99 6 ms, max 12 ms per 4 MiB here): never on an event loop, one call at a time.
_DROPPER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="log-drop-behind")


def segment_file_name(base_offset: int, suffix: str) -> str:
    return f"{base_offset:020d}{suffix}"


class InvalidBatch(Exception):
    """A batch in a segment file that cannot be kept: the valid data ends at `position`."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(f"invalid batch at position {position}: {reason}")
        self.position = position


class _FileWindow:
    """Reads a file through one cached buffer, so a walk over small batches costs few syscalls."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self._size = size
        self._start = 0
        self._buf = b""

    def view(self, position: int, length: int, readahead: int) -> memoryview | None:
        """`length` bytes at `position`, or None if the file ends first."""
        offset = position - self._start
        if offset < 0 or offset + length > len(self._buf):
            want = min(max(length, readahead), self._size - position)
            if want < length:
                return None
            self._buf = os.pread(self._fd, want, position)
            self._start, offset = position, 0
            if len(self._buf) < length:
                return None
        return memoryview(self._buf)[offset : offset + length]


class LogSegment:
    def __init__(self, directory: Path, base_offset: int, fd: int, created_ms: int) -> None:
        self.base_offset = base_offset
        self.log_path = directory / segment_file_name(base_offset, LOG_SUFFIX)
        self.offset_index = OffsetIndex(
            directory / segment_file_name(base_offset, INDEX_SUFFIX), base_offset
        )
        self.time_index = TimeIndex(
            directory / segment_file_name(base_offset, TIME_INDEX_SUFFIX), base_offset
        )
        # segment.ms counts from here.
        self.created_ms = created_ms
        self._fd = fd
        self._size = os.fstat(fd).st_size
        self._dirty = False
        self._next_offset = base_offset
        self._max_timestamp = NO_TIMESTAMP
        self._offset_of_max_timestamp = base_offset
        self._bytes_since_last_index_entry = 0
        # Drop-behind: pages before _dropped_to were let go; those from _drop_from on may
        # still have been dirty then, so the next call asks again.
        self._drop_from = 0
        self._dropped_to = 0
        # (position, header) of the last batch: reads at the end of the log (followers and
        # consumers keeping up) find it without a walk from an index entry.
        self._last_batch: tuple[int, BatchHeader] | None = None
        # Its bytes when it was appended alone, a copy of one of at most KEPT_BATCH_BYTES or a
        # larger one a leader handed over: a read of it then needs no pread (a leader reads
        # each new batch once per follower).
        self._last_batch_data: bytes | memoryview | None = None

    @classmethod
    def create(cls, directory: Path, base_offset: int, now_ms: int) -> LogSegment:
        """A new, empty segment (replacing any files of the same name)."""
        path = directory / segment_file_name(base_offset, LOG_SUFFIX)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        segment = cls(directory, base_offset, fd, now_ms)
        segment.offset_index.reset()
        segment.time_index.reset()
        segment._dirty = True
        return segment

    @classmethod
    def open(cls, directory: Path, base_offset: int, now_ms: int) -> LogSegment:
        """An existing segment; call load() or recover() before using it."""
        path = directory / segment_file_name(base_offset, LOG_SUFFIX)
        return cls(directory, base_offset, os.open(path, os.O_RDWR), now_ms)

    # -- state ---------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self._size

    @property
    def next_offset(self) -> int:
        """The offset after the segment's last batch (its base offset when empty)."""
        return self._next_offset

    @property
    def max_timestamp(self) -> int:
        """The largest batch max_timestamp in the segment, NO_TIMESTAMP if none."""
        return self._max_timestamp

    @property
    def largest_timestamp(self) -> int:
        """What retention.ms compares: the largest timestamp, or the file's mtime without one."""
        if self._max_timestamp != NO_TIMESTAMP:
            return self._max_timestamp
        return os.fstat(self._fd).st_mtime_ns // 1_000_000

    @property
    def indexes_exist(self) -> bool:
        return self.offset_index.path.exists() and self.time_index.path.exists()

    def indexes_full(self, max_index_bytes: int) -> bool:
        return self.offset_index.is_full(max_index_bytes) or self.time_index.is_full(
            max_index_bytes
        )

    # -- writes --------------------------------------------------------------------------

    def append(
        self,
        data: bytes | bytearray | memoryview,
        headers: Sequence[BatchHeader],
        index_interval_bytes: int,
        drop_behind_bytes: int = -1,
    ) -> None:
        """Append whole batches (`headers` describe `data`, in order) and index them."""
        self.write(data, drop_behind_bytes)
        self.take_in(headers, index_interval_bytes)
        if len(headers) == 1 and len(data) <= KEPT_BATCH_BYTES:
            self._last_batch_data = bytes(data)

    def keep_appended_batch(self, batch: bytearray) -> None:
        """Serve reads of the batch just appended alone (the segment's last) from `batch`
        itself, which its appender hands over and never changes again, if it is larger than
        the copies append() keeps: a leader reads each new batch once per follower, a pread
        and a copy from the page cache each time. Such batches count towards
        KEPT_LARGE_BATCHES_BYTES."""
        if len(batch) > KEPT_BATCH_BYTES and kept_large_batches.keep(self, len(batch)):
            self._last_batch_data = memoryview(batch).toreadonly()

    def write(self, data: bytes | bytearray | memoryview, drop_behind_bytes: int = -1) -> None:
        """Write whole batches after the end of the segment, which does not count them until
        take_in(). Touches nothing but the file, so a worker thread may run it while nothing
        else changes the segment. With `drop_behind_bytes` >= 0, the OS keeps only about that
        many bytes of the segment's tail in its page cache (cache.drop.behind.bytes)."""
        position = self._size
        view = memoryview(data)
        try:
            while view:
                written = os.pwrite(self._fd, view, position)
                view = view[written:]
                position += written
        except OSError as e:
            # Leave no partial batch behind for the next append to build on (if the disk
            # lets us: the error to report is the write's).
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise StorageError(f"{self.log_path}: write failed: {e}") from e
        if drop_behind_bytes >= 0:
            self._drop_behind(position - drop_behind_bytes)

    def _drop_behind(self, end: int) -> None:
        """Let the page cache forget the file before `end`, in the background. DONTNEED starts
        writeback of dirty pages but drops only clean ones, so each call repeats the previous
        call's range."""
        if end - self._dropped_to < _DROP_STEP:
            return
        # Its own descriptor: the segment may be closed before the call runs.
        _DROPPER.submit(_forget, os.dup(self._fd), self._drop_from, end - self._drop_from)
        self._drop_from, self._dropped_to = self._dropped_to, end

    def take_in(self, headers: Sequence[BatchHeader], index_interval_bytes: int) -> None:
        """Count and index the batches that write() put after the end of the segment."""
        position = self._size
        for header in headers:
            self._track(position, header, index_interval_bytes)
            position += header.size
        self._size = position
        self._dirty = True
        self._write_index_entries(keep_open=True)

    def _track(self, position: int, header: BatchHeader, index_interval_bytes: int) -> None:
        """Kafka's per-batch bookkeeping: at most one index entry per index.interval.bytes."""
        if header.max_timestamp > self._max_timestamp:
            self._max_timestamp = header.max_timestamp
            self._offset_of_max_timestamp = header.last_offset
        if self._bytes_since_last_index_entry > index_interval_bytes:
            self.offset_index.append(header.last_offset, position)
            self.time_index.maybe_append(self._max_timestamp, self._offset_of_max_timestamp)
            self._bytes_since_last_index_entry = 0
        self._bytes_since_last_index_entry += header.size
        self._next_offset = header.next_offset
        self._last_batch = (position, header)
        self.forget_kept_batch()

    def _write_index_entries(self, keep_open: bool = False) -> None:
        self.offset_index.write_pending(keep_open)
        self.time_index.write_pending(keep_open)

    def deactivate(self) -> None:
        """The segment is no longer the active one, or closes: let go of what only the log's
        end needs, the index descriptors appends kept open and the copy of the last batch (a
        log keeps one per partition, not one per segment)."""
        self.offset_index.close()
        self.time_index.close()
        self.forget_kept_batch()

    def forget_kept_batch(self) -> None:
        """Reads of the last batch go to the file again."""
        kept, self._last_batch_data = self._last_batch_data, None
        if type(kept) is memoryview:
            kept_large_batches.release(self)

    def truncate_to(self, offset: int, index_interval_bytes: int, now_ms: int) -> int:
        """Drop the batch holding `offset` and every later one; return the bytes dropped."""
        found = self.find_batch(offset)
        if found is None:
            return 0
        position, header = found
        truncated = self._size - position
        os.ftruncate(self._fd, position)
        self._size = position
        self._drop_from = min(self._drop_from, position)
        self._dropped_to = min(self._dropped_to, position)
        self._dirty = True
        self.offset_index.truncate_to(header.base_offset)
        self.time_index.truncate_to(header.base_offset)
        self._restore_state_from_indexes()
        problem = self._scan(self.offset_index.last_entry.position, index_interval_bytes)
        if problem is not None:
            raise StorageError(f"{self.log_path}: {problem}")
        self._write_index_entries()
        if self._size == 0:
            self.created_ms = now_ms
        return truncated

    def flush(self) -> None:
        """fsync the log and both indexes, if anything changed since the last flush."""
        if self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        self.offset_index.flush()
        self.time_index.flush()

    def unflushed_files(self) -> tuple[list[int], list[Path]]:
        """What flush() would fsync, for a flush in another thread: a duplicate of the log's
        descriptor (its own, so closing the segment meanwhile does no harm) if the log changed,
        and the index files that changed."""
        indexes = (self.offset_index, self.time_index)
        for index in indexes:
            index.write_pending()
        fds = [os.dup(self._fd)] if self._dirty else []
        return fds, [index.path for index in indexes if index.dirty]

    def mark_flushed(self) -> None:
        """Another thread fsynced what unflushed_files() named, and nothing changed since."""
        self._dirty = False
        self.offset_index.dirty = False
        self.time_index.dirty = False

    def close(self) -> None:
        self.deactivate()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def delete(self) -> None:
        """Close and remove the files; the .log goes first, so a crash leaves at most orphan
        indexes, which loading removes."""
        self.close()
        self.log_path.unlink(missing_ok=True)
        self.offset_index.delete()
        self.time_index.delete()

    # -- reads ---------------------------------------------------------------------------

    def find_batch(self, offset: int) -> tuple[int, BatchHeader] | None:
        """(position, header) of the first batch whose last offset is >= `offset`."""
        last = self._last_batch
        if last is not None and last[1].base_offset <= offset <= last[1].last_offset:
            return last
        # With an entry per batch (batches above index.interval.bytes), one header read.
        above = self.offset_index.lookup_at_or_above(offset)
        if above is not None:
            head = os.pread(self._fd, HEADER_SIZE, above.position)
            if len(head) == HEADER_SIZE:
                header = read_header(head)
                if header.base_offset <= offset <= header.last_offset:
                    return above.position, header
        for position, header in self._headers(self.offset_index.lookup(offset).position):
            if header.last_offset >= offset:
                return position, header
        return None

    def read(
        self,
        position: int,
        first: BatchHeader,
        max_bytes: int,
        max_offset: int | None,
        min_one_batch: bool = True,
    ) -> bytes | memoryview:
        """Whole batches from `position`, where batch `first` starts: as many as fit in
        max_bytes, but always `first` when min_one_batch; none whose base offset is >=
        max_offset."""
        if first.size > max_bytes and not min_one_batch:
            return b""
        kept = self._last_batch_data
        if kept is not None and self._last_batch is not None and self._last_batch[0] == position:
            return kept  # the last batch: all there is to read from here
        if first.size >= max_bytes:
            return os.pread(self._fd, first.size, position)
        data = os.pread(self._fd, min(max_bytes, self._size - position), position)
        end = first.size
        while end + LOG_OVERHEAD <= len(data):
            base_offset, batch_length = read_offset_and_length(data, end)
            if max_offset is not None and base_offset >= max_offset:
                break
            if end + LOG_OVERHEAD + batch_length > len(data):
                break
            end += LOG_OVERHEAD + batch_length
        return data if end == len(data) else memoryview(data)[:end]

    def find_offset_by_timestamp(
        self, target_ms: int, starting_offset: int = 0
    ) -> tuple[int, int] | None:
        """(offset, timestamp) of the first record at or after `starting_offset` (the log start
        offset) with a timestamp >= target_ms."""
        # Imported here: the records package builds on the log's neighbours, not the reverse.
        from tidewater.records.validate import find_offset_by_timestamp

        from_offset = max(self.time_index.lookup(target_ms).offset, starting_offset)
        for position, header in self._headers(self.offset_index.lookup(from_offset).position):
            if header.max_timestamp >= target_ms and header.last_offset >= starting_offset:
                found = find_offset_by_timestamp(
                    os.pread(self._fd, header.size, position),
                    target_ms,
                    starting_offset=starting_offset,
                )
                if found is not None:
                    return found
        return None

    # -- loading and recovery ------------------------------------------------------------

    def load(self, index_interval_bytes: int) -> None:
        """Trust the indexes and the data they cover; walk only the batches after the last
        offset index entry. CorruptIndex if anything disagrees (the caller then recovers)."""
        self.offset_index.sanity_check(self._size)
        self._check_last_index_entry()
        self._restore_state_from_indexes()
        problem = self._scan(self.offset_index.last_entry.position, index_interval_bytes)
        if problem is not None:
            raise CorruptIndex(f"{self.log_path}: {problem}; the segment needs recovery")
        self.time_index.sanity_check(self._next_offset - 1)
        self._write_index_entries()
        self._start_age_at_first_batch()

    def recover(self, index_interval_bytes: int, from_offset: int | None = None) -> int:
        """Check batches (header sanity and CRC) and rebuild the indexes for them; truncate
        at the first invalid batch (a torn or corrupt tail) and return the bytes truncated.

        With `from_offset` (the recovery point: everything before it was fsynced) the indexes
        and data below it are trusted if the indexes pass their sanity checks.
        """
        verify_from = self.base_offset
        if (
            from_offset is not None
            and from_offset > self.base_offset
            and self._trim_indexes_to(from_offset)
        ):
            verify_from = from_offset
        else:
            self.offset_index.reset()
            self.time_index.reset()
        self._restore_state_from_indexes()
        start = self.offset_index.last_entry.position
        problem = self._scan(start, index_interval_bytes, verify_from)
        if problem is not None and problem.position <= start and start > 0:
            # The batch at the last trusted index entry is bad: data below the recovery point
            # was lost or damaged after its fsync. Trust none of it and check every batch, as
            # Kafka rescans the segment (review 21 #1: the LEO went back to the base offset
            # over whole batches, and the next append reused their offsets).
            self.offset_index.reset()
            self.time_index.reset()
            self._restore_state_from_indexes()
            problem = self._scan(0, index_interval_bytes, self.base_offset)
        self._write_index_entries()
        truncated = 0
        if problem is not None:
            truncated = self._size - problem.position
            log.warning(
                "%s: %s; truncating the %d bytes from there on", self.log_path, problem, truncated
            )
            os.ftruncate(self._fd, problem.position)
            self._size = problem.position
        # What was checked may be in the page cache only (the process that wrote it was
        # killed): the next flush over it must fsync it.
        self._dirty = True
        self._start_age_at_first_batch()
        return truncated

    def _trim_indexes_to(self, offset: int) -> bool:
        """Keep the index entries below `offset` if the indexes are sound; False if not."""
        if not self.indexes_exist:
            return False
        try:
            self.offset_index.sanity_check(self._size)
            self.time_index.sanity_check(_TRUST_ALL)
            self.offset_index.truncate_to(offset)
            self.time_index.truncate_to(offset)
            self._check_last_index_entry()
        except CorruptIndex as e:
            log.warning("%s; rebuilding it", e)
            return False
        return True

    def _check_last_index_entry(self) -> None:
        """Scans resume at the last offset index entry: it must point at its batch."""
        if not self.offset_index.entries:
            return
        indexed = self.offset_index.last_entry
        head = os.pread(self._fd, HEADER_SIZE, indexed.position)
        if len(head) < HEADER_SIZE or read_header(head).last_offset != indexed.offset:
            raise CorruptIndex(
                f"{self.offset_index.path}: entry {tuple(indexed)} does not match the batch at "
                "that position"
            )

    def _restore_state_from_indexes(self) -> None:
        """The bookkeeping as of the last offset index entry's batch, where scans resume."""
        last = self.time_index.last_entry
        if last is None:
            self._max_timestamp, self._offset_of_max_timestamp = NO_TIMESTAMP, self.base_offset
        else:
            self._max_timestamp, self._offset_of_max_timestamp = last
        self._next_offset = self.base_offset
        self._last_batch = None
        self.forget_kept_batch()
        # Resuming at an indexed batch: it gets no second entry, as during its append.
        self._bytes_since_last_index_entry = 0

    def _scan(
        self, start: int, index_interval_bytes: int, verify_from: int = _TRUST_ALL
    ) -> InvalidBatch | None:
        """Walk the batches from `start` as appends would, CRC-checking those whose last
        offset is >= verify_from. Return the first invalid batch, if any."""
        try:
            for position, header in self._walk(start, verify_from):
                self._track(position, header, index_interval_bytes)
        except InvalidBatch as problem:
            return problem
        return None

    def _start_age_at_first_batch(self) -> None:
        """Kafka's rollingBasedTimestamp: a reloaded segment is as old as its first batch, so
        restarts do not postpone segment.ms rolls (never younger than it was when opened)."""
        head = os.pread(self._fd, HEADER_SIZE, 0)
        if len(head) == HEADER_SIZE:
            first_timestamp = read_header(head).max_timestamp
            if first_timestamp >= 0:
                self.created_ms = min(self.created_ms, first_timestamp)

    def _walk(self, start: int, verify_from: int = _TRUST_ALL) -> Iterator[tuple[int, BatchHeader]]:
        """(position, header) of each batch from `start`; InvalidBatch at the first batch that
        is torn, malformed, out of order or (from verify_from on) fails its CRC."""
        window = _FileWindow(self._fd, self._size)
        position = start
        min_offset = self.base_offset
        while position < self._size:
            head = window.view(position, HEADER_SIZE, _HEADER_READAHEAD)
            if head is None:
                raise InvalidBatch(
                    position, f"{self._size - position} bytes left, fewer than a batch header"
                )
            header = read_header(head)
            problem = self._header_problem(position, header, min_offset)
            if problem:
                raise InvalidBatch(position, problem)
            if header.last_offset >= verify_from:
                batch = window.view(position, header.size, _BATCH_READAHEAD)
                if batch is None or not crc_matches(batch, header):
                    raise InvalidBatch(position, f"CRC mismatch in batch {header.base_offset}")
            yield position, header
            min_offset = header.next_offset
            position += header.size

    def _header_problem(self, position: int, header: BatchHeader, min_offset: int) -> str:
        if header.magic != MAGIC:
            return f"magic {header.magic}, expected {MAGIC}"
        if header.batch_length < HEADER_SIZE - LOG_OVERHEAD:
            return f"batch_length {header.batch_length} is shorter than a batch header"
        if position + header.size > self._size:
            return f"a {header.size}-byte batch runs past the end of the {self._size}-byte file"
        if header.base_offset < min_offset:
            return f"base offset {header.base_offset} is below {min_offset}"
        if header.last_offset_delta < 0:
            return f"negative last_offset_delta {header.last_offset_delta}"
        if header.last_offset - self.base_offset > INT32_MAX:
            return f"offset {header.last_offset} is too far above the segment's base offset"
        return ""

    def _headers(self, start: int) -> Iterator[tuple[int, BatchHeader]]:
        """_walk for reads: a bad batch in a loaded segment means the disk changed under us."""
        try:
            yield from self._walk(start)
        except InvalidBatch as e:
            raise StorageError(f"{self.log_path}: {e}") from None


class KeptBatches:
    """The large last batches segments keep, oldest first, within a byte budget. Segments of
    many logs share it, and logs may be loaded and closed on other threads: a lock."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.kept_bytes = 0
        self._kept: OrderedDict[LogSegment, int] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, segment: LogSegment, size: int) -> bool:
        """Count `size` bytes kept by `segment`, making room by making the segments that kept
        theirs longest forget them; False if it can never fit."""
        if size > self.limit_bytes:
            return False
        evicted = []
        with self._lock:
            self._release(segment)
            while self.kept_bytes + size > self.limit_bytes:
                oldest, oldest_size = self._kept.popitem(last=False)
                evicted.append(oldest)
                self.kept_bytes -= oldest_size
            self._kept[segment] = size
            self.kept_bytes += size
        for oldest in evicted:
            oldest.forget_kept_batch()
        return True

    def release(self, segment: LogSegment) -> None:
        with self._lock:
            self._release(segment)

    def _release(self, segment: LogSegment) -> None:
        size = self._kept.pop(segment, None)
        if size is not None:
            self.kept_bytes -= size


# The budget every segment of the process keeps its large last batch in.
kept_large_batches = KeptBatches(KEPT_LARGE_BATCHES_BYTES)


def _forget(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError as e:  # only a hint: the data is safe either way
        log.debug("drop-behind of %d bytes at %d: %s", length, offset, e)
    finally:
        os.close(fd)


def wait_for_drop_behind() -> None:
    """Return once every drop-behind asked for so far has run."""
    _DROPPER.submit(lambda: None).result()
