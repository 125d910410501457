"""A partition's leader epoch history (Kafka's LeaderEpochFileCache).

Entries (epoch, start offset) say at which offset each leader epoch's data began, epochs and
offsets both increasing. Followers ask the leader for an epoch's end offset
(OffsetForLeaderEpoch) to find where their log diverges, instead of truncating to their HW.
The logic is in memory; every change is persisted through the checkpoint before returning,
but for a moved log start: the checkpoint lets go of the epochs before it only once the log
start offset's own checkpoint holds it (log_start_checkpointed). Either file may be older
after a crash: loading trims the epochs to the log start it finds, which must never be
below the epochs the checkpoint kept.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable

from tidewater.broker.log.checkpoints import EpochEntry, LeaderEpochCheckpoint

log = logging.getLogger(__name__)

UNDEFINED_EPOCH = -1
UNDEFINED_EPOCH_OFFSET = -1


class LeaderEpochCache:
    def __init__(
        self,
        checkpoint: LeaderEpochCheckpoint,
        guard: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        """`guard`: around each checkpoint write (the log's: an I/O error is its log dir's)."""
        self._checkpoint = checkpoint
        self._guard = guard
        # What the checkpoint holds: the entries, and those before the log start until the
        # log start offset checkpoint holds it.
        self._written: list[EpochEntry] = checkpoint.read()
        self._entries = list(self._written)

    @property
    def epoch_entries(self) -> list[EpochEntry]:
        return list(self._entries)

    @property
    def latest_epoch(self) -> int:
        return self._entries[-1].epoch if self._entries else UNDEFINED_EPOCH

    def assign(self, epoch: int, start_offset: int) -> None:
        """Record that `epoch` starts at `start_offset`. Ignored unless the epoch is newer and
        the offset not below the latest entry's; an epoch that began where the new one does
        wrote nothing and is replaced."""
        if epoch < 0 or start_offset < 0:
            return
        if self._entries:
            latest = self._entries[-1]
            if epoch <= latest.epoch or start_offset < latest.start_offset:
                return
        entry = EpochEntry(epoch, start_offset)
        _append(self._entries, entry)
        _append(self._written, entry)
        self._persist()

    def epoch_for_offset(self, offset: int) -> int:
        """The epoch of the record at `offset`, UNDEFINED_EPOCH if it predates every entry."""
        i = bisect.bisect_right(self._entries, offset, key=lambda e: e.start_offset) - 1
        return self._entries[i].epoch if i >= 0 else UNDEFINED_EPOCH

    def end_offset_for(self, requested_epoch: int, log_end_offset: int) -> tuple[int, int]:
        """Kafka's endOffsetFor: (the largest epoch <= requested, the start offset of the
        epoch after it), i.e. where the requester's history can still agree with ours.

        - requested is the latest epoch: (requested, LEO), the epoch is still being written;
        - requested is below every epoch: (requested, start of the first epoch), as Kafka
          does: the older data is gone, the requester should start at our first epoch;
        - requested is above every epoch, unknown, or the cache is empty: UNDEFINED (-1, -1).
        """
        if requested_epoch == UNDEFINED_EPOCH or not self._entries:
            return UNDEFINED_EPOCH, UNDEFINED_EPOCH_OFFSET
        if requested_epoch == self.latest_epoch:
            return requested_epoch, log_end_offset
        higher = bisect.bisect_right(self._entries, requested_epoch, key=lambda e: e.epoch)
        if higher == len(self._entries):
            return UNDEFINED_EPOCH, UNDEFINED_EPOCH_OFFSET
        if higher == 0:
            return requested_epoch, self._entries[0].start_offset
        return self._entries[higher - 1].epoch, self._entries[higher].start_offset

    def truncate_from_end(self, end_offset: int) -> None:
        """The log was truncated to `end_offset`: forget epochs that began at or after it."""
        _truncate_from_end(self._entries, end_offset)
        if _truncate_from_end(self._written, end_offset):
            self._persist()

    def truncate_from_start(self, start_offset: int) -> None:
        """The log now starts at `start_offset`: the epoch holding it starts there, and the
        epochs wholly before it go, from the checkpoint too once the log start offset is
        checkpointed (log_start_checkpointed)."""
        self._entries = _truncated_from_start(self._entries, start_offset)

    def log_start_checkpointed(self, start_offset: int) -> None:
        """The log start offset checkpoint holds `start_offset` now: the epoch checkpoint lets
        go of the epochs before it. Not sooner (review 13 L3): a crash in between brought the
        log back from the start checkpointed before, the records below the new one with no
        epoch (-1 in ListOffsets, OffsetForLeaderEpoch answering the new start)."""
        trimmed = _truncated_from_start(self._written, start_offset)
        if trimmed != self._written:
            self._written = trimmed
            self._persist()

    def clear_and_flush(self) -> None:
        self._entries.clear()
        self._written.clear()
        self._persist()

    def _persist(self) -> None:
        with self._guard():
            self._checkpoint.write(self._written)
        log.debug("%s: leader epochs %s", self._checkpoint.path, self._written)


def _append(entries: list[EpochEntry], entry: EpochEntry) -> None:
    """Add the latest entry; an epoch that began where it does wrote nothing and goes. (In
    the checkpoint's entries, any that does not come before it: those of records below a
    log start that a truncation lowered, which a newer epoch cannot follow.)"""
    while entries and (
        entries[-1].start_offset >= entry.start_offset or entries[-1].epoch >= entry.epoch
    ):
        entries.pop()
    entries.append(entry)


def _truncate_from_end(entries: list[EpochEntry], end_offset: int) -> bool:
    """Drop the epochs that begin at or after `end_offset`; whether any went."""
    keep = bisect.bisect_left(entries, end_offset, key=lambda e: e.start_offset)
    dropped = keep < len(entries)
    del entries[keep:]
    return dropped


def _truncated_from_start(entries: list[EpochEntry], start_offset: int) -> list[EpochEntry]:
    """The epochs of a log starting at `start_offset`: the one holding it starts there."""
    covered = bisect.bisect_right(entries, start_offset, key=lambda e: e.start_offset)
    if covered == 0 or (covered == 1 and entries[0].start_offset == start_offset):
        return entries
    return [EpochEntry(entries[covered - 1].epoch, start_offset), *entries[covered:]]
