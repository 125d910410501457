from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import mmap
import os
import threading
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import tidewater.broker.log
import tidewater.records
from tests.broker.log.clock import Clock
from tidewater.broker.log import segment as segment_module
from tidewater.broker.log.checkpoints import EpochEntry
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.log import (
    AppendInfo,
    FlushJob,
    Log,
    UnexpectedAppendOffset,
    parse_partition_dir,
)
from tidewater.broker.log.segment import KEPT_BATCH_BYTES, KeptBatches, wait_for_drop_behind
from tidewater.errors import CorruptMessage, MessageTooLarge, OffsetOutOfRange, StorageError
from tidewater.records.header import (
    HEADER_SIZE,
    crc_matches,
    patch_base_offset_and_epoch,
    read_header,
)

T0 = 1_750_000_000_000  # record timestamps: any fixed time
MakeBatch = Callable[..., bytearray]
OpenLog = Callable[..., Log]
Split = Callable[[bytes | bytearray | memoryview], list[bytes]]


def fill(log: Log, make_batch: MakeBatch, count: int, records: int = 3, size: int = 200) -> None:
    """Append `count` batches of `records` records whose bodies say which batch they are."""
    for i in range(count):
        log.append_as_leader(make_batch(records, body=body(i, size)), leader_epoch=1)


def record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, the names of the files and directories fsynced, in order."""
    synced: list[str] = []
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return synced


def body(i: int, size: int = 200) -> bytes:
    return f"batch-{i:05d}|".encode().ljust(size, b".")


def read_all(log: Log, split: Split, offset: int | None = None, **kwargs: int) -> list[bytes]:
    """Every batch from `offset` (default: log start) to the end, fetching like a consumer."""
    offset = log.log_start_offset if offset is None else offset
    batches: list[bytes] = []
    while chunk := log.read(offset, kwargs.get("max_bytes", 1 << 20), kwargs.get("max_offset")):
        batches += split(chunk)
        offset = read_header(batches[-1]).next_offset
    return batches


def bodies(batches: list[bytes]) -> list[bytes]:
    return [batch[HEADER_SIZE:] for batch in batches]


def segment_files(log_dir: Path, suffix: str = ".log") -> list[str]:
    return sorted(p.name for p in log_dir.glob(f"*{suffix}"))


# -- appends and reads -------------------------------------------------------------------


def test_append_assigns_offsets_and_reads_back_across_rolls(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, log_dir: Path
) -> None:
    log = open_log(segment_bytes=1000)
    infos = [log.append_as_leader(make_batch(3, body=body(i)), leader_epoch=4) for i in range(20)]
    assert [(i.first_offset, i.last_offset) for i in infos] == [
        (3 * n, 3 * n + 2) for n in range(20)
    ]
    assert log.log_end_offset == 60
    assert len(log.segments) > 5
    assert all(segment.size <= 1000 for segment in log.segments)
    assert segment_files(log_dir) == [f"{s.base_offset:020d}.log" for s in log.segments]

    batches = read_all(log, split)
    assert bodies(batches) == [body(i) for i in range(20)]
    headers = [read_header(b) for b in batches]
    assert [h.base_offset for h in headers] == [3 * n for n in range(20)]
    assert {h.partition_leader_epoch for h in headers} == {4}
    assert all(crc_matches(b, h) for b, h in zip(batches, headers, strict=True))


def open_index_files(log_dir: Path) -> list[str]:
    """Names of this process's open descriptors of index files in `log_dir`."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used
            continue
        if target.parent == log_dir and target.suffix in (".index", ".timeindex"):
            names.append(target.name)
    return sorted(names)


def test_only_the_active_segments_index_files_stay_open_between_appends(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, log_dir: Path
) -> None:
    log = open_log(segment_bytes=1000, index_interval_bytes=100)
    fill(log, make_batch, 20)
    assert len(log.segments) > 3
    active = f"{log.segments[-1].base_offset:020d}"
    assert open_index_files(log_dir) == [f"{active}.index", f"{active}.timeindex"]
    log.truncate_to(log.segments[-1].base_offset - 1)  # a rolled segment is active again
    fill(log, make_batch, 1)
    active = f"{log.segments[-1].base_offset:020d}"
    # (Its time index had nothing new to write: same timestamps.)
    assert open_index_files(log_dir) == [f"{active}.index"]
    log.close()
    assert open_index_files(log_dir) == []
    reopened = open_log(segment_bytes=1000, index_interval_bytes=100)
    assert [read_header(b).base_offset for b in read_all(reopened, split)] == list(
        range(0, reopened.log_end_offset, 3)
    )


def test_leader_append_patches_the_callers_buffer(open_log: OpenLog, make_batch: MakeBatch) -> None:
    log = open_log()
    fill(log, make_batch, 2)
    batch = make_batch(5)
    log.append_as_leader(batch, leader_epoch=9)
    header = read_header(batch)
    assert (header.base_offset, header.partition_leader_epoch) == (6, 9)
    assert crc_matches(batch, header)


