"""Idempotent producers' state in one partition (Kafka's ProducerStateManager).

Per producer id: its epoch, the metadata of its last five batches (sequence range and offset
range) and when this broker last saw a batch of it. The leader checks each idempotent batch
against it before appending: a retry of one of those five batches is a duplicate answered with
the original offsets; any other sequence must follow the last one. Followers and log recovery
replay batch headers into it without checks, so a new leader or a restarted broker
deduplicates retries as the old leader would have.

A producer stays until it has been idle for producer.id.expiration.ms (expire()), leader and
follower alike; not until retention deletes its batches (Kafka since KIP-360): a retry whose
first attempt retention already deleted is still answered as a duplicate, where forgetting
the producer made it UNKNOWN_PRODUCER_ID and the client appended it again under a new epoch.

Snapshots `<offset>.snapshot` in the partition directory (JSON) hold the state as of an offset,
so loading a log replays only the log after the latest one (rebuild()). The log loads its
state when it opens (Kafka's loadProducerState in the log's loading), so a LeaderAndIsr that
hosts the partition reads none of the log on the event loop.

A truncation of the log's tail undoes the updates of the batches it removed from a journal of
the updates above the HW (truncate()), where Kafka rebuilds from a snapshot and the log after
it: up to a segment of batch headers, about a minute for 1 GiB of small batches in Python, on
the event loop every partition shares. Only a truncation below the journal's floor (below the
HW: an unclean election's) still rebuilds.
"""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tidewater.broker.log.checkpoints import fsync_dir, write_atomically
from tidewater.errors import (
    InvalidProducerEpoch,
    InvalidRequest,
    OutOfOrderSequence,
    UnknownProducerId,
)
from tidewater.records.header import SEQUENCE_MAX, BatchHeader, read_header

if TYPE_CHECKING:
    from tidewater.broker.log.log import Log

log = logging.getLogger(__name__)

# Kafka's ProducerStateEntry.NumBatchesToRetain: a producer has at most five batches in flight.
BATCHES_RETAINED = 5
SNAPSHOT_SUFFIX = ".snapshot"
# The newest snapshot, and the one before it in case a crash took back the log behind it.
SNAPSHOTS_KEPT = 2
_SNAPSHOT_FILE = re.compile(r"([0-9]{20})\.snapshot")
_SNAPSHOT_VERSION = 1
# How much log one read brings in while replaying batch headers into the state.
_REPLAY_READ_BYTES = 1 << 20
# The journal's most updates: a truncation longer than that (an HW held back that long, by a
# slow follower still in the ISR) rebuilds the state instead.
JOURNAL_MAX = 10_000


class CorruptSnapshot(Exception):
    pass


@dataclass(frozen=True, slots=True)
class BatchMetadata:
    first_sequence: int
    last_sequence: int
    first_offset: int
    last_offset: int


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A retry of a batch already in the log, at these offsets."""

    first_offset: int
    last_offset: int


@dataclass(slots=True)
class ProducerEntry:
    """A producer with at least one batch in the partition (entries never hold none)."""

    epoch: int
    # The broker's clock when it last appended or replicated (or replayed) a batch of the
    # producer: what expire() measures idleness from.
    last_timestamp: int
    batches: deque[BatchMetadata] = field(default_factory=lambda: deque(maxlen=BATCHES_RETAINED))

    @property
    def last_sequence(self) -> int:
        return self.batches[-1].last_sequence


def last_sequence(header: BatchHeader) -> int:
    """The batch's last sequence number; sequences wrap from 2^31 - 1 to 0."""
    return (header.base_sequence + header.last_offset_delta) % (SEQUENCE_MAX + 1)


def in_sequence(last: int, next_first: int) -> bool:
    return next_first == (last + 1) % (SEQUENCE_MAX + 1)


def batch_headers(buf: bytes | bytearray | memoryview) -> Iterator[BatchHeader]:
    """Headers of the whole batches in `buf` (already validated by the log)."""
    position = 0
    while position < len(buf):
        header = read_header(buf, position)
        yield header
        position += header.size


def snapshot_path(directory: Path, offset: int) -> Path:
    return directory / f"{offset:020d}{SNAPSHOT_SUFFIX}"


