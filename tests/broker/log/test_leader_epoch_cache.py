from __future__ import annotations

from pathlib import Path

import pytest

from tidewater.broker.log.checkpoints import EpochEntry, LeaderEpochCheckpoint
from tidewater.broker.log.leader_epoch_cache import LeaderEpochCache

UNDEFINED = (-1, -1)


@pytest.fixture
def checkpoint(tmp_path: Path) -> LeaderEpochCheckpoint:
    return LeaderEpochCheckpoint(tmp_path / "leader-epoch-checkpoint")


def cache_with(checkpoint: LeaderEpochCheckpoint, *entries: tuple[int, int]) -> LeaderEpochCache:
    cache = LeaderEpochCache(checkpoint)
    for epoch, start_offset in entries:
        cache.assign(epoch, start_offset)
    return cache


def test_assign_records_new_epochs_and_persists_them(checkpoint: LeaderEpochCheckpoint) -> None:
    cache = cache_with(checkpoint, (0, 0), (2, 10), (5, 30))
    assert cache.epoch_entries == [EpochEntry(0, 0), EpochEntry(2, 10), EpochEntry(5, 30)]
    assert cache.latest_epoch == 5
    assert checkpoint.read() == cache.epoch_entries
    assert LeaderEpochCache(checkpoint).epoch_entries == cache.epoch_entries


def test_assign_ignores_old_epochs_and_offsets_below_the_latest(
    checkpoint: LeaderEpochCheckpoint,
) -> None:
    cache = cache_with(checkpoint, (2, 10), (5, 30))
    cache.assign(5, 40)  # same epoch
    cache.assign(4, 50)  # older epoch
    cache.assign(6, 20)  # start offset below the latest
    cache.assign(-1, 60)  # batches from producers carry no epoch
    assert cache.epoch_entries == [EpochEntry(2, 10), EpochEntry(5, 30)]
    assert checkpoint.read() == cache.epoch_entries


def test_an_epoch_that_wrote_nothing_is_replaced(checkpoint: LeaderEpochCheckpoint) -> None:
    cache = cache_with(checkpoint, (1, 0), (2, 10), (3, 10))
    assert cache.epoch_entries == [EpochEntry(1, 0), EpochEntry(3, 10)]


def test_empty_cache(checkpoint: LeaderEpochCheckpoint) -> None:
    cache = LeaderEpochCache(checkpoint)
    assert cache.latest_epoch == -1
    assert cache.epoch_entries == []
    assert cache.end_offset_for(0, 100) == UNDEFINED
    assert cache.epoch_for_offset(5) == -1


def test_end_offset_for_follows_kafka(checkpoint: LeaderEpochCheckpoint) -> None:
    cache = cache_with(checkpoint, (2, 10), (5, 30), (8, 60))
    # The latest epoch is still being written: it ends at the LEO.
    assert cache.end_offset_for(8, 75) == (8, 75)
    # A known epoch ends where the next one starts.
    assert cache.end_offset_for(2, 75) == (2, 30)
    assert cache.end_offset_for(5, 75) == (5, 60)
    # Between epochs: the largest epoch below the requested one, ending at the next start.
    assert cache.end_offset_for(3, 75) == (2, 30)
    assert cache.end_offset_for(7, 75) == (5, 60)
    # Below the first epoch: Kafka answers the requested epoch and the first start offset.
    assert cache.end_offset_for(1, 75) == (1, 10)
    # Larger than any known epoch, or undefined: UNDEFINED.
    assert cache.end_offset_for(9, 75) == UNDEFINED
    assert cache.end_offset_for(-1, 75) == UNDEFINED


def test_epoch_for_offset(checkpoint: LeaderEpochCheckpoint) -> None:
    cache = cache_with(checkpoint, (2, 10), (5, 30))
    assert cache.epoch_for_offset(9) == -1
    assert cache.epoch_for_offset(10) == 2
    assert cache.epoch_for_offset(29) == 2
    assert cache.epoch_for_offset(30) == 5
    assert cache.epoch_for_offset(1000) == 5