def test_one_append_may_carry_several_batches(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    log = open_log(segment_bytes=700)
    data = bytearray().join(make_batch(2, body=body(i)) for i in range(6))
    info = log.append_as_leader(data, leader_epoch=1)
    assert (info.first_offset, info.last_offset, info.size_bytes) == (0, 11, len(data))
    assert len(log.segments) == 3  # split between segments at batch boundaries
    assert bodies(read_all(log, split)) == [body(i) for i in range(6)]


def test_append_info_reports_the_max_timestamp(open_log: OpenLog, make_batch: MakeBatch) -> None:
    log = open_log()
    data = make_batch(2, max_timestamp=T0 + 50) + make_batch(3, max_timestamp=T0 + 9)
    info = log.append_as_leader(data, leader_epoch=1)
    assert (info.max_timestamp, info.offset_of_max_timestamp) == (T0 + 50, 1)


MALFORMED: dict[str, Callable[[MakeBatch], bytearray]] = {
    "empty": lambda make: bytearray(),
    "shorter than a header": lambda make: make(1)[:30],
    "second batch cut short": lambda make: make(1) + make(1)[:-5],
    "bad magic": lambda make: make(1)[:16] + b"\x01" + make(1)[17:],
    "length below a header": lambda make: make(1)[:8] + (10).to_bytes(4, "big") + make(1)[12:],
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_appends_are_refused_and_change_nothing(
    open_log: OpenLog, make_batch: MakeBatch, kind: str
) -> None:
    log = open_log()
    fill(log, make_batch, 1)
    with pytest.raises(CorruptMessage):
        log.append_as_leader(MALFORMED[kind](make_batch), leader_epoch=1)
    assert log.log_end_offset == 3
    assert log.size_bytes == len(make_batch(3, body=body(0)))


def test_a_batch_larger_than_a_segment_is_refused(open_log: OpenLog, make_batch: MakeBatch) -> None:
    log = open_log(segment_bytes=500)
    with pytest.raises(MessageTooLarge, match=r"segment\.bytes=500"):
        log.append_as_leader(make_batch(1, body=bytes(600)), leader_epoch=1)
    assert log.log_end_offset == 0


def test_read_returns_at_most_max_bytes_of_whole_batches(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    log = open_log()
    fill(log, make_batch, 10)
    size = len(make_batch(3, body=body(0)))
    assert len(split(log.read(0, size * 2 + size // 2))) == 2
    assert len(split(log.read(0, size * 3))) == 3
    # At least one whole batch, even past max_bytes (Kafka's rule).
    assert split(log.read(0, 10)) == [bytes(log.read(0, size))]
    assert len(log.read(0, 0)) == size
    assert len(log.read(0, 1 << 20)) == 10 * size


def test_read_starts_at_the_batch_holding_the_offset(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    log = open_log(index_interval_bytes=300)
    fill(log, make_batch, 10)
    for offset in (0, 4, 13, 29):
        first = read_header(split(log.read(offset, 1))[0])
        assert first.base_offset <= offset <= first.last_offset


def test_read_stops_before_max_offset(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    log = open_log()
    fill(log, make_batch, 10)
    served = split(log.read(0, 1 << 20, max_offset=12))
    assert [read_header(b).base_offset for b in served] == [0, 3, 6, 9]
    # The batch holding max_offset - 1 is served whole, as the HW always ends a batch.
    assert read_all(log, split, 0, max_offset=12) == served
    assert log.read(12, 1 << 20, max_offset=12) == b""
    assert log.read(20, 1 << 20, max_offset=12) == b""


def test_read_at_the_log_end_is_empty_and_outside_the_log_is_out_of_range(
    open_log: OpenLog, make_batch: MakeBatch
) -> None:
    log = open_log()
    assert log.read(0, 100) == b""
    fill(log, make_batch, 2)
    assert log.read(6, 100) == b""
    with pytest.raises(OffsetOutOfRange, match=r"offset 7 is outside the log's range \[0, 6\]"):
        log.read(7, 100)
    with pytest.raises(OffsetOutOfRange):
        log.read(-1, 100)


def test_reads_after_reopening(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, log_dir: Path
) -> None:
    log = open_log(segment_bytes=1000, index_interval_bytes=100)
    fill(log, make_batch, 20)
    before = read_all(log, split)
    log.close()
    reopened = open_log(recovery_point=log.recovery_point, segment_bytes=1000)
    assert reopened.log_end_offset == 60
    assert read_all(reopened, split) == before
    assert bodies(read_all(reopened, split, 31)) == [body(i) for i in range(10, 20)]
    fill(reopened, make_batch, 1)
    assert reopened.log_end_offset == 63


def test_topic_and_partition_come_from_the_directory_name(tmp_path: Path) -> None:
    assert parse_partition_dir("my-topic-with-dashes-12") == ("my-topic-with-dashes", 12)
    assert parse_partition_dir("a.b_c-0") == ("a.b_c", 0)
    for bad in ("nodash", "topic-", "-3", "topic-x", "topic-1.abc-delete"):
        with pytest.raises(StorageError, match="not a partition directory"):
            parse_partition_dir(bad)
    log = Log.open(tmp_path / "my-topic-7", LogConfig())
    assert (log.topic, log.partition, log.name) == ("my-topic", 7, "my-topic-7")
    log.close()


# -- appends written off the event loop ---------------------------------------------------

OnAppended = Callable[[AppendInfo], None]


def as_leader(
    log: Log, batch: bytearray, epoch: int, on_appended: OnAppended
) -> Awaitable[AppendInfo]:
    return log.append_batch_off_loop(batch, epoch, on_appended)


def as_follower(
    log: Log, batch: bytearray, epoch: int, on_appended: OnAppended
) -> Awaitable[AppendInfo]:
    """The same batch as the leader sent it: offsets and epoch already assigned."""
    patch_base_offset_and_epoch(batch, 0, log.log_end_offset, epoch)
    return log.append_as_follower_off_loop(batch, on_appended)


Append = Callable[[Log, bytearray, int, OnAppended], Awaitable[AppendInfo]]
both_roles = pytest.mark.parametrize("append", [as_leader, as_follower], ids=["leader", "follower"])


async def test_a_small_batch_is_in_the_log_before_the_loop_runs_anything_else(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    log = open_log()
    fill(log, make_batch, 1)  # offsets 0-2
    appended: list[tuple[AppendInfo, int]] = []
    append = asyncio.create_task(
        log.append_batch_off_loop(
            make_batch(3, body=body(1)), 2, lambda info: appended.append((info, log.log_end_offset))
        )
    )
    await asyncio.sleep(0)  # one turn of the loop: the append's first and only step
    assert append.done()
    info = append.result()
    assert (info.first_offset, info.last_offset) == (3, 5)
    assert appended == [(info, 6)]
    assert bodies(read_all(log, split)) == [body(0), body(1)]
    assert read_header(read_all(log, split)[-1]).partition_leader_epoch == 2


@both_roles
@pytest.mark.usefixtures("off_loop_writes")
async def test_a_batch_written_off_the_loop_is_in_the_log_when_the_append_returns(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, append: Append
) -> None:
    log = open_log(segment_bytes=1000)
    seen: list[tuple[AppendInfo, int]] = []

    def appended(info: AppendInfo) -> None:
        seen.append((info, log.log_end_offset))

    infos = [await append(log, make_batch(3, body=body(i)), 4, appended) for i in range(10)]
    assert [(i.first_offset, i.last_offset) for i in infos] == [
        (3 * n, 3 * n + 2) for n in range(10)
    ]
    assert seen == [(info, info.last_offset + 1) for info in infos]
    assert len(log.segments) > 2
    assert bodies(read_all(log, split)) == [body(i) for i in range(10)]
    assert {read_header(b).partition_leader_epoch for b in read_all(log, split)} == {4}


@both_roles
@pytest.mark.usefixtures("off_loop_writes")
async def test_other_changes_to_the_log_take_in_a_write_under_way_first(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, append: Append
) -> None:
    log = open_log()
    fill(log, make_batch, 2)  # offsets 0-5
    appended: list[AppendInfo] = []
    task = asyncio.create_task(append(log, make_batch(3, body=body(2)), 1, appended.append))
    await asyncio.sleep(0)  # the append has handed its batch to a writer thread
    assert log.log_end_offset == 6
    log.truncate_to(7)  # inside the batch being written: it goes again, whole
    assert [(i.first_offset, i.last_offset) for i in appended] == [(6, 8)]
    assert (await task).first_offset == 6
    assert log.log_end_offset == 6
    log.append_as_leader(make_batch(1, body=body(3)), leader_epoch=1)
    assert bodies(read_all(log, split)) == [body(0), body(1), body(3)]


@both_roles
@pytest.mark.usefixtures("off_loop_writes")
async def test_closing_the_log_waits_for_a_write_under_way(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, append: Append
) -> None:
    log = open_log()
    task = asyncio.create_task(append(log, make_batch(2, body=body(0)), 1, lambda _: None))
    await asyncio.sleep(0)
    log.close()
    assert (await task).last_offset == 1
    reopened = open_log()
    assert reopened.log_end_offset == 2
    assert bodies(read_all(reopened, split)) == [body(0)]


@both_roles
@pytest.mark.usefixtures("off_loop_writes")
async def test_a_failed_write_off_the_loop_leaves_the_log_as_it_was(
    open_log: OpenLog,
    make_batch: MakeBatch,
    split: Split,
    monkeypatch: pytest.MonkeyPatch,
    append: Append,
) -> None:
    log = open_log()
    fill(log, make_batch, 1)
    segment = log.segments[-1]

    def fail(data: bytes, drop_behind_bytes: int) -> None:
        raise StorageError("disk full")

    monkeypatch.setattr(segment, "write", fail)
    appended: list[AppendInfo] = []
    with pytest.raises(StorageError, match="disk full"):
        await append(log, make_batch(3), 2, appended.append)
    assert appended == []
    assert log.log_end_offset == 3
    # The failed batch's new epoch is not in the history either.
    assert log.leader_epoch_cache.epoch_entries == [EpochEntry(1, 0)]
    monkeypatch.undo()
    info = await append(log, make_batch(2, body=body(1)), 1, appended.append)
    assert (info.first_offset, info.last_offset) == (3, 4)
    assert bodies(read_all(log, split)) == [body(0), body(1)]


def overwrite_file(log: Log, position: int, data: bytes) -> None:
    """Change the last segment's file under the log, as no reader of the file would miss."""
    with log.segments[-1].log_path.open("r+b") as f:
        f.seek(position)
        f.write(data)


@pytest.mark.parametrize("size", [KEPT_BATCH_BYTES + 1, 100 * 1024], ids=["inline", "off-loop"])
async def test_a_leaders_large_last_batch_is_read_from_the_buffer_it_handed_over(
    open_log: OpenLog, make_batch: MakeBatch, size: int
) -> None:
    """Followers read each new batch: its reads need no pread until another batch follows
    (then the file serves it) or the log forgets it (truncation)."""
    log = open_log()
    first = make_batch(1, body=b"a" * size)
    await log.append_batch_off_loop(first, 1, lambda _: None)
    stored = bytes(first)
    overwrite_file(log, HEADER_SIZE, b"z" * 16)
    assert bytes(log.read(0, 1 << 30)) == stored  # not from the file
    second = make_batch(1, body=b"b" * size)
    await log.append_batch_off_loop(second, 1, lambda _: None)
    assert bytes(log.read(0, len(stored))) == stored[:HEADER_SIZE] + b"z" * 16 + b"a" * (size - 16)
    assert bytes(log.read(1, 1 << 30)) == bytes(second)
    log.truncate_to(1)
    assert log.read(1, 1 << 30) == b""
    third = make_batch(1, body=b"c" * 100)  # small: kept as a copy, as before
    await log.append_batch_off_loop(third, 1, lambda _: None)
    assert bytes(log.read(1, 1 << 30)) == bytes(third)
    log.close()


async def test_large_kept_batches_stay_within_their_budget(
    make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, clock: Clock
) -> None:
    """Many partitions written in large batches hold at most the budget in memory: the
    partitions written longest ago read their last batch from the file again."""
    size = KEPT_BATCH_BYTES * 2
    budget = KeptBatches(3 * (size + HEADER_SIZE))
    monkeypatch.setattr(segment_module, "kept_large_batches", budget)
    logs = [Log.open(tmp_path / f"topic-{i}", LogConfig(), 0, clock) for i in range(5)]
    for i, log in enumerate(logs):
        await log.append_batch_off_loop(make_batch(1, body=bytes([i]) * size), 1, lambda _: None)
        overwrite_file(log, HEADER_SIZE, b"z")
    assert budget.kept_bytes <= budget.limit_bytes
    from_file = [bytes(log.read(0, 1 << 30))[HEADER_SIZE] == ord("z") for log in logs]
    assert from_file == [True, True, False, False, False]
    for log in logs:
        log.close()
    assert budget.kept_bytes == 0


def test_a_kept_batch_budget_lets_the_oldest_go_first() -> None:
    forgotten: list[str] = []

    class Segment:
        def __init__(self, name: str) -> None:
            self.name = name

        def forget_kept_batch(self) -> None:
            forgotten.append(self.name)
            budget.release(self)  # type: ignore[arg-type]

    budget = KeptBatches(100)
    a, b, c = Segment("a"), Segment("b"), Segment("c")
    assert budget.keep(a, 40) and budget.keep(b, 40)  # type: ignore[arg-type]
    assert budget.keep(a, 30)  # type: ignore[arg-type]  # a newer batch of a: a is newest now
    assert budget.kept_bytes == 70
    assert budget.keep(c, 50)  # type: ignore[arg-type]
    assert forgotten == ["b"]
    assert budget.kept_bytes == 80
    assert not budget.keep(b, 101)  # type: ignore[arg-type]
    assert forgotten == ["b"] and budget.kept_bytes == 80
    budget.release(a)  # type: ignore[arg-type]
    assert budget.kept_bytes == 50


# -- follower appends --------------------------------------------------------------------


def leader_batches(make_batch: MakeBatch, first_offset: int, count: int, epoch: int) -> bytes:
    data = bytearray()
    for i in range(count):
        data += make_batch(2, body=body(i), base_offset=first_offset + 2 * i, epoch=epoch)
    return bytes(data)


def test_follower_append_keeps_the_leaders_offsets_and_epochs(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    log = open_log(segment_bytes=600)
    info = log.append_as_follower(leader_batches(make_batch, 0, 5, epoch=3))
    assert (info.first_offset, info.last_offset) == (0, 9)
    log.append_as_follower(leader_batches(make_batch, 10, 2, epoch=4))
    served = read_all(log, split)
    assert [read_header(b).base_offset for b in served] == [0, 2, 4, 6, 8, 10, 12]
    assert [read_header(b).partition_leader_epoch for b in served] == [3] * 5 + [4] * 2
    assert log.leader_epoch_cache.epoch_entries == [EpochEntry(3, 0), EpochEntry(4, 10)]


def test_follower_append_must_start_at_the_log_end(
    open_log: OpenLog, make_batch: MakeBatch
) -> None:
    log = open_log()
    log.append_as_follower(leader_batches(make_batch, 0, 2, epoch=1))
    for first in (2, 6):
        with pytest.raises(UnexpectedAppendOffset, match=f"starts at offset {first}.* is 4"):
            log.append_as_follower(leader_batches(make_batch, first, 1, epoch=1))
    overlapping = make_batch(2, base_offset=4) + make_batch(2, base_offset=5)
    with pytest.raises(UnexpectedAppendOffset, match="overlaps"):
        log.append_as_follower(bytes(overlapping))
    assert log.log_end_offset == 4


def test_follower_append_checks_crcs(open_log: OpenLog, make_batch: MakeBatch) -> None:
    log = open_log()
    data = bytearray(leader_batches(make_batch, 0, 2, epoch=1))
    data[-1] ^= 0xFF
    with pytest.raises(CorruptMessage, match="CRC"):
        log.append_as_follower(data)
    assert log.log_end_offset == 0


# -- rolling -----------------------------------------------------------------------------


def test_an_empty_segments_age_starts_with_its_first_batch(
    open_log: OpenLog, make_batch: MakeBatch, clock: Clock
) -> None:
    """Review 21 #4: segment.ms counted from the segment's creation, so a partition idle
    past it rolled right after its first batch; Kafka counts from the first batch."""
    log = open_log(segment_ms=60_000)
    clock.now += 120_000  # created, then idle
    fill(log, make_batch, 1)
    clock.now += 1
    fill(log, make_batch, 1)
    assert len(log.segments) == 1


def test_segment_rolls_by_age(
    open_log: OpenLog, make_batch: MakeBatch, clock: Clock, split: Split
) -> None:
    log = open_log(segment_ms=60_000)
    fill(log, make_batch, 2)
    clock.now += 60_000
    fill(log, make_batch, 1)
    assert len(log.segments) == 1
    clock.now += 1
    fill(log, make_batch, 1)
    assert [s.base_offset for s in log.segments] == [0, 9]
    # The new segment's age starts now; an empty one never rolls.
    clock.now += 60_000
    fill(log, make_batch, 1)
    assert [s.base_offset for s in log.segments] == [0, 9]
    assert len(read_all(log, split)) == 5


def test_segment_rolls_when_an_index_is_full(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    # Three offset index entries (24 bytes) at most, one per batch after the first; the
    # time index gets one, as the timestamps do not grow.
    log = open_log(segment_index_bytes=24, index_interval_bytes=0)
    fill(log, make_batch, 9)
    assert [s.base_offset for s in log.segments] == [0, 12, 24]
    assert [s.offset_index.entries for s in log.segments] == [3, 3, 0]
    assert bodies(read_all(log, split)) == [body(i) for i in range(9)]


def test_roll_flushes_the_finished_segment(open_log: OpenLog, make_batch: MakeBatch) -> None:
    log = open_log(segment_bytes=600)
    fill(log, make_batch, 2)
    assert log.recovery_point == 0
    fill(log, make_batch, 1)
    assert len(log.segments) == 2
    assert log.recovery_point == 6 == log.segments[1].base_offset


def test_a_roll_can_leave_its_flush_to_another_thread(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    log = open_log(segment_bytes=600)
    jobs: list[FlushJob] = []
    log.flush_in_background = lambda lg, job: jobs.append(job)
    fill(log, make_batch, 3)
    assert len(log.segments) == 2
    assert log.recovery_point == 0  # the append did not wait for the fsync
    (job,) = jobs
    assert (job.offset, len(job.fds)) == (6, 1)
    job.run()
    log.finish_flush(job)
    assert log.recovery_point == 6
    assert bodies(read_all(log, split)) == [body(i) for i in range(3)]


def test_a_flush_job_of_a_truncated_log_does_not_move_the_recovery_point(
    open_log: OpenLog, make_batch: MakeBatch
) -> None:
    log = open_log(segment_bytes=600)
    jobs: list[FlushJob] = []
    log.flush_in_background = lambda lg, job: jobs.append(job)
    fill(log, make_batch, 3)
    log.truncate_to(3)
    jobs[0].run()
    log.finish_flush(jobs[0])
    assert log.recovery_point == 0 < log.log_end_offset == 3


async def test_writing_out_fsyncs_the_unflushed_log_off_the_loop(
    open_log: OpenLog, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a diverged follower does before it truncates (on the loop, fsyncing the log
    below the new end): the writeback happens on a worker thread first, and moves the
    recovery point (review 16 L4: it did not, and the truncation fsynced every segment from
    the old one again), so the truncation fsyncs only the segment it cuts."""
    log = open_log(segment_bytes=400)
    fill(log, make_batch, 8)
    assert len(log.segments) > 2
    fsynced: list[tuple[str, bool]] = []
    fsync = os.fsync

    def recorded(fd: int) -> None:
        on_loop = threading.current_thread() is threading.main_thread()
        fsynced.append((os.readlink(f"/proc/self/fd/{fd}"), on_loop))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    await log.write_out()
    assert str(log.segments[-1].log_path.resolve()) in {path for path, _ in fsynced}
    assert not any(on_loop for _, on_loop in fsynced)
    assert log.recovery_point == log.log_end_offset
    fsynced.clear()
    cut = log.segments[-2]
    log.truncate_to(cut.base_offset + 1)
    assert log.log_end_offset <= cut.base_offset + 1
    segment_files = {p for p, _ in fsynced if p.endswith(".log")}
    assert segment_files == {str(cut.log_path.resolve())}


def test_files_synced_in_the_background_move_no_recovery_point_and_are_not_recreated(
    open_log: OpenLog, make_batch: MakeBatch, log_dir: Path
) -> None:
    log = open_log()
    jobs: list[FlushJob] = []
    log.flush_in_background = lambda lg, job: jobs.append(job)
    fill(log, make_batch, 2)
    kept, deleted = log_dir / "kept.snapshot", log_dir / "deleted.snapshot"
    kept.write_bytes(b"x")
    deleted.write_bytes(b"y")
    log.sync_files([kept, deleted])
    (job,) = jobs
    assert (job.offset, job.paths, job.dirs) == (None, [kept, deleted], [log_dir])
    deleted.unlink()  # as truncation deletes snapshots past its offset
    job.run()
    log.finish_flush(job)
    assert log.recovery_point == 0 < log.log_end_offset
    assert kept.read_bytes() == b"x" and not deleted.exists()


# -- truncation --------------------------------------------------------------------------


def test_truncate_to_drops_everything_from_the_offset(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, log_dir: Path
) -> None:
    log = open_log(segment_bytes=1000, index_interval_bytes=100)
    fill(log, make_batch, 20)
    log.leader_epoch_cache.assign(2, 30)
    log.truncate_to(27)
    assert log.log_end_offset == 27
    assert bodies(read_all(log, split)) == [body(i) for i in range(9)]
    assert segment_files(log_dir) == [f"{s.base_offset:020d}.log" for s in log.segments]
    assert log.segments[-1].base_offset <= 27
    assert log.leader_epoch_cache.latest_epoch == 1
    fill(log, make_batch, 1)
    assert log.log_end_offset == 30
    assert read_header(split(log.read(27, 1))[0]).base_offset == 27


def test_truncating_at_the_log_end_drops_an_epoch_that_wrote_nothing(
    open_log: OpenLog, make_batch: MakeBatch
) -> None:
    """A replica that led an epoch without writing, then follows: the epoch's entry starts
    at the LEO and goes, though no record does (Kafka's Log.truncateTo)."""
    log = open_log()
    fill(log, make_batch, 3)
    end = log.log_end_offset
    log.leader_epoch_cache.assign(2, end)
    log.truncate_to(end)
    assert log.log_end_offset == end
    assert log.leader_epoch_cache.latest_epoch == 1


@pytest.mark.parametrize("index_interval_bytes", [1, 4096])
def test_reads_of_the_last_batch_follow_truncations_and_appends(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, index_interval_bytes: int
) -> None:
    """A follower or consumer keeping up reads the log's last batch, again and again."""
    log = open_log(index_interval_bytes=index_interval_bytes)

    def last_read(offset: int) -> list[tuple[int, int, bytes]]:
        return [
            (read_header(b).base_offset, read_header(b).last_offset, bytes(bodies([b])[0]))
            for b in split(log.read(offset, 1 << 20))
        ]

    fill(log, make_batch, 3)  # offsets 0-8
    assert last_read(7) == [(6, 8, body(2))]
    log.truncate_to(6)
    assert log.read(6, 1 << 20) == b""
    log.append_as_leader(make_batch(2, body=body(7)), leader_epoch=1)
    assert last_read(6) == [(6, 7, body(7))]
    log.truncate_to(4)  # inside the batch at 3-5: it goes, whole
    log.append_as_leader(make_batch(1, body=body(8)), leader_epoch=1)
    assert last_read(3) == [(3, 3, body(8))]
    assert bodies(read_all(log, split)) == [body(0), body(8)]
    log.close()
    reopened = open_log(recovery_point=0, index_interval_bytes=index_interval_bytes)
    assert [read_header(b).base_offset for b in split(reopened.read(3, 1 << 20))] == [3]


def test_the_last_batch_reads_as_stored_whatever_its_appender_does_with_its_buffer(
    open_log: OpenLog, make_batch: MakeBatch
) -> None:
    """A small last batch is read from a copy in memory, a larger one from the file: both as
    the log stored them."""
    log = open_log()
    small = make_batch(2, body=body(1))
    log.append_as_leader(small, leader_epoch=1)
    stored = bytes(small)
    small[-1] ^= 0xFF  # the producer's buffer, reused
    assert bytes(log.read(0, 1 << 20)) == stored
    large = make_batch(1, body=b"x" * (KEPT_BATCH_BYTES + 1))
    log.append_as_leader(large, leader_epoch=1)
    assert bytes(log.read(0, 1 << 20)) == stored + bytes(large)
    assert bytes(log.read(2, 1 << 20)) == bytes(large)
    log.close()


def kept_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """The traced bytes the log's code and the batches it was given allocated. Not the
    process's: a global table that grows during the measurement (the interned strings, for
    the segments' file names, by 1.9 MB at once) or other threads' or finalizers' allocations
    are no part of what the log keeps."""
    filters = [
        tracemalloc.Filter(True, str(Path(tidewater.broker.log.__file__).parent / "*")),
        tracemalloc.Filter(True, str(Path(tidewater.records.__file__).parent / "*")),
        tracemalloc.Filter(True, str(Path(__file__).parent / "conftest.py")),  # make_batch
    ]
    # Filtered by the allocating (innermost) frame: an allocation by the stdlib, even
    # called from the log, is its own.
    return sum(s.size for s in snapshot.filter_traces(filters).statistics("filename"))


def test_only_the_active_segment_keeps_its_last_batch_in_memory(
    open_log: OpenLog, make_batch: MakeBatch
) -> None:
    """A broker with many segments holds at most one kept batch per partition."""
    batch_body = b"x" * (KEPT_BATCH_BYTES - 1024)
    log = open_log(segment_bytes=KEPT_BATCH_BYTES)  # one batch per segment
    log.append_as_leader(make_batch(1, body=batch_body), leader_epoch=1)
    tracemalloc.start()
    try:
        gc.collect()  # garbage of earlier tests, and below of the appends, is not kept
        before = kept_bytes(tracemalloc.take_snapshot())
        for _ in range(100):
            log.append_as_leader(make_batch(1, body=batch_body), leader_epoch=1)
        gc.collect()
        grown = kept_bytes(tracemalloc.take_snapshot()) - before
    finally:
        tracemalloc.stop()
    assert len(log.segments) == 101
    assert grown < 25 * len(batch_body)  # 100 kept copies would be 100 times it
    assert bytes(log.read(100, 1 << 20)).endswith(batch_body)
    assert bytes(log.read(0, 1 << 20)).endswith(batch_body)
    log.close()


def test_truncate_to_a_segment_boundary_and_mid_batch(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    log = open_log(segment_bytes=1000)
    fill(log, make_batch, 20)
    boundary = log.segments[2].base_offset
    log.truncate_to(boundary)
    assert log.log_end_offset == boundary
    assert log.segments[-1].base_offset == boundary
    assert log.segments[-1].size == 0
    # Batches are whole: truncating inside one drops all of it.
    log.truncate_to(boundary - 2)
    assert log.log_end_offset == boundary - 3
    # Truncating at or past the end changes nothing.
    log.truncate_to(1000)
    assert log.log_end_offset == boundary - 3
    assert len(read_all(log, split)) == (boundary - 3) // 3


def test_truncate_survives_reopening(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    log = open_log(segment_bytes=1000, index_interval_bytes=100)
    fill(log, make_batch, 20)
    log.truncate_to(33)
    log.close()
    reopened = open_log(recovery_point=log.recovery_point, segment_bytes=1000)
    assert reopened.log_end_offset == 33
    assert bodies(read_all(reopened, split)) == [body(i) for i in range(11)]


def test_a_truncation_is_on_disk_before_truncate_to_returns(
    open_log: OpenLog, make_batch: MakeBatch, log_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Else a crash could bring back dropped records past the new end, where the appends
    after them did not reach the disk: another leader's records, with good CRCs."""
    log = open_log(segment_bytes=1000, index_interval_bytes=100)
    fill(log, make_batch, 20)
    log.flush()
    synced = record_fsyncs(monkeypatch)
    log.truncate_to(27)
    active = f"{log.segments[-1].base_offset:020d}"
    assert {f"{active}.log", log_dir.name} <= set(synced)


def test_truncate_fully_and_start_at(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, log_dir: Path
) -> None:
    log = open_log(segment_bytes=1000)
    fill(log, make_batch, 20)
    log.truncate_fully_and_start_at(500)
    assert log.log_start_offset == log.log_end_offset == log.recovery_point == 500
    assert segment_files(log_dir) == ["00000000000000000500.log"]
    assert log.leader_epoch_cache.epoch_entries == []
    with pytest.raises(OffsetOutOfRange):
        log.read(0, 100)
    fill(log, make_batch, 1)
    assert [read_header(b).base_offset for b in read_all(log, split)] == [500]
    log.close()
    reopened = open_log(recovery_point=log.recovery_point)
    assert (reopened.log_start_offset, reopened.log_end_offset) == (500, 503)


def test_truncate_below_the_log_start_starts_over_there(
    open_log: OpenLog, make_batch: MakeBatch
) -> None:
    log = open_log()
    log.truncate_fully_and_start_at(100)
    fill(log, make_batch, 2)
    log.truncate_to(50)
    assert log.log_start_offset == log.log_end_offset == 50


# -- retention ---------------------------------------------------------------------------


def test_retention_by_time_deletes_old_segments_and_moves_the_log_start(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, log_dir: Path
) -> None:
    log = open_log(segment_bytes=1000, retention_ms=3_600_000)
    for i in range(20):
        # Batch i is stamped i minutes after T0.
        log.append_as_leader(make_batch(3, body=body(i), timestamp=T0 + i * 60_000), leader_epoch=1)
    log.leader_epoch_cache.assign(2, 15)
    old_segments = len(log.segments)
    second = log.segments[1]
    # Only the first segment's newest record is over an hour old.
    newest_in_first = log.segments[0].max_timestamp
    assert log.delete_retention_segments(newest_in_first + 3_600_001, log.log_end_offset) == 1
    assert log.log_start_offset == second.base_offset
    assert len(log.segments) == old_segments - 1
    assert segment_files(log_dir)[0] == f"{second.base_offset:020d}.log"
    with pytest.raises(OffsetOutOfRange):
        log.read(0, 100)
    assert read_header(read_all(log, split)[0]).base_offset == second.base_offset
    assert log.leader_epoch_cache.epoch_entries[0].start_offset == second.base_offset
    # Far in the future everything is old, the active segment too once the HW covers it
    # (review 21 #3: it stayed, and an idle partition kept its data for ever): an empty one
    # is rolled at the LEO first, as Kafka's deleteSegments does.
    assert log.delete_retention_segments(T0 + 10**10, log.log_end_offset - 1) == old_segments - 2
    assert log.log_start_offset == log.segments[0].base_offset < 60
    assert log.delete_retention_segments(T0 + 10**10, log.log_end_offset) == 1
    assert [(s.base_offset, s.size) for s in log.segments] == [(60, 0)]
    assert (log.log_start_offset, log.log_end_offset) == (60, 60)
    assert log.delete_retention_segments(T0 + 10**10, log.log_end_offset) == 0
    # The epoch the log ended in still starts where its records now would.
    assert [(e.epoch, e.start_offset) for e in log.leader_epoch_cache.epoch_entries] == [(2, 60)]
    assert log.append_as_leader(make_batch(3), leader_epoch=2).first_offset == 60


def test_retention_by_size_keeps_at_least_retention_bytes(
    open_log: OpenLog, make_batch: MakeBatch
) -> None:
    log = open_log(segment_bytes=1000, retention_ms=-1, retention_bytes=2500)
    fill(log, make_batch, 20)
    sizes = [s.size for s in log.segments]
    deleted = log.delete_retention_segments(T0, log.log_end_offset)
    assert deleted > 0
    assert log.size_bytes >= 2500
    assert log.size_bytes - log.segments[0].size < 2500
    assert log.size_bytes == sum(sizes[deleted:])
    assert log.delete_retention_segments(T0, log.log_end_offset) == 0


def test_advancing_the_log_start_moves_it_exactly_and_deletes_the_segments_wholly_before_it(
    open_log: OpenLog, make_batch: MakeBatch, split: Split
) -> None:
    """Kafka's log start offset may fall inside a segment: a follower whose segments start at
    other offsets than its leader's starts exactly where the leader does."""
    log = open_log(segment_bytes=1000, retention_ms=-1)
    fill(log, make_batch, 20)
    bases = [s.base_offset for s in log.segments]
    inside = bases[2] + 3  # the second batch of the third segment
    log.advance_log_start(inside)
    assert log.log_start_offset == inside
    assert [s.base_offset for s in log.segments] == bases[2:]
    assert log.leader_epoch_cache.epoch_entries[0].start_offset == inside
    log.advance_log_start(bases[2])  # never back
    assert log.log_start_offset == inside
    assert read_header(read_all(log, split)[0]).base_offset == inside
    with pytest.raises(ValueError, match="past its end"):
        log.advance_log_start(log.log_end_offset + 1)
    log.advance_log_start(log.log_end_offset)  # never the active segment
    assert log.log_start_offset == log.log_end_offset == 60
    assert [s.base_offset for s in log.segments] == bases[-1:]


def test_reads_below_a_log_start_inside_a_segment_are_refused(
    open_log: OpenLog, make_batch: MakeBatch
) -> None:
    log = open_log(segment_bytes=1000, retention_ms=-1)
    fill(log, make_batch, 20)
    inside = log.segments[1].base_offset + 3
    log.advance_log_start(inside)
    with pytest.raises(OffsetOutOfRange, match=rf"\[{inside}, 60\]"):
        log.read(inside - 1, 1 << 20)
    assert read_header(bytes(log.read(inside, 1 << 20))).base_offset == inside


def test_a_checkpointed_log_start_is_kept_within_the_log(
    log_dir: Path, clock: Clock, make_batch: MakeBatch
) -> None:
    """On load, the log-start-offset-checkpoint's offset is clamped to [first segment's base,
    LEO] (a crash may have taken back the tail it was in, or the segments below it), and
    segments wholly below it (their deletion undone by a crash) are deleted."""
    config = LogConfig(segment_bytes=1000)
    log = Log.open(log_dir, config, 0, clock)
    fill(log, make_batch, 20)
    bases = [s.base_offset for s in log.segments]
    log.close()
    for checkpointed, expected, first_base in (
        (bases[1] + 3, bases[1] + 3, bases[1]),
        (0, bases[1], bases[1]),
        (100, 60, bases[-1]),
    ):
        reopened = Log.open(log_dir, config, 60, clock, log_start_offset=checkpointed)
        assert (reopened.log_start_offset, reopened.segments[0].base_offset) == (
            expected,
            first_base,
        )
        reopened.close()


@pytest.mark.parametrize(
    "policy", [{"retention_ms": 0}, {"retention_ms": -1, "retention_bytes": 0}], ids=["ms", "bytes"]
)
def test_retention_deletes_only_segments_the_hw_has_passed(
    open_log: OpenLog, make_batch: MakeBatch, policy: dict[str, int]
) -> None:
    """Kafka's deletableSegments: a segment may go once the HW reaches the next one's base
    offset (the active one: the LEO), so the log start never passes the HW; records no
    follower may have copied yet stay, however old or large the log."""
    log = open_log(segment_bytes=1000, **policy)
    fill(log, make_batch, 20)
    bases = [s.base_offset for s in log.segments]
    now = T0 + 10**10
    assert log.delete_retention_segments(now, high_watermark=0) == 0
    assert log.delete_retention_segments(now, high_watermark=bases[2] - 1) == 1
    assert log.log_start_offset == bases[1]
    assert log.delete_retention_segments(now, high_watermark=bases[2]) == 1
    assert log.log_start_offset == bases[2]
    assert log.delete_retention_segments(now, log.log_end_offset - 1) == len(bases) - 3
    assert log.log_start_offset == bases[-1]
    assert log.delete_retention_segments(now, log.log_end_offset) == 1
    assert log.log_start_offset == log.log_end_offset


def test_no_retention_when_unbounded(open_log: OpenLog, make_batch: MakeBatch) -> None:
    log = open_log(segment_bytes=1000, retention_ms=-1, retention_bytes=-1)
    fill(log, make_batch, 20)
    assert log.delete_retention_segments(T0 + 10**12, log.log_end_offset) == 0
    assert log.log_start_offset == 0


# -- flushing ----------------------------------------------------------------------------


def test_flush_moves_the_recovery_point(open_log: OpenLog, make_batch: MakeBatch) -> None:
    log = open_log()
    fill(log, make_batch, 3)
    assert log.recovery_point == 0
    log.flush(4)
    assert log.recovery_point == 4
    log.flush()
    assert log.recovery_point == 9
    log.flush(100)
    assert log.recovery_point == 9


def test_flush_messages_flushes_after_enough_appends(
    open_log: OpenLog, make_batch: MakeBatch
) -> None:
    log = open_log(flush_messages=5)
    fill(log, make_batch, 1)
    assert log.recovery_point == 0
    fill(log, make_batch, 1)
    assert log.recovery_point == 6


def test_flush_ms_flushes_when_due(open_log: OpenLog, make_batch: MakeBatch, clock: Clock) -> None:
    log = open_log(flush_ms=1000)
    fill(log, make_batch, 1)
    log.flush_if_due(clock.now + 999)
    assert log.recovery_point == 0
    log.flush_if_due(clock.now + 1000)
    assert log.recovery_point == 3


def test_without_flush_settings_only_rolls_and_close_flush(
    open_log: OpenLog, make_batch: MakeBatch, clock: Clock
) -> None:
    log = open_log()
    fill(log, make_batch, 5)
    log.flush_if_due(clock.now + 10**9)
    assert log.recovery_point == 0
    log.close()
    assert log.recovery_point == 15


# -- page cache --------------------------------------------------------------------------

MIB = 1 << 20


def cached_pages(path: Path) -> list[bool]:
    """Which pages of the file the OS page cache holds (mincore on a private mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del address  # no export of the mapping may outlive it
    return [bool(b & 1) for b in vec]


@pytest.mark.parametrize("drop_behind", [4 * MIB, -1])
def test_drop_behind_keeps_only_the_segment_tail_in_the_page_cache(
    open_log: OpenLog,
    make_batch: MakeBatch,
    split: Split,
    log_dir: Path,
    drop_behind: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    advice: list[int] = []
    fadvise = os.posix_fadvise

    def recorded(fd: int, offset: int, length: int, what: int) -> None:
        advice.append(what)
        fadvise(fd, offset, length, what)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    log = open_log(cache_drop_behind_bytes=drop_behind)
    for i in range(16):
        log.append_as_leader(make_batch(1, body=body(i, MIB)), leader_epoch=1)
        log.flush()  # the OS drops only pages already written back
    wait_for_drop_behind()
    cached = cached_pages(log_dir / segment_files(log_dir)[0])
    assert all(cached[-MIB // mmap.PAGESIZE :])  # the newest MiB
    if drop_behind >= 0:
        assert os.POSIX_FADV_DONTNEED in advice
        assert not any(cached[: 8 * MIB // mmap.PAGESIZE])
    else:
        # Left to the OS, which may evict what it likes when memory runs short (a busy
        # machine's benchmarks did): the log itself asks it to drop nothing.
        assert os.POSIX_FADV_DONTNEED not in advice
    assert bodies(read_all(log, split)) == [body(i, MIB) for i in range(16)]


# -- timestamps --------------------------------------------------------------------------


def test_fetch_offset_by_timestamp(open_log: OpenLog) -> None:
    from tidewater.records.batch import Record, build_batch

    log = open_log(segment_bytes=2000, index_interval_bytes=200)
    for i in range(30):
        # Records i*3 .. i*3+2 stamped T0 + 10 * (their offset).
        records = [Record(value=b"v" * 50, timestamp_ms=T0 + 10 * (3 * i + j)) for j in range(3)]
        log.append_as_leader(bytearray(build_batch(records)), leader_epoch=1)
    assert len(log.segments) > 2
    assert log.fetch_offset_by_timestamp(0) == (0, T0)
    assert log.fetch_offset_by_timestamp(T0 + 10 * 47) == (47, T0 + 470)
    assert log.fetch_offset_by_timestamp(T0 + 10 * 47 - 5) == (47, T0 + 470)
    assert log.fetch_offset_by_timestamp(T0 + 10 * 89) == (89, T0 + 890)
    assert log.fetch_offset_by_timestamp(T0 + 10 * 89 + 1) is None
    # Never a record below the log start offset (Kafka's startingOffset), even inside a batch.
    log.advance_log_start(47)
    assert log.fetch_offset_by_timestamp(0) == (47, T0 + 470)
    assert log.fetch_offset_by_timestamp(T0 + 10 * 48) == (48, T0 + 480)


# -- loading and recovery ----------------------------------------------------------------


def crash(log: Log) -> None:
    """Drop the log as a killed process would: no flush, no close of anything but fds."""
    for segment in log.segments:
        segment.close()


class PowerLoss:
    """A machine crash for the files of one directory, a small form of review 13's model:
    from its creation on, each file keeps at the crash only the bytes it held at its last
    fsync (none if it had none), a file the directory's last fsync did not list is gone, and
    one it listed that was deleted since is back. Truncations stay done."""

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.directory = directory
        self.durable: dict[int, int] = {}  # inode -> size at its last fsync
        self.names: dict[str, int] = {}  # the directory's entries at its last fsync: inodes
        self.deleted: dict[int, Path] = {}  # inode -> where a file deleted since is kept
        self.graveyard = directory.with_name(f"{directory.name}.power-loss")
        fsync, unlink = os.fsync, os.unlink

        def tracking_fsync(fd: int) -> None:
            fsync(fd)
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            if path == directory:
                self.names = {entry.name: entry.inode() for entry in os.scandir(directory)}
            elif path.parent == directory:
                stat = os.fstat(fd)
                self.durable[stat.st_ino] = stat.st_size

        def keeping_unlink(path: str | os.PathLike[str]) -> None:
            if Path(path).parent.resolve() != directory:
                unlink(path)
                return
            self.graveyard.mkdir(exist_ok=True)
            inode = os.stat(path).st_ino
            self.deleted[inode] = self.graveyard / str(inode)
            os.rename(path, self.deleted[inode])

        monkeypatch.setattr(os, "fsync", tracking_fsync)
        monkeypatch.setattr(os, "unlink", keeping_unlink)
        self._unlink = unlink

    def crash(self, log: Log, jobs: list[FlushJob]) -> None:
        """The machine stops: `log`'s background flush `jobs` never run."""
        for job in jobs:
            job.close()
        crash(log)
        for path in self.directory.iterdir():
            if path.name not in self.names:
                self._unlink(path)
        for name, inode in self.names.items():
            path = self.directory / name
            if not path.exists() and inode in self.deleted:
                os.rename(self.deleted[inode], path)
            if path.exists():
                durable = self.durable.get(path.stat().st_ino, 0)
                os.truncate(path, min(durable, path.stat().st_size))


@pytest.fixture
def power_loss(log_dir: Path, monkeypatch: pytest.MonkeyPatch) -> PowerLoss:
    return PowerLoss(log_dir.resolve(), monkeypatch)


def test_a_truncation_after_a_roll_leaves_no_hole_after_a_machine_crash(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, power_loss: PowerLoss
) -> None:
    """Review 13: truncate_to fsynced the truncated last segment while the fsync of the segment
    rolled before it still waited in the background; a machine crash then kept the later
    segment and lost the earlier one's end at a batch boundary, and the log reloaded with a
    hole in its offsets (LEO 12 without offsets 6-8), served as whole. truncate_to now makes
    the log below its new end durable, the earlier segments first."""
    log = open_log(segment_bytes=1000, index_interval_bytes=100)  # 3 batches a segment
    jobs: list[FlushJob] = []
    log.flush_in_background = lambda lg, job: jobs.append(job)
    for i in range(2):
        log.append_as_leader(make_batch(3, body=body(i)), leader_epoch=1)
    log.flush()  # flush.ms: offsets 0-5 on disk
    for i in range(2, 6):  # 6-8 stay in the page cache; the roll at 9 queues their fsync
        log.append_as_leader(make_batch(3, body=body(i)), leader_epoch=1)
    assert [s.base_offset for s in log.segments] == [0, 9]
    assert len(jobs) == 1
    log.truncate_to(12)  # a diverging follower: batches 4 and 5 go
    power_loss.crash(log, jobs)

    reopened = open_log(recovery_point=log.recovery_point, segment_bytes=1000)
    assert bodies(read_all(reopened, split)) == [body(i) for i in range(4)]
    assert reopened.log_end_offset == 12


def test_records_below_a_log_start_no_checkpoint_holds_keep_their_epochs_after_a_crash(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, power_loss: PowerLoss
) -> None:
    """Review 13 L3: a moved log start trimmed the leader epoch checkpoint at once, while the
    log start offset's own checkpoint (the LogManager's, periodic) and the deletion of the
    segments before it could still be lost. A machine crash then brought those records back
    below a start whose epoch history no longer knew them: epoch -1 for ListOffsets, and
    OffsetForLeaderEpoch answering their epochs with the new start. The epoch checkpoint now
    keeps them until the log start checkpoint holds the new start (the LogManager's crash
    test); here none does."""
    log = open_log(segment_bytes=1000)  # 3 batches (9 offsets) a segment
    for i in range(8):
        log.append_as_leader(make_batch(3, body=body(i)), leader_epoch=i // 4)  # 1 from 12 on
    log.flush()
    log.advance_log_start(18)  # a follower whose leader's log starts there now
    power_loss.crash(log, [])

    reopened = open_log(segment_bytes=1000)  # from the log start offset checkpointed: none
    assert reopened.log_start_offset == 0
    headers = [read_header(batch) for batch in read_all(reopened, split)]
    assert [h.base_offset for h in headers] == list(range(0, 24, 3))
    cache = reopened.leader_epoch_cache
    assert [cache.epoch_for_offset(h.base_offset) for h in headers] == [0] * 4 + [1] * 4


def write_and_kill(log: Log, make_batch: MakeBatch, count: int, flushed: int) -> None:
    """Append `count` batches (3 a segment), fsync the first `flushed`, leave the fsyncs of
    the rolls waiting; the last batch is of a new epoch, whose checkpoint write fsyncs the
    directory (every segment's name on disk). Then the process is killed."""
    jobs: list[FlushJob] = []
    log.flush_in_background = lambda lg, job: jobs.append(job)
    for i in range(count):
        if i == flushed:
            log.flush()
        log.append_as_leader(make_batch(3, body=body(i)), leader_epoch=1 + (i == count - 1))
    for job in jobs:
        job.close()
    crash(log)


def test_recovery_puts_the_segments_before_the_one_it_truncates_on_disk_first(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, power_loss: PowerLoss
) -> None:
    """Review 13: loading after a killed process truncated a torn segment and fsynced it, and
    not the segments before it, which the process had left to a background fsync. A machine
    crash then kept the truncated segment and lost the earlier ones' ends, and the next load
    cut the log at the hole: the records loaded before went with the segments after it. As
    truncate_to, recovery now fsyncs the segments from the recovery point's on first."""
    log = open_log(segment_bytes=1000)
    write_and_kill(log, make_batch, 9, flushed=2)  # offsets 0-5 on disk, 6-26 in the cache
    last = power_loss.directory / segment_files(power_loss.directory)[-1]
    os.truncate(last, last.stat().st_size - 50)  # the last write was torn

    reopened = open_log(recovery_point=6, segment_bytes=1000)
    assert reopened.log_end_offset == 24
    loaded = read_all(reopened, split)
    power_loss.crash(reopened, [])
    again = open_log(recovery_point=6, segment_bytes=1000)
    assert again.log_end_offset == 24
    assert read_all(again, split) == loaded


def test_a_flush_after_a_restart_puts_the_recovered_segments_on_disk(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, power_loss: PowerLoss
) -> None:
    """What a restart recovers after the recovery point may be in the page cache only (the
    process that wrote it was killed). Before, a loaded segment counted as flushed: a flush
    moved the recovery point past it without an fsync, and a machine crash then lost records
    below the recovery point checkpointed."""
    log = open_log(segment_bytes=1000)
    write_and_kill(log, make_batch, 8, flushed=0)

    reopened = open_log(segment_bytes=1000)
    loaded = read_all(reopened, split)
    reopened.flush()
    assert reopened.recovery_point == 24
    power_loss.crash(reopened, [])
    again = open_log(recovery_point=24, segment_bytes=1000)
    assert read_all(again, split) == loaded


def build_log_with_a_gap(directory: Path, clock: Clock, make_batch: MakeBatch) -> list[int]:
    """Segments of 3 batches (9 offsets) up to LEO 60, the second cut after its first batch
    at a crash (offsets 12-17 lost, those after kept); returns the segments' base offsets."""
    log = Log.open(directory, LogConfig(segment_bytes=1000), 0, clock)
    fill(log, make_batch, 20)
    bases = [s.base_offset for s in log.segments]
    crash(log)
    second = directory / segment_files(directory)[1]
    data = second.read_bytes()
    second.write_bytes(data[: read_header(data).size])
    return bases


def test_loading_deletes_the_segments_after_a_gap(
    tmp_path: Path,
    clock: Clock,
    make_batch: MakeBatch,
    split: Split,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Offsets are contiguous (no compaction): a segment that ends before the next one starts
    lost its end in a crash (the OS wrote a later segment back first), and the segments after
    it are deleted, as after a torn tail, with an ERROR naming the gap. Before (review 13) the
    log loaded with the hole and LEO 60: a replica rejoined the ISR, and a follower fetching
    inside the hole got the batch after it, again and again. A gap wholly before the log
    start offset (checkpointed) loses nothing: that segment is dropped, the later ones kept."""
    config = LogConfig(segment_bytes=1000)
    bases = build_log_with_a_gap(tmp_path / "events-0", clock, make_batch)
    assert bases[:3] == [0, 9, 18]
    with caplog.at_level(logging.ERROR):
        log = Log.open(tmp_path / "events-0", config, 0, clock)
    assert "events-0: offsets 12 to 17 are missing" in caplog.text
    assert [(s.base_offset, s.next_offset) for s in log.segments] == [(0, 9), (9, 12)]
    assert segment_files(tmp_path / "events-0") == [f"{b:020d}.log" for b in (0, 9)]
    assert bodies(read_all(log, split)) == [body(i) for i in range(4)]
    crash(log)

    build_log_with_a_gap(tmp_path / "events-1", clock, make_batch)
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        log = Log.open(tmp_path / "events-1", config, 0, clock, log_start_offset=18)
    assert "missing" not in caplog.text
    assert (log.log_start_offset, log.log_end_offset) == (18, 60)
    assert [s.base_offset for s in log.segments] == bases[2:]
    crash(log)


def test_torn_tail_is_truncated_and_appends_continue(
    open_log: OpenLog,
    make_batch: MakeBatch,
    split: Split,
    log_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = open_log(segment_bytes=1000)
    fill(log, make_batch, 10)
    crash(log)
    last = log_dir / segment_files(log_dir)[-1]
    with open(last, "r+b") as f:
        f.truncate(last.stat().st_size - 50)  # half of the last batch is lost

    with caplog.at_level(logging.WARNING):
        reopened = open_log(recovery_point=log.recovery_point, segment_bytes=1000)
    assert "truncating" in caplog.text
    assert reopened.log_end_offset == 27
    assert bodies(read_all(reopened, split)) == [body(i) for i in range(9)]
    fill(reopened, make_batch, 1)
    assert read_header(read_all(reopened, split)[-1]).base_offset == 27


def test_a_torn_batch_below_the_recovery_point_at_its_last_index_entry_is_rescanned(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, log_dir: Path
) -> None:
    """Review 21 #1: recovery trusted the index entries below the recovery point and scanned
    from the last one; when the batch there was the torn one (the disk lost data after its
    fsync), nothing was scanned, and the LEO went back to the base offset over the whole
    batches before it: the next append reused their offsets. It rescans the segment now."""
    log = open_log(index_interval_bytes=0)  # an index entry for every batch
    fill(log, make_batch, 4)
    log.flush()
    recovery_point = log.log_end_offset
    last_position = log.segments[-1].find_batch(9)[0]
    crash(log)
    with open(log_dir / "00000000000000000000.log", "r+b") as f:
        f.truncate(last_position + 100)  # the last batch torn, its header whole
    reopened = open_log(recovery_point=recovery_point, index_interval_bytes=0)
    assert reopened.log_end_offset == 9
    assert bodies(read_all(reopened, split)) == [body(i) for i in range(3)]


def test_crc_corrupted_tail_is_truncated(
    open_log: OpenLog,
    make_batch: MakeBatch,
    split: Split,
    log_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = open_log()
    fill(log, make_batch, 10)
    crash(log)
    path = log_dir / "00000000000000000000.log"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01  # a flipped bit in the last batch's records
    path.write_bytes(data)

    with caplog.at_level(logging.WARNING):
        reopened = open_log()
    assert "CRC mismatch" in caplog.text
    assert reopened.log_end_offset == 27
    assert bodies(read_all(reopened, split)) == [body(i) for i in range(9)]


def test_what_recovery_truncates_and_deletes_is_on_disk_before_the_log_opens(
    open_log: OpenLog,
    make_batch: MakeBatch,
    log_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As truncate_to: else a second crash could bring back the dropped tail and the deleted
    later segments, CRCs good, around the records appended since."""
    log = open_log(segment_bytes=1000)
    fill(log, make_batch, 12)
    assert len(log.segments) > 2
    crash(log)
    first = log_dir / "00000000000000000000.log"
    data = bytearray(first.read_bytes())
    data[-10] ^= 0x01  # the first segment's last batch is corrupt: later segments go
    first.write_bytes(data)
    synced = record_fsyncs(monkeypatch)
    reopened = open_log(segment_bytes=1000)
    assert len(reopened.segments) == 1
    assert {first.name, log_dir.name} <= set(synced)


def test_garbage_after_the_last_batch_is_truncated(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, log_dir: Path
) -> None:
    log = open_log()
    fill(log, make_batch, 3)
    crash(log)
    with open(log_dir / "00000000000000000000.log", "ab") as f:
        f.write(b"\x00" * 100)  # preallocated space or a lost write
    reopened = open_log()
    assert reopened.log_end_offset == 9
    assert len(read_all(reopened, split)) == 3


def test_recovery_of_an_early_segment_deletes_the_later_ones(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, log_dir: Path
) -> None:
    log = open_log(segment_bytes=1000)
    fill(log, make_batch, 20)
    crash(log)
    second = log_dir / segment_files(log_dir)[1]
    data = bytearray(second.read_bytes())
    data[-10] ^= 0x01
    second.write_bytes(data)
    reopened = open_log(segment_bytes=1000)  # recovery point 0: everything is checked
    assert len(reopened.segments) == 2
    assert segment_files(log_dir) == segment_files(log_dir)[:2]
    assert reopened.log_end_offset == reopened.segments[1].next_offset
    assert bodies(read_all(reopened, split)) == [
        body(i) for i in range(reopened.log_end_offset // 3)
    ]


def test_data_before_the_recovery_point_is_trusted(
    open_log: OpenLog, make_batch: MakeBatch, split: Split, log_dir: Path
) -> None:
    log = open_log(segment_bytes=1000)
    fill(log, make_batch, 20)
    log.flush()
    log.close()
    first = log_dir / "00000000000000000000.log"
    data = bytearray(first.read_bytes())
    data[-10] ^= 0x01  # undetectable without a CRC check
    first.write_bytes(data)
    # Below the recovery point nothing is CRC-checked: the log loads whole.
    reopened = open_log(recovery_point=60, segment_bytes=1000)
    assert reopened.log_end_offset == 60
    crash(reopened)
    # From recovery point 0 the damage is found.
    assert open_log(recovery_point=0, segment_bytes=1000).log_end_offset < 60


def test_deleted_indexes_are_rebuilt(
    open_log: OpenLog,
    make_batch: MakeBatch,
    split: Split,
    log_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = open_log(segment_bytes=2000, index_interval_bytes=300)
    fill(log, make_batch, 30)
    original = {p.name: p.read_bytes() for p in log_dir.glob("*index")}
    assert any(original.values())
    log.close()
    for name in original:
        (log_dir / name).unlink()

    with caplog.at_level(logging.WARNING):
        reopened = open_log(
            recovery_point=log.recovery_point, segment_bytes=2000, index_interval_bytes=300
        )
    assert "index files missing" in caplog.text
    assert {p.name: p.read_bytes() for p in log_dir.glob("*index")} == original
    assert bodies(read_all(reopened, split)) == [body(i) for i in range(30)]
    for offset in (0, 31, 46, 89):
        first = read_header(split(reopened.read(offset, 1))[0])
        assert first.base_offset <= offset <= first.last_offset


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[:-3],  # torn entry
        lambda raw: raw[8:16] + raw[:8] + raw[16:],  # out of order
        lambda raw: raw[:-4] + (10**6).to_bytes(4, "big"),  # points past the segment
        lambda raw: raw[:-4] + (int.from_bytes(raw[-4:], "big") + 1).to_bytes(4, "big"),
    ],
    ids=["torn", "unordered", "past-the-end", "off-by-one-position"],
)
def test_corrupt_index_is_rebuilt(
    open_log: OpenLog,
    make_batch: MakeBatch,
    split: Split,
    log_dir: Path,
    damage: Callable[[bytes], bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = open_log(segment_bytes=2000, index_interval_bytes=300)
    fill(log, make_batch, 30)
    log.close()
    index = log_dir / "00000000000000000000.index"
    original = index.read_bytes()
    assert len(original) >= 16
    index.write_bytes(damage(original))

    with caplog.at_level(logging.WARNING):
        reopened = open_log(
            recovery_point=log.recovery_point, segment_bytes=2000, index_interval_bytes=300
        )
    assert "00000000000000000000.index" in caplog.text
    assert index.read_bytes() == original
    assert bodies(read_all(reopened, split)) == [body(i) for i in range(30)]
    assert reopened.log_end_offset == 90


def test_corrupt_time_index_is_rebuilt(
    open_log: OpenLog, make_batch: MakeBatch, log_dir: Path
) -> None:
    log = open_log(segment_bytes=2000, index_interval_bytes=300)
    for i in range(30):
        log.append_as_leader(make_batch(3, timestamp=T0 + i), leader_epoch=1)
    log.close()
    index = log_dir / "00000000000000000000.timeindex"
    original = index.read_bytes()
    index.write_bytes(original[12:24] + original[:12] + original[24:])
    open_log(recovery_point=log.recovery_point, segment_bytes=2000, index_interval_bytes=300)
    assert index.read_bytes() == original


def test_open_removes_stray_and_orphan_files(
    open_log: OpenLog, make_batch: MakeBatch, log_dir: Path
) -> None:
    log = open_log()
    fill(log, make_batch, 2)
    log.close()
    strays = [
        "00000000000000000000.log.deleted",
        "00000000000000000007.index.deleted",
        "00000000000000000003.log.cleaned",
        "leader-epoch-checkpoint.tmp",
        "00000000000000000099.index",
        "00000000000000000099.timeindex",
    ]
    for name in strays:
        (log_dir / name).write_bytes(b"junk")
    reopened = open_log(recovery_point=log.recovery_point)
    assert sorted(p.name for p in log_dir.iterdir()) == [
        "00000000000000000000.index",
        "00000000000000000000.log",
        "00000000000000000000.timeindex",
        "leader-epoch-checkpoint",
    ]
    assert reopened.log_end_offset == 6


def test_open_creates_an_empty_log(open_log: OpenLog, log_dir: Path) -> None:
    log = open_log()
    assert (log.log_start_offset, log.log_end_offset, log.size_bytes) == (0, 0, 0)
    assert segment_files(log_dir) == ["00000000000000000000.log"]


def test_leader_epochs_past_the_recovered_end_are_forgotten(
    open_log: OpenLog, make_batch: MakeBatch, log_dir: Path
) -> None:
    log = open_log()
    log.append_as_follower(leader_batches(make_batch, 0, 2, epoch=1))
    log.append_as_follower(leader_batches(make_batch, 4, 1, epoch=2))
    assert log.leader_epoch_cache.epoch_entries == [EpochEntry(1, 0), EpochEntry(2, 4)]
    crash(log)
    segment = log_dir / "00000000000000000000.log"
    os.truncate(segment, segment.stat().st_size - 1)
    reopened = open_log()
    assert reopened.log_end_offset == 4
    assert reopened.leader_epoch_cache.epoch_entries == [EpochEntry(1, 0)]


def test_a_log_renamed_for_deletion_is_out_of_the_way(
    open_log: OpenLog, make_batch: MakeBatch, log_dir: Path
) -> None:
    log = open_log()
    fill(log, make_batch, 2)
    renamed = log.rename_for_deletion()
    assert not log_dir.exists()
    assert list(log_dir.parent.iterdir()) == [renamed]
    assert renamed.name.startswith(f"{log_dir.name}.") and renamed.name.endswith("-delete")
