"""A segment's sparse indexes: offset → file position, and timestamp → offset.

Kafka's layouts, big-endian, one file each per segment:
  `<base>.index`      relative offset int32 | position int32          (8 bytes an entry)
  `<base>.timeindex`  timestamp int64       | relative offset int32    (12 bytes an entry)

Entries live in memory (array module) and are appended to the file as they are added, so the
file always equals memory between segment operations. The files are opened only for the
moment of a write, truncate or fsync, except that the active segment's appends keep theirs
(an open and a close per entry cost more than its write): a broker with thousands of
segments keeps two index file descriptors per log open.
"""

from __future__ import annotations

import bisect
import operator
import os
import struct
from array import array
from itertools import islice
from pathlib import Path
from typing import ClassVar, NamedTuple

from tidewater.errors import StorageError

_ALL_WRITES = os.O_WRONLY | os.O_CREAT | os.O_APPEND


class CorruptIndex(StorageError):
    """An index file does not describe its segment; recovery rebuilds it from the log."""


class OffsetPosition(NamedTuple):
    offset: int
    position: int


class TimestampOffset(NamedTuple):
    timestamp: int
    offset: int


class _SparseIndex:
    """Entries (key, value) with strictly increasing keys, persisted append-only."""

    ENTRY: ClassVar[struct.Struct]
    KEY_TYPE: ClassVar[str]
    VALUE_TYPE: ClassVar[str]

    def __init__(self, path: Path, base_offset: int) -> None:
        self.path = path
        self.base_offset = base_offset
        self._keys = array(self.KEY_TYPE)
        self._values = array(self.VALUE_TYPE)
        self._pending = bytearray()
        # The descriptor appends keep open (-1: none).
        self._fd = -1
        # Written since the last fsync.
        self.dirty = False
        # Bytes of a torn trailing entry found on load: sanity_check reports them.
        self._loaded_remainder = 0
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        self._loaded_remainder = len(data) % self.ENTRY.size
        whole = memoryview(data)[: len(data) - self._loaded_remainder]
        for key, value in self.ENTRY.iter_unpack(whole):
            self._keys.append(key)
            self._values.append(value)

    @property
    def entries(self) -> int:
        return len(self._keys)

    def is_full(self, max_index_bytes: int) -> bool:
        """Whether the segment should roll (Kafka's segment.index.bytes)."""
        return len(self._keys) >= max_index_bytes // self.ENTRY.size

    def _append(self, key: int, value: int) -> None:
        self._keys.append(key)
        self._values.append(value)
        self._pending += self.ENTRY.pack(key, value)

    def write_pending(self, keep_open: bool = False) -> None:
        """Append entries added since the last call to the file; `keep_open` keeps its
        descriptor for the next call, until close()."""
        if not self._pending:
            return
        data = bytes(self._pending)
        fd = self._fd
        if fd < 0:
            fd = os.open(self.path, _ALL_WRITES, 0o644)
            if keep_open:
                self._fd = fd
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        finally:
            if fd != self._fd:
                os.close(fd)
        self._pending.clear()
        self.dirty = True

    def close(self) -> None:
        """Close the descriptor appends kept open, if any."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _truncate_entries(self, count: int) -> None:
        del self._keys[count:]
        del self._values[count:]
        self._pending.clear()
        fd = os.open(self.path, _ALL_WRITES, 0o644)
        try:
            os.ftruncate(fd, count * self.ENTRY.size)
        finally:
            os.close(fd)
        self._loaded_remainder = 0
        self.dirty = True

    def reset(self) -> None:
        """Drop every entry (and create the file if it is missing)."""
        self._truncate_entries(0)

    def flush(self) -> None:
        """fsync the file if it changed since the last flush."""
        self.write_pending()
        if not self.dirty:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.dirty = False

    def delete(self) -> None:
        self.close()
        self._pending.clear()
        self.path.unlink(missing_ok=True)

    def _check_structure(self, values_strictly_increase: bool) -> None:
        if self._loaded_remainder:
            raise CorruptIndex(
                f"{self.path}: {self._loaded_remainder} trailing bytes, not a whole "
                f"{self.ENTRY.size}-byte entry"
            )
        keys, values = self._keys, self._values
        value_order = operator.lt if values_strictly_increase else operator.le
        if not all(map(operator.lt, keys, islice(keys, 1, None))) or not all(
            map(value_order, values, islice(values, 1, None))
        ):
            raise CorruptIndex(f"{self.path}: entries are not in increasing order")


class OffsetIndex(_SparseIndex):
    """Offset of a batch's last record → the file position where that batch starts."""

    ENTRY = struct.Struct(">ii")
    KEY_TYPE = "i"
    VALUE_TYPE = "i"

    def append(self, offset: int, position: int) -> None:
        self._append(offset - self.base_offset, position)

    def lookup(self, offset: int) -> OffsetPosition:
        """The largest entry at or below `offset`, else (base offset, 0): a batch starting at
        the returned position is at or before the batch that holds `offset`."""
        i = bisect.bisect_right(self._keys, offset - self.base_offset) - 1
        if i < 0:
            return OffsetPosition(self.base_offset, 0)
        return OffsetPosition(self.base_offset + self._keys[i], self._values[i])

    def lookup_at_or_above(self, offset: int) -> OffsetPosition | None:
        """The smallest entry at or above `offset`: the first indexed batch ending there or
        later, which holds `offset` whenever it starts at or below it."""
        i = bisect.bisect_left(self._keys, offset - self.base_offset)
        if i == len(self._keys):
            return None
        return OffsetPosition(self.base_offset + self._keys[i], self._values[i])

    @property
    def last_entry(self) -> OffsetPosition:
        if not self._keys:
            return OffsetPosition(self.base_offset, 0)
        return OffsetPosition(self.base_offset + self._keys[-1], self._values[-1])

    def truncate_to(self, offset: int) -> None:
        """Drop the entries for offsets >= `offset`."""
        self._truncate_entries(bisect.bisect_left(self._keys, offset - self.base_offset))

    def sanity_check(self, log_size: int) -> None:
        """CorruptIndex unless entries are whole, increasing, and inside the segment."""
        self._check_structure(values_strictly_increase=True)
        if self._keys and (self._keys[0] < 0 or self._values[0] < 0):
            raise CorruptIndex(
                f"{self.path}: first entry ({self._keys[0]}, {self._values[0]}) is negative"
            )
        if self._values and self._values[-1] >= log_size:
            raise CorruptIndex(
                f"{self.path}: entry points at position {self._values[-1]}, "
                f"past the end of the {log_size}-byte segment"
            )