@dataclass(frozen=True, slots=True)
class _Undo:
    """What one update changed. A new epoch (or a new producer) replaced the entry `replaced`
    (None: there was none); else the update appended a batch to the entry, pushing `evicted`
    out of its last five, and renewed its timestamp from `last_timestamp`."""

    first_offset: int
    producer_id: int
    new_entry: bool
    replaced: ProducerEntry | None
    evicted: BatchMetadata | None
    last_timestamp: int

    def apply(self, producers: dict[int, ProducerEntry]) -> None:
        if self.new_entry:
            if self.replaced is None:
                del producers[self.producer_id]
            else:
                producers[self.producer_id] = self.replaced
            return
        # The entry the update changed: every later update is undone already.
        entry = producers[self.producer_id]
        entry.batches.pop()
        if self.evicted is not None:
            entry.batches.appendleft(self.evicted)
        entry.last_timestamp = self.last_timestamp


class ProducerStateManager:
    """One partition's producers. Not thread-safe: driven from the broker's event loop."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.producers: dict[int, ProducerEntry] = {}
        # The updates since the state last matched the log below `_journal_floor`, oldest
        # first: undoing those at and past an offset gives the state of the log below it.
        self._journal: deque[_Undo] = deque()
        self._journal_floor = 0

    # -- the leader's check ------------------------------------------------------------------

    def check(self, header: BatchHeader) -> Duplicate | None:
        """Check an idempotent batch before the leader appends it: the original offsets if it
        is a retry of one of the producer's last five batches, None if it may be appended;
        OutOfOrderSequence, UnknownProducerId or InvalidProducerEpoch otherwise."""
        pid, epoch, first = header.producer_id, header.producer_epoch, header.base_sequence
        if epoch < 0 or first < 0:
            raise InvalidRequest(
                f"batch of producer {pid} has epoch {epoch} and base sequence {first}; an "
                "idempotent batch needs both"
            )
        entry = self.producers.get(pid)
        if entry is None:
            if first != 0:
                raise UnknownProducerId(
                    f"no state for producer {pid} and its batch starts at sequence {first}, not 0"
                )
            return None
        if epoch < entry.epoch:
            raise InvalidProducerEpoch(
                f"producer {pid} sent epoch {epoch}; epoch {entry.epoch} fenced it"
            )
        if epoch > entry.epoch:
            if first != 0:
                raise OutOfOrderSequence(
                    f"producer {pid} began epoch {epoch} at sequence {first}; a new epoch "
                    "starts at 0"
                )
            return None
        last = last_sequence(header)
        for batch in entry.batches:
            if batch.first_sequence == first and batch.last_sequence == last:
                return Duplicate(batch.first_offset, batch.last_offset)
        if not in_sequence(entry.last_sequence, first):
            raise OutOfOrderSequence(
                f"producer {pid} epoch {epoch}: sequence {first} does not follow "
                f"{entry.last_sequence}"
            )
        return None

    # -- updates -----------------------------------------------------------------------------

    def update(self, header: BatchHeader, first_offset: int, now_ms: int) -> None:
        """Record an idempotent batch whose first offset is `first_offset`, appended at
        `now_ms` by the broker's clock.

        Kafka stamps the entry with the batch's max timestamp, which under CreateTime is the
        producer's clock: a producer whose clock lags (or that sends old timestamps, a
        replay) is expired at the next check, and its retry may then be appended twice; one
        whose clock runs ahead is kept that much longer. Expiry compares the broker's clock
        with itself here."""
        pid = header.producer_id
        entry = self.producers.get(pid)
        if entry is None or entry.epoch != header.producer_epoch:
            undo = _Undo(first_offset, pid, True, entry, None, 0)
            # A new epoch forgets the old one's batches: their sequences no longer apply.
            entry = self.producers[pid] = ProducerEntry(header.producer_epoch, now_ms)
        else:
            full = len(entry.batches) == BATCHES_RETAINED
            evicted = entry.batches[0] if full else None
            undo = _Undo(first_offset, pid, False, None, evicted, entry.last_timestamp)
        self._journal.append(undo)
        if len(self._journal) > JOURNAL_MAX:
            self._journal_floor = self._journal.popleft().first_offset + 1
        entry.batches.append(
            BatchMetadata(
                header.base_sequence,
                last_sequence(header),
                first_offset,
                first_offset + header.last_offset_delta,
            )
        )
        entry.last_timestamp = now_ms

    def load_from_log(self, headers: Iterable[BatchHeader], now_ms: int) -> None:
        """Replay batches already in a log (replicated or recovered), offsets as stored; no
        checks: the leader that appended them made them. They count as seen at `now_ms`: a
        recovered producer may then live up to one expiration longer than on the leader,
        never shorter."""
        for header in headers:
            if header.producer_id >= 0:
                self.update(header, header.base_offset, now_ms)

    def rebuild(self, log: Log, now_ms: int) -> None:
        """Replace the state with the newest snapshot at or below the log's end plus the log
        after it (the whole log without one): Kafka's rebuildProducerState, when the log
        opens and after a truncation. A truncation cannot just drop the batches it removed:
        they may have begun a new epoch of a producer, whose entry replaced the older
        epoch's, and only a snapshot and the log still hold that one (review 14 L1)."""
        covered = self.load_snapshot(log.log_end_offset)
        start = max(covered or 0, log.log_start_offset)
        self._journal_floor = start
        self.load_from_log(_headers_from(log, start, log.log_end_offset), now_ms)

    @property
    def journal_floor(self) -> int:
        """A truncation below it rebuilds the state (truncate() returns False)."""
        return self._journal_floor

    def rebuilt_below(self, log: Log, end: int, now_ms: int) -> tuple[ProducerStateManager, int]:
        """What rebuild() would give once the log is truncated to `end`: a new state of the
        log's whole batches below `end` (the newest readable snapshot at or below it, and the
        log after it), and the offset it reaches (the truncated log's end). It only reads,
        this state, the snapshots or the log, so a truncation runs it on a worker thread
        while nothing appends to the log (Partition.prepare_truncation), and adopt()s it."""
        rebuilt = ProducerStateManager(self.dir)
        covered, rebuilt.producers, _ = self._newest_snapshot(end)
        start = max(covered or 0, log.log_start_offset)
        rebuilt._journal_floor = reached = start
        for header in _headers_from(log, start, end):
            if header.next_offset > end:
                break  # the batch holding `end` goes with the truncation, whole
            if header.producer_id >= 0:
                rebuilt.update(header, header.base_offset, now_ms)
            reached = header.next_offset
        return rebuilt, reached

    def adopt(self, rebuilt: ProducerStateManager, log_end_offset: int) -> None:
        """Take the state rebuilt_below() built for the log now ending at `log_end_offset`;
        the snapshots past that end go (durably)."""
        self.producers = rebuilt.producers
        self._journal = rebuilt._journal
        self._journal_floor = rebuilt._journal_floor
        self._delete_durably([path for at, path in self._snapshots() if at > log_end_offset])

    def truncate(self, log_end_offset: int) -> bool:
        """The log's tail went, its end now `log_end_offset`: undo the updates of the batches
        removed, and delete the snapshots past the end (durably). False, and nothing done,
        when the journal does not reach back that far: the caller rebuilds."""
        if log_end_offset < self._journal_floor:
            return False
        journal = self._journal
        while journal and journal[-1].first_offset >= log_end_offset:
            journal.pop().apply(self.producers)
        self._delete_durably([path for at, path in self._snapshots() if at > log_end_offset])
        return True

    def release(self, offset: int) -> None:
        """No truncation goes below `offset` (the HW) but an unclean election's: forget the
        journal's updates below it."""
        journal = self._journal
        while journal and journal[0].first_offset < offset:
            journal.popleft()
        self._journal_floor = max(self._journal_floor, offset)

    def expire(self, now_ms: int, expiration_ms: int, log_end_offset: int) -> int:
        """Forget producers with no batch for `expiration_ms` up to `now_ms` (Kafka's
        removeExpiredProducers); returns how many. Their next batch gets UNKNOWN_PRODUCER_ID
        unless it starts at sequence 0, and the producer bumps its epoch and starts at 0.

        The next snapshot leaves them out. A restart from an older snapshot brings them
        back with the timestamps they had, as the state was before they expired (every batch
        since is in the log after that snapshot and replayed over it): the next check
        expires them again, and meanwhile they check batches as they did before they
        expired."""
        expired = [
            pid
            for pid, entry in self.producers.items()
            if now_ms - entry.last_timestamp >= expiration_ms
        ]
        for pid in expired:
            del self.producers[pid]
        if expired:
            # Undoing the updates before would bring back only parts of the entries that went.
            self._reset_journal(log_end_offset)
        return len(expired)

    def clear(self) -> None:
        """Forget every producer and snapshot (the log restarted empty at a new offset)."""
        self.producers.clear()
        self._reset_journal(0)
        self._delete_durably([path for _, path in self._snapshots()])

    # -- snapshots ---------------------------------------------------------------------------

    def take_snapshot(self, offset: int, durable: bool = True) -> Path:
        """Write the state as of `offset` (every batch below it applied) atomically, and drop
        all but the newest SNAPSHOTS_KEPT snapshots; returns its path. Without `durable` the
        caller fsyncs it later (write_atomically): a crash before then may leave a torn or
        stale file, which load_snapshot() discards."""
        document = {
            "version": _SNAPSHOT_VERSION,
            "offset": offset,
            "producers": [
                [
                    pid,
                    entry.epoch,
                    entry.last_timestamp,
                    [
                        [b.first_sequence, b.last_sequence, b.first_offset, b.last_offset]
                        for b in entry.batches
                    ],
                ]
                for pid, entry in self.producers.items()
            ],
        }
        written = snapshot_path(self.dir, offset)
        write_atomically(written, json.dumps(document).encode(), durable)
        for _, path in self._snapshots()[:-SNAPSHOTS_KEPT]:
            path.unlink()
        return written

    def load_snapshot(self, log_end_offset: int) -> int | None:
        """Replace the state with the newest readable snapshot at or below the LEO and return
        its offset (None: none, the state is empty). Snapshots past the LEO describe data a
        crash or a truncation took back and are deleted, as are corrupt ones."""
        loaded, self.producers, unusable = self._newest_snapshot(log_end_offset)
        self._reset_journal(loaded or 0)
        self._delete_durably(unusable)
        return loaded

    def _newest_snapshot(self, end: int) -> tuple[int | None, dict[int, ProducerEntry], list[Path]]:
        """The newest readable snapshot at or below `end`: its offset (None: none) and
        producers, and the snapshots past `end` or corrupt, newer than it (to delete)."""
        unusable = []
        for offset, path in reversed(self._snapshots()):
            if offset > end:
                unusable.append(path)
                continue
            try:
                return offset, _parse_snapshot(path.read_bytes(), offset), unusable
            except CorruptSnapshot as e:
                log.warning("%s: %s; deleting it", path, e)
                unusable.append(path)
        return None, {}, unusable

    def _reset_journal(self, floor: int) -> None:
        """The state is now the log's below `floor`, with no updates to undo."""
        self._journal.clear()
        self._journal_floor = floor

    def _delete_durably(self, paths: list[Path]) -> None:
        """Delete snapshots, durably before the log takes another append: after a machine
        crash a deleted snapshot past the LEO that came back once the log had grown past it
        again would describe other records, its producers' retries answered as duplicates
        at offsets another producer's records hold (review 14 L2)."""
        for path in paths:
            path.unlink()
        if paths:
            fsync_dir(self.dir)

    def newest_snapshot_offset(self) -> int | None:
        """The offset of the newest snapshot file, readable or not (None: there is none)."""
        snapshots = self._snapshots()
        return snapshots[-1][0] if snapshots else None

    def _snapshots(self) -> list[tuple[int, Path]]:
        """(offset, path) of every snapshot in the directory, oldest first."""
        found = []
        for path in self.dir.iterdir():
            match = _SNAPSHOT_FILE.fullmatch(path.name)
            if match:
                found.append((int(match[1]), path))
        return sorted(found)