def test_truncate_from_end_drops_epochs_starting_at_or_after(
    checkpoint: LeaderEpochCheckpoint,
) -> None:
    cache = cache_with(checkpoint, (2, 10), (5, 30), (8, 60))
    cache.truncate_from_end(61)
    assert cache.latest_epoch == 8
    cache.truncate_from_end(30)
    assert cache.epoch_entries == [EpochEntry(2, 10)]
    assert checkpoint.read() == [EpochEntry(2, 10)]
    # After truncation, a newer epoch may start lower than the dropped ones did.
    cache.assign(9, 25)
    assert cache.epoch_entries == [EpochEntry(2, 10), EpochEntry(9, 25)]


def test_truncate_from_start_moves_the_holding_epoch_up(
    checkpoint: LeaderEpochCheckpoint,
) -> None:
    cache = cache_with(checkpoint, (2, 10), (5, 30), (8, 60))
    cache.truncate_from_start(5)
    assert cache.epoch_entries == [EpochEntry(2, 10), EpochEntry(5, 30), EpochEntry(8, 60)]
    cache.truncate_from_start(45)
    assert cache.epoch_entries == [EpochEntry(5, 45), EpochEntry(8, 60)]
    cache.truncate_from_start(60)
    assert cache.epoch_entries == [EpochEntry(8, 60)]


def test_the_checkpoint_keeps_the_epochs_below_the_log_start_until_it_is_checkpointed(
    checkpoint: LeaderEpochCheckpoint,
) -> None:
    """Review 13 L3: a crash before the log start offset checkpoint loads the log from the
    start checkpointed before, whose records need their epochs."""
    cache = cache_with(checkpoint, (2, 10), (5, 30), (8, 60))
    cache.truncate_from_start(45)
    cache.truncate_from_start(62)
    assert cache.epoch_entries == [EpochEntry(8, 62)]
    assert checkpoint.read() == [EpochEntry(2, 10), EpochEntry(5, 30), EpochEntry(8, 60)]
    cache.assign(9, 70)  # changes that persist write the epochs below the log start too
    cache.truncate_from_end(75)
    assert checkpoint.read() == [(2, 10), (5, 30), (8, 60), (9, 70)]
    cache.log_start_checkpointed(45)
    assert checkpoint.read() == [(5, 45), (8, 60), (9, 70)]
    cache.log_start_checkpointed(62)
    assert checkpoint.read() == [(8, 62), (9, 70)]
    assert cache.epoch_entries == [(8, 62), (9, 70)]
    reloaded = LeaderEpochCache(checkpoint)
    reloaded.truncate_from_start(45)  # an older log start checkpointed: the epochs hold
    assert reloaded.epoch_for_offset(45) == -1 < reloaded.epoch_for_offset(62) == 8


def test_a_truncation_below_the_log_start_keeps_the_epochs_before_it_in_the_checkpoint(
    checkpoint: LeaderEpochCheckpoint,
) -> None:
    """A truncation inside the batch holding the log start ends the log before it (the log
    start follows, checkpointed at once): the records below keep their epochs on disk until
    then, and the next epoch replaces them in the checkpoint."""
    cache = cache_with(checkpoint, (2, 10), (5, 30))
    cache.truncate_from_start(40)
    cache.truncate_from_end(35)
    assert cache.epoch_entries == []
    assert checkpoint.read() == [(2, 10), (5, 30)]
    cache.log_start_checkpointed(35)
    assert checkpoint.read() == [(5, 35)]
    cache.assign(7, 35)
    assert cache.epoch_entries == checkpoint.read() == [(7, 35)]


def test_clear_and_flush(checkpoint: LeaderEpochCheckpoint) -> None:
    cache = cache_with(checkpoint, (2, 10))
    cache.clear_and_flush()
    assert cache.epoch_entries == []
    assert checkpoint.read() == []
