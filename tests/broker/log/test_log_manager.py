from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest.mock import patch

import pytest

from tests.broker.log.clock import Clock
from tidewater.broker.log import manager as manager_mod
from tidewater.broker.log.checkpoints import EpochEntry, LeaderEpochCheckpoint, OffsetCheckpoint
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.log import FlushJob, Log
from tidewater.broker.log.manager import (
    CLEAN_SHUTDOWN_FILE,
    LOG_START_OFFSET_CHECKPOINT,
    RECOVERY_POINT_CHECKPOINT,
    LogManager,
)
from tidewater.errors import OffsetOutOfRange, StorageError, UnknownTopicOrPartition
from tidewater.local.wait import eventually
from tidewater.records.header import BatchHeader, read_header

MakeBatch = Callable[..., bytearray]
SMALL = LogConfig(segment_bytes=1000)


@pytest.fixture
def dirs(tmp_path: Path) -> list[Path]:
    return [tmp_path / "disk-a", tmp_path / "disk-b"]


@pytest.fixture
def managers(dirs: list[Path], clock: Clock) -> Iterator[Callable[..., LogManager]]:
    """start(config=LogConfig()): a LogManager over `dirs`; left-over ones are shut down."""
    started: list[LogManager] = []

    def start(config: LogConfig = SMALL) -> LogManager:
        started.append(LogManager(dirs, config, clock))
        return started[-1]

    yield start
    for manager in started:
        with contextlib.suppress(Exception):
            manager.shutdown()


def append(manager: LogManager, make_batch: MakeBatch, topic: str, partition: int, n: int) -> None:
    for i in range(n):
        manager.get_or_create_log(topic, partition, SMALL).append_as_leader(
            make_batch(2, body=f"{topic}/{partition}/{i}".encode() * 10), leader_epoch=1
        )


async def test_new_partitions_go_to_the_emptiest_log_dir(
    managers: Callable[..., LogManager], dirs: list[Path]
) -> None:
    manager = managers()
    placed = [manager.get_or_create_log("t", p, SMALL).dir.parent for p in range(6)]
    assert placed.count(dirs[0]) == placed.count(dirs[1]) == 3
    await manager.delete_logs([("t", 0), ("t", 2), ("t", 4)])
    fresh = {manager.get_or_create_log("u", p, SMALL).dir.parent for p in range(3)}
    assert fresh == {placed[0]}
    assert manager.get_or_create_log("t", 1, SMALL) is manager.get_log("t", 1)


def test_get_or_create_applies_the_new_config(managers: Callable[..., LogManager]) -> None:
    manager = managers()
    log = manager.get_or_create_log("t", 0, SMALL)
    updated = LogConfig(segment_bytes=5000, retention_ms=10)
    assert manager.get_or_create_log("t", 0, updated) is log
    assert log.config == updated


def test_restart_reloads_every_log(
    managers: Callable[..., LogManager], make_batch: MakeBatch, dirs: list[Path]
) -> None:
    manager = managers()
    for partition in range(4):
        append(manager, make_batch, "orders-eu", partition, 10 + partition)
    manager.get_log("orders-eu", 1).leader_epoch_cache.assign(3, 20)
    before = {p: bytes(manager.get_log("orders-eu", p).read(0, 1 << 20)) for p in range(4)}
    manager.shutdown()

    for log_dir in dirs:
        checkpoint = OffsetCheckpoint(log_dir / RECOVERY_POINT_CHECKPOINT).read()
        assert len(checkpoint) == 2
        assert all(offset == 2 * (10 + p) for (_, p), offset in checkpoint.items())

    restarted = managers()
    for partition in range(4):
        log = restarted.get_log("orders-eu", partition)
        assert log is not None
        assert log.log_end_offset == log.recovery_point == 2 * (10 + partition)
        assert bytes(log.read(0, 1 << 20)) == before[partition]
    reloaded = restarted.get_log("orders-eu", 1)
    assert reloaded is not None
    assert reloaded.leader_epoch_cache.epoch_entries[-1] == EpochEntry(3, 20)
    assert restarted.get_log("orders-eu", 4) is None