def _headers_from(log: Log, start: int, end: int) -> Iterator[BatchHeader]:
    """Headers of the log's batches holding the offsets from `start` up to `end`."""
    offset = start
    while offset < min(end, log.log_end_offset):
        data = log.read(offset, _REPLAY_READ_BYTES)
        if not data:
            return
        for header in batch_headers(data):
            if header.last_offset >= start:
                yield header
            offset = header.next_offset


def _parse_snapshot(data: bytes, offset: int) -> dict[int, ProducerEntry]:
    try:
        document = json.loads(data)
        if document["version"] != _SNAPSHOT_VERSION:
            raise CorruptSnapshot(f"unknown snapshot version {document['version']}")
        # A crash before an unsynced snapshot reached the disk can leave its name on blocks
        # that still hold an older snapshot. (Snapshots written before the field have none.)
        if document.get("offset", offset) != offset:
            raise CorruptSnapshot(f"holds the state as of offset {document['offset']}")
        producers = {}
        for pid, epoch, last_timestamp, batches in document["producers"]:
            entry = ProducerEntry(int(epoch), int(last_timestamp))
            entry.batches.extend(BatchMetadata(*map(int, b)) for b in batches)
            producers[int(pid)] = entry
        return producers
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptSnapshot(f"unreadable producer state snapshot: {e!r}") from None