class TimeIndex(_SparseIndex):
    """The segment's largest timestamp so far → the offset where it was reached.

    An entry is appended only when the largest timestamp grows, so timestamps strictly
    increase and offsets never decrease.
    """

    ENTRY = struct.Struct(">qi")
    KEY_TYPE = "q"
    VALUE_TYPE = "i"

    def maybe_append(self, timestamp: int, offset: int) -> None:
        if not self._keys or timestamp > self._keys[-1]:
            self._append(timestamp, offset - self.base_offset)

    def lookup(self, timestamp: int) -> TimestampOffset:
        """The largest entry with a timestamp at or below `timestamp`, else (-1, base offset):
        every record before the returned offset has a smaller timestamp."""
        i = bisect.bisect_right(self._keys, timestamp) - 1
        if i < 0:
            return TimestampOffset(-1, self.base_offset)
        return TimestampOffset(self._keys[i], self.base_offset + self._values[i])

    @property
    def last_entry(self) -> TimestampOffset | None:
        if not self._keys:
            return None
        return TimestampOffset(self._keys[-1], self.base_offset + self._values[-1])

    def truncate_to(self, offset: int) -> None:
        """Drop the entries for offsets >= `offset`."""
        self._truncate_entries(bisect.bisect_left(self._values, offset - self.base_offset))

    def sanity_check(self, last_offset: int) -> None:
        """CorruptIndex unless entries are whole, in order, and inside the segment, whose
        last offset is `last_offset`."""
        self._check_structure(values_strictly_increase=False)
        if self._values and (
            self._values[0] < 0 or self.base_offset + self._values[-1] > last_offset
        ):
            raise CorruptIndex(
                f"{self.path}: entry {tuple(self.last_entry or ())} is outside the segment's "
                f"offsets [{self.base_offset}, {last_offset}]"
            )
