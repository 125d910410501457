"""A partition's leader epoch history (Kafka's LeaderEpochFileCache).

Entries (epoch, start offset) say at which offset each leader epoch's data began, epochs and
offsets both increasing. Followers ask the leader for an epoch's end offset
(OffsetForLeaderEpoch) to find where their log diverges, instead of truncating to their HW.
The logic is in memory; every change is persisted through the checkpoint before returning.
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
        self._entries: list[EpochEntry] = checkpoint.read()

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
            if start_offset == latest.start_offset:
                self._entries.pop()
        self._entries.append(EpochEntry(epoch, start_offset))
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
        keep = bisect.bisect_left(self._entries, end_offset, key=lambda e: e.start_offset)
        if keep < len(self._entries):
            del self._entries[keep:]
            self._persist()

    def truncate_from_start(self, start_offset: int) -> None:
        """The log now starts at `start_offset`: the epoch holding it starts there, and the
        epochs wholly before it go."""
        covered = bisect.bisect_right(self._entries, start_offset, key=lambda e: e.start_offset)
        if covered == 0:
            return
        holder = self._entries[covered - 1]
        if covered == 1 and holder.start_offset == start_offset:
            return
        self._entries[:covered] = [EpochEntry(holder.epoch, start_offset)]
        self._persist()

    def clear_and_flush(self) -> None:
        self._entries.clear()
        self._persist()

    def _persist(self) -> None:
        with self._guard():
            self._checkpoint.write(self._entries)
        log.debug("%s: leader epochs %s", self._checkpoint.path, self._entries)