def test_a_log_start_inside_a_segment_survives_a_restart(
    managers: Callable[..., LogManager], make_batch: MakeBatch
) -> None:
    """Kafka's log-start-offset-checkpoint: a log start offset inside a segment (a follower's,
    set by its leader's) is not a segment base, and only the checkpoint keeps it."""
    manager = managers()
    append(manager, make_batch, "t", 0, 30)
    log = manager.get_log("t", 0)
    assert log is not None
    inside = log.segments[1].base_offset + 2
    log.advance_log_start(inside)
    manager.shutdown()
    assert OffsetCheckpoint(log.dir.parent / LOG_START_OFFSET_CHECKPOINT).read() == {
        ("t", 0): inside
    }

    reloaded = managers().get_log("t", 0)
    assert reloaded is not None
    assert reloaded.log_start_offset == inside < reloaded.segments[1].base_offset
    with pytest.raises(OffsetOutOfRange):
        reloaded.read(inside - 1, 1 << 20)


def test_a_truncation_below_the_log_start_checkpoints_it_at_once(
    managers: Callable[..., LogManager], make_batch: MakeBatch
) -> None:
    """Else a crash after appending again past the old log start would have the next start
    hide the records below it."""
    manager = managers()
    log = manager.get_or_create_log("t", 0, LogConfig())  # one segment, never flushed
    for _ in range(30):
        log.append_as_leader(make_batch(2), leader_epoch=1)
    log.advance_log_start(40)
    manager.checkpoint_log_start_offsets()
    checkpoint = OffsetCheckpoint(log.dir.parent / LOG_START_OFFSET_CHECKPOINT)
    assert checkpoint.read() == {("t", 0): 40}
    log.truncate_to(20)
    assert (log.log_start_offset, log.recovery_point) == (20, 20)  # the recovery point rose
    assert checkpoint.read() == {("t", 0): 20}


def copies_before_each_write(
    log_dir: Path, into: Path, monkeypatch: pytest.MonkeyPatch
) -> list[Path]:
    """From now on, a copy of `log_dir` as a killed broker would leave it (every write before
    in the page cache) before each fsync, rename, deletion and truncation."""
    copies: list[Path] = []

    def copying(call: Callable[..., object]) -> Callable[..., object]:
        def copy_first(*args: object, **kwargs: object) -> object:
            copies.append(into / str(len(copies)))
            shutil.copytree(log_dir, copies[-1])
            return call(*args, **kwargs)

        return copy_first

    for name in ("fsync", "replace", "rename", "unlink", "ftruncate"):
        monkeypatch.setattr(os, name, copying(getattr(os, name)))
    return copies


def headers_from_log_start(lg: Log) -> list[BatchHeader]:
    headers: list[BatchHeader] = []
    offset = lg.log_start_offset
    while offset < lg.log_end_offset:
        data = bytes(lg.read(offset, 1 << 20))
        position = 0
        while position < len(data):
            headers.append(read_header(data, position))
            position += headers[-1].size
        offset = headers[-1].next_offset
    return headers


def test_after_a_crash_anywhere_every_record_from_the_log_start_on_has_its_epoch(
    managers: Callable[..., LogManager],
    make_batch: MakeBatch,
    clock: Clock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 13 L3: the leader epoch checkpoint let go of the epochs before a log start as it
    moved (as Kafka's), the log-start-offset-checkpoint only in the next period, or the other
    way round for a truncation that lowered the log start. A crash in between brought the
    records from the older log start back with no epoch: -1 in ListOffsets, their epochs
    answered with the newer start in OffsetForLeaderEpoch. The epoch checkpoint now lets go of
    them once the log start offset checkpoint holds the newer start. Every state a killed
    broker could leave is loaded again (a machine crash: test_log's)."""
    manager = managers()
    log = manager.get_or_create_log("t", 0, SMALL)
    for i in range(20):  # 3 batches (9 offsets) a segment, a new epoch every 4 batches
        log.append_as_leader(make_batch(3, body=bytes(200)), leader_epoch=i // 4)
    manager.checkpoint_log_start_offsets()
    copies = copies_before_each_write(log.log_dir, tmp_path / "crashes", monkeypatch)
    log.advance_log_start(22)  # its leader's: inside a segment and a batch
    manager.checkpoint_log_start_offsets()
    log = manager.get_or_create_log("t", 0, LogConfig(segment_bytes=1000, retention_bytes=0))
    log.delete_retention_segments(clock.now, high_watermark=40)
    assert log.log_start_offset == 36
    log.advance_log_start(40)
    log.truncate_to(40)  # a diverging follower: the log now ends, and starts, at 39
    assert log.log_start_offset == log.log_end_offset == 39
    for _ in range(2):
        log.append_as_leader(make_batch(3, body=bytes(200)), leader_epoch=9)
    manager.checkpoint_log_start_offsets()
    monkeypatch.undo()
    shutil.copytree(log.log_dir, tmp_path / "crashes" / "last")

    for crashed in [*copies, tmp_path / "crashes" / "last"]:
        restarted = LogManager([crashed], SMALL, clock)
        reloaded = restarted.get_log("t", 0)
        assert reloaded is not None
        start = reloaded.log_start_offset
        for header in headers_from_log_start(reloaded):
            epoch = reloaded.leader_epoch_cache.epoch_for_offset(max(header.base_offset, start))
            assert (crashed.name, epoch) == (crashed.name, header.partition_leader_epoch)
        restarted.shutdown()
    assert len(copies) > 20


CRASHING_BROKER = """
import os, sys
from pathlib import Path
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log import manager as manager_mod
from tidewater.broker.log.log import FlushJob, Log
from tidewater.broker.log.manager import LogManager
from tidewater.records.batch import Record, build_batch

config = LogConfig(segment_bytes=1000)
manager = LogManager([Path(d) for d in sys.argv[1:]], config)
log = manager.get_or_create_log("t", 0, config)
for i in range(35):
    log.append_as_leader(bytearray(build_batch([Record(value=bytes(100))] * 2)), leader_epoch=1)
    if i == 29:
        manager.checkpoint_recovery_points()
os._exit(0)  # killed: no flush, no close, no checkpoint
"""


def test_restart_after_a_crash_recovers_from_the_checkpointed_points(
    managers: Callable[..., LogManager], dirs: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    subprocess.run([sys.executable, "-c", CRASHING_BROKER, *map(str, dirs)], check=True)
    checkpointed = OffsetCheckpoint(dirs[0] / RECOVERY_POINT_CHECKPOINT).read()[("t", 0)]
    assert 0 < checkpointed < 60
    last_segment = sorted((dirs[0] / "t-0").glob("*.log"))[-1]
    os.truncate(last_segment, last_segment.stat().st_size - 7)  # the last batch is torn

    with caplog.at_level(logging.WARNING):
        log = managers().get_log("t", 0)
    assert "truncating" in caplog.text
    assert log.log_end_offset == 68
    last = read_header(bytes(log.read(66, 1 << 20)))
    assert (last.base_offset, last.next_offset) == (66, 68)


@pytest.mark.parametrize(
    ("truncate", "recovery_point"),
    [(lambda lg: lg.truncate_to(20), 20), (lambda lg: lg.truncate_fully_and_start_at(30), 30)],
    ids=["truncate_to", "truncate_fully_and_start_at"],
)
def test_a_truncation_below_the_recovery_point_checkpoints_it_at_once(
    managers: Callable[..., LogManager],
    make_batch: MakeBatch,
    truncate: Callable[[Log], None],
    recovery_point: int,
) -> None:
    manager = managers()
    append(manager, make_batch, "t", 0, 30)
    log = manager.get_log("t", 0)
    assert log is not None
    log.flush()
    manager.checkpoint_recovery_points()
    checkpoint = OffsetCheckpoint(log.dir.parent / RECOVERY_POINT_CHECKPOINT)
    assert checkpoint.read() == {("t", 0): 60}
    truncate(log)
    assert log.recovery_point == recovery_point
    assert checkpoint.read() == {("t", 0): recovery_point}


TRUNCATING_BROKER = """
import os, sys
from pathlib import Path
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.manager import LogManager
from tidewater.records.batch import Record, build_batch

manager = LogManager([Path(d) for d in sys.argv[1:]], LogConfig())
log = manager.get_or_create_log("t", 0, LogConfig())
def append(value, epoch):
    log.append_as_leader(bytearray(build_batch([Record(value=value)] * 2)), leader_epoch=epoch)
for i in range(30):
    append(b"first %d" % i, 1)
log.flush()
manager.checkpoint_recovery_points()  # recovery point 60
log.truncate_to(20)  # a follower whose log diverged at 20
for i in range(30):
    append(b"again %d" % i, 2)  # offsets 20 to 79, never flushed
os._exit(0)  # killed: no flush, no close, no checkpoint
"""


def test_a_crash_after_truncating_and_appending_again_verifies_the_new_records(
    managers: Callable[..., LogManager], dirs: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    """The recovery point checkpoint is rewritten when a truncation lowers the recovery point
    (Kafka's LogManager.truncateTo): a restart must check the records appended after the
    truncation, not trust them below the recovery point checkpointed before it."""
    subprocess.run([sys.executable, "-c", TRUNCATING_BROKER, *map(str, dirs)], check=True)
    assert OffsetCheckpoint(dirs[0] / RECOVERY_POINT_CHECKPOINT).read() == {("t", 0): 20}
    segment = dirs[0] / "t-0" / "00000000000000000000.log"
    data = bytearray(segment.read_bytes())
    position = 0
    while (header := read_header(data, position)).base_offset != 30:
        position += header.size
    data[position + header.size - 1] ^= 0x01  # the write of offsets 30-31 did not reach the disk
    segment.write_bytes(data)

    with caplog.at_level(logging.WARNING):
        log = managers().get_log("t", 0)
    assert "CRC mismatch" in caplog.text
    assert log is not None and log.log_end_offset == 30


def test_a_clean_shutdown_leaves_its_broker_epoch_for_the_next_start_only(
    managers: Callable[..., LogManager], dirs: list[Path]
) -> None:
    # KIP-966: the next start registers with it as proof of a clean shutdown. It removes the
    # files at once, so that a later stop that writes none (a crash, or a broker that never
    # registered) does not pass for a clean shutdown.
    first = managers()
    assert first.clean_shutdown_broker_epoch == 0
    first.shutdown(broker_epoch=42)
    assert all((d / CLEAN_SHUTDOWN_FILE).exists() for d in dirs)
    second = managers()
    assert second.clean_shutdown_broker_epoch == 42
    assert not any((d / CLEAN_SHUTDOWN_FILE).exists() for d in dirs)
    second.shutdown()
    assert managers().clean_shutdown_broker_epoch == 0


def test_a_clean_shutdown_needs_the_same_broker_epoch_in_every_log_dir(
    managers: Callable[..., LogManager], dirs: list[Path]
) -> None:
    managers().shutdown(broker_epoch=42)
    (dirs[1] / CLEAN_SHUTDOWN_FILE).unlink()  # e.g. a disk swapped since
    assert managers().clean_shutdown_broker_epoch == 0


def test_corrupt_recovery_checkpoint_means_full_recovery(
    managers: Callable[..., LogManager],
    make_batch: MakeBatch,
    dirs: list[Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager = managers()
    append(manager, make_batch, "t", 0, 10)
    manager.shutdown()
    log_dir = next(d for d in dirs if (d / "t-0").exists())
    (log_dir / RECOVERY_POINT_CHECKPOINT).write_text("0\n7\ngarbage\n")
    with caplog.at_level(logging.WARNING):
        restarted = managers()
    assert "corrupt checkpoint file" in caplog.text
    assert restarted.get_log("t", 0).log_end_offset == 20


async def test_delete_log_removes_it_for_good(
    managers: Callable[..., LogManager], make_batch: MakeBatch, dirs: list[Path]
) -> None:
    manager = managers()
    append(manager, make_batch, "t", 0, 3)
    append(manager, make_batch, "t", 1, 3)
    partition_dir = manager.get_log("t", 0).dir
    await manager.delete_logs([("t", 0)])
    assert not partition_dir.exists()
    assert not list(partition_dir.parent.glob("t-0*"))
    assert manager.get_log("t", 0) is None
    with pytest.raises(UnknownTopicOrPartition):
        await manager.delete_logs([("t", 0)])
    manager.shutdown()
    restarted = managers()
    assert restarted.get_log("t", 0) is None
    assert restarted.get_log("t", 1).log_end_offset == 6


async def test_a_deleted_logs_recovery_point_leaves_the_checkpoint_before_its_files(
    managers: Callable[..., LogManager], make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kafka's asyncDelete checkpoints right away: a crash before the next periodic
    checkpoint must not hand the deleted log's recovery point to a new log of the partition
    (its unsynced records below that point would be trusted without a CRC check). Before the
    files go, too (review 28 #1: a crash while a large log was removed kept it)."""
    manager = managers()
    append(manager, make_batch, "t", 0, 10)
    append(manager, make_batch, "t", 1, 3)
    manager.get_log("t", 0).flush()
    manager.checkpoint_recovery_points()
    log_dir = manager.get_log("t", 0).dir.parent
    checkpoint = OffsetCheckpoint(log_dir / RECOVERY_POINT_CHECKPOINT)
    assert checkpoint.read()[("t", 0)] == 20
    seen_while_removing: list[bool] = []
    monkeypatch.setattr(
        manager_mod,
        "_remove_tree",
        lambda path: seen_while_removing.append(("t", 0) in checkpoint.read()),
    )
    await manager.delete_logs([("t", 0)])
    assert seen_while_removing == [False]
    assert ("t", 0) not in checkpoint.read()


def test_a_start_drops_the_checkpointed_offsets_of_logs_no_longer_there(
    managers: Callable[..., LogManager], make_batch: MakeBatch
) -> None:
    """Review 28 #1: a crash after a log was renamed for deletion (or stray) and before
    the checkpoints were rewritten kept its recovery point and log start there, for a new log
    of the partition to inherit: its first records hidden, its unsynced ones trusted. The
    start rewrites the checkpoints of what it did not load."""
    manager = managers()
    append(manager, make_batch, "t", 0, 10)
    manager.get_log("t", 0).flush()
    manager.checkpoint_recovery_points()
    lg = manager.get_log("t", 0)
    log_dir = lg.dir.parent
    lg.rename_for_deletion()  # and a crash
    manager.shutdown()
    assert ("t", 0) in OffsetCheckpoint(log_dir / RECOVERY_POINT_CHECKPOINT).read()
    restarted = managers()
    assert ("t", 0) not in OffsetCheckpoint(log_dir / RECOVERY_POINT_CHECKPOINT).read()
    assert restarted.get_or_create_log("t", 0, SMALL).log_start_offset == 0


def test_start_finishes_interrupted_deletions_and_skips_strangers(
    managers: Callable[..., LogManager], dirs: list[Path]
) -> None:
    half_deleted = dirs[0] / "t-3.0f1e2d-delete"
    half_deleted.mkdir(parents=True)
    (half_deleted / "00000000000000000000.log").write_bytes(b"old")
    (dirs[0] / "lost+found").mkdir()
    (dirs[0] / "recovery-point-offset-checkpoint.tmp").write_text("half")
    manager = managers()
    assert not half_deleted.exists()
    assert not (dirs[0] / "recovery-point-offset-checkpoint.tmp").exists()
    assert (dirs[0] / "lost+found").exists()
    assert manager.get_log("t", 3) is None


def test_a_log_dir_serves_one_broker_at_a_time(managers: Callable[..., LogManager]) -> None:
    first = managers()
    with pytest.raises(StorageError, match="in use by another process"):
        managers()
    first.shutdown()
    managers()


def test_a_partition_in_two_log_dirs_is_refused(
    managers: Callable[..., LogManager], dirs: list[Path]
) -> None:
    manager = managers()
    assert manager.get_or_create_log("t", 0, SMALL).dir.parent == dirs[0]
    manager.shutdown()
    (dirs[1] / "t-0").mkdir(parents=True)
    with pytest.raises(StorageError, match="t-0 is in two log dirs"):
        managers()


def test_a_thousand_partitions_hold_one_file_descriptor_each(
    managers: Callable[..., LogManager],
) -> None:
    # Earlier tests' garbage (event loops, files) would otherwise close its descriptors
    # whenever the collector runs during this test.
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    manager = managers()
    for partition in range(1000):
        manager.get_or_create_log("many", partition, SMALL)
    assert len(os.listdir("/proc/self/fd")) - before <= 1000 + len(manager.log_dirs)
    manager.shutdown()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


WAIT_S = 10
POLL_S = 0.005


async def test_background_tasks_apply_retention_flush_ms_and_checkpoints(
    managers: Callable[..., LogManager], make_batch: MakeBatch, clock: Clock, dirs: list[Path]
) -> None:
    manager = managers()
    retained = manager.get_or_create_log("old", 0, LogConfig(segment_bytes=1000, retention_bytes=0))
    manager.high_watermark = lambda _: retained.log_end_offset  # every record replicated
    flushed = manager.get_or_create_log("flushy", 0, LogConfig(flush_ms=1000))
    for i in range(10):
        retained.append_as_leader(make_batch(2, body=bytes(300) + bytes([i])), leader_epoch=1)
    flushed.append_as_leader(make_batch(2), leader_epoch=1)
    assert flushed.recovery_point == 0
    checkpoints = [d / RECOVERY_POINT_CHECKPOINT for d in dirs]

    task = asyncio.create_task(
        manager.run_background_tasks(
            retention_check_interval_ms=5,
            flush_check_interval_ms=5,
            recovery_point_checkpoint_interval_ms=5,
        )
    )
    try:
        await eventually(lambda: retained.log_start_offset > 0, WAIT_S, POLL_S)
        assert len(retained.segments) == 1
        await eventually(lambda: all(c.exists() for c in checkpoints), WAIT_S, POLL_S)
        await eventually(
            lambda: (
                OffsetCheckpoint(retained.dir.parent / LOG_START_OFFSET_CHECKPOINT).read()
                == {("old", 0): retained.log_start_offset}
            ),
            WAIT_S,
            POLL_S,
        )
        # Then the epoch checkpoint lets go of the epochs before it (review 13 L3).
        await eventually(
            lambda: (
                LeaderEpochCheckpoint(retained.dir / "leader-epoch-checkpoint").read()
                == [EpochEntry(1, retained.log_start_offset)]
            ),
            WAIT_S,
            POLL_S,
        )
        assert flushed.recovery_point == 0  # flush.ms has not passed on the test clock
        clock.now += 1000
        await eventually(lambda: flushed.recovery_point == 2, WAIT_S, POLL_S)
        await eventually(
            lambda: (
                OffsetCheckpoint(flushed.dir.parent / RECOVERY_POINT_CHECKPOINT).read()
                == {("flushy", 0): 2}
            ),
            WAIT_S,
            POLL_S,
        )
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert task.cancelled()


async def test_rolled_segments_are_flushed_off_the_event_loop(
    managers: Callable[..., LogManager], make_batch: MakeBatch
) -> None:
    manager = managers()
    lg = manager.get_or_create_log("rolling", 0, SMALL)
    threads: set[str] = set()
    run = FlushJob.run

    def run_and_note(job: FlushJob) -> None:
        threads.add(threading.current_thread().name)
        run(job)

    with patch.object(FlushJob, "run", run_and_note):
        for i in range(5):
            lg.append_as_leader(make_batch(2, body=bytes(400) + bytes([i])), leader_epoch=1)
        assert len(lg.segments) == 3
        assert lg.recovery_point == 0  # the appends did not wait for the fsyncs
        await eventually(lambda: lg.recovery_point == lg.segments[-1].base_offset, WAIT_S, POLL_S)
    assert threading.current_thread().name not in threads


# -- stray logs ------------------------------------------------------------------------------


def stray_dirs(dirs: list[Path]) -> list[Path]:
    return sorted(p for d in dirs if d.exists() for p in d.iterdir() if p.name.endswith("-stray"))


async def test_a_stray_log_is_renamed_at_once_and_deleted_after_the_delay(
    managers: Callable[..., LogManager],
    dirs: list[Path],
    make_batch: MakeBatch,
    clock: Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager = managers()
    append(manager, make_batch, "t", 0, 30)
    append(manager, make_batch, "u", 0, 3)
    old_dir = manager._require("t", 0).dir
    manager.checkpoint_recovery_points()
    with caplog.at_level(logging.WARNING):
        await manager.remove_stray_logs({("t", 0): "not assigned here"})
    # Renamed, no longer loaded or served; the other log goes on.
    (stray,) = stray_dirs(dirs)
    assert not old_dir.exists() and stray.parent == old_dir.parent
    assert stray.name.startswith("t-0.")
    assert sorted(p.name for p in stray.iterdir() if p.suffix == ".log")
    assert manager.get_log("t", 0) is None and list(manager.local_logs()) == [("u", 0)]
    assert f"stray log t-0: not assigned here; renamed to {stray}" in caplog.text
    assert "deleted in 60000 ms" in caplog.text
    # Its recovery point would otherwise apply to a new log of the partition.
    assert ("t", 0) not in OffsetCheckpoint(old_dir.parent / RECOVERY_POINT_CHECKPOINT).read()
    manager.get_or_create_log("u", 0, SMALL).append_as_leader(make_batch(1), leader_epoch=1)

    clock.now += 59_999
    assert await manager.delete_due_strays() == 1
    assert stray.exists()
    clock.now += 1
    assert await manager.delete_due_strays() is None
    assert not stray.exists()
    assert manager.get_log("u", 0) is not None


async def test_a_restart_deletes_a_stray_log_left_over_rather_than_loading_it(
    managers: Callable[..., LogManager],
    dirs: list[Path],
    make_batch: MakeBatch,
    clock: Clock,
) -> None:
    first = managers()
    append(first, make_batch, "t", 0, 30)
    await first.remove_stray_logs({("t", 0): "not assigned here"})
    first.shutdown()  # before its delay was over
    (stray,) = stray_dirs(dirs)

    restarted = managers()
    assert restarted.get_log("t", 0) is None
    # A new log of the partition (a topic of that name created again) starts empty.
    assert restarted.get_or_create_log("t", 0, SMALL).log_end_offset == 0
    assert await restarted.delete_due_strays() == 60_000
    clock.now += 60_000
    assert await restarted.delete_due_strays() is None
    assert not stray.exists()
    assert restarted.get_log("t", 0) is not None


async def test_a_log_of_a_topic_the_view_does_not_know_is_kept_aside_not_deleted(
    managers: Callable[..., LogManager],
    dirs: list[Path],
    make_batch: MakeBatch,
    clock: Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Review 37 #1: a controller on an emptied etcd sent a view with no topics, and a
    restarted broker deleted every log it held a minute later. Such a log is renamed out of
    the way (a topic created again under its name starts empty) but kept, before and after
    a restart, for an operator."""
    first = managers()
    append(first, make_batch, "t", 0, 30)
    with caplog.at_level(logging.ERROR):
        await first.remove_stray_logs({("t", 0): "topic t is not in the view"}, keep=[("t", 0)])
    assert "renamed to" in caplog.text and "kept" in caplog.text
    (orphaned,) = [p for d in dirs for p in d.iterdir() if p.name.endswith("-orphaned")]
    assert first.get_log("t", 0) is None
    clock.now += 10 * 60_000
    assert await first.delete_due_strays() is None
    first.shutdown()

    restarted = managers()
    assert restarted.get_log("t", 0) is None
    clock.now += 10 * 60_000
    assert await restarted.delete_due_strays() is None
    assert sorted(p.name for p in orphaned.iterdir() if p.suffix == ".log")


async def test_the_background_tasks_delete_a_stray_log_when_its_delay_is_over(
    dirs: list[Path], make_batch: MakeBatch
) -> None:
    manager = LogManager(dirs, SMALL, file_delete_delay_ms=100)
    background = asyncio.create_task(manager.run_background_tasks())
    try:
        append(manager, make_batch, "t", 0, 3)
        await manager.remove_stray_logs({("t", 0): "not assigned here"})
        assert stray_dirs(dirs)
        await eventually(lambda: not stray_dirs(dirs), 10)
    finally:
        background.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await background
        manager.shutdown()


async def test_deleting_many_logs_lets_the_event_loop_run_between_them(
    managers: Callable[..., LogManager],
) -> None:
    """Review 28 #2: a StopReplica deleting a topic of thousands of partitions held the event
    loop (rename, fsyncs, checkpoint rewrites and the files' removal, each log in turn) past
    the broker's session timeout. It yields between logs, rewrites each dir's checkpoints
    once, and removes the files on a worker thread."""
    manager = managers()
    tps = [("t", p) for p in range(20)]
    for tp in tps:
        manager.get_or_create_log(*tp, SMALL)
    turns = 0

    async def ticking() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(ticking())
    await asyncio.sleep(0)
    started = turns
    await manager.delete_logs(tps)
    ticker.cancel()
    assert turns - started >= len(tps)
    assert manager.local_logs() == set()
