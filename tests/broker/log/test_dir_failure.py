"""A log dir whose disk fails is reported once, by every kind of write the broker makes there,
and nothing but the disk's errors takes it offline. The errors are the OS's own: a file size
limit (RLIMIT_FSIZE) makes a write past it fail with EFBIG, as a full disk fails one with
ENOSPC."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.broker.log.clock import Clock
from tidewater.broker.config import BrokerConfig
from tidewater.broker.log import index as index_module
from tidewater.broker.log.checkpoints import OffsetCheckpointWriter
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.dir_failure import HALT_EXIT_CODE, LogDirFailureChannel
from tidewater.broker.log.manager import LogManager
from tidewater.broker.server import BrokerServer
from tidewater.errors import CorruptMessage, OffsetOutOfRange, StorageError

MakeBatch = Callable[..., bytearray]
CONFIG = LogConfig(segment_bytes=1 << 20)


class Failures:
    """A channel whose failures are recorded rather than stopping the test process."""

    def __init__(self) -> None:
        self.seen: list[tuple[Path, BaseException]] = []
        self.channel = LogDirFailureChannel(lambda d, e: self.seen.append((d, e)))

    def errnos(self) -> list[tuple[Path, int | None]]:
        return [(d, e.errno if isinstance(e, OSError) else None) for d, e in self.seen]


@pytest.fixture
def failures() -> Failures:
    return Failures()


@pytest.fixture
def manager(tmp_path: Path, clock: Clock, failures: Failures) -> Iterator[LogManager]:
    started = LogManager([tmp_path / "disk"], CONFIG, clock, failures.channel)
    yield started
    with contextlib.suppress(Exception):
        started.shutdown()


@contextlib.contextmanager
def files_limited_to(size: int) -> Iterator[None]:
    """No file of this process grows past `size` bytes while inside."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def limit_past_end(manager: LogManager) -> contextlib.AbstractContextManager[None]:
    """Files may not grow past the active segment's end (plus a little)."""
    log = manager.get_or_create_log("t", 0, CONFIG)
    return files_limited_to(log.segments[-1].size + 10)


@pytest.mark.parametrize("off_loop", [False, True], ids=["inline", "worker-thread"])
async def test_a_leader_append_the_disk_refuses_takes_the_log_dir_offline(
    manager: LogManager,
    failures: Failures,
    make_batch: MakeBatch,
    off_loop: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if off_loop:
        monkeypatch.setattr("tidewater.broker.log.log.OFF_LOOP_WRITE_BYTES", 0)
    log = manager.get_or_create_log("t", 0, CONFIG)
    await log.append_batch_off_loop(make_batch(3), 1, lambda _: None)
    with limit_past_end(manager), pytest.raises(StorageError):
        await log.append_batch_off_loop(make_batch(3, body=b"x" * 100), 1, lambda _: None)
    assert failures.errnos() == [(log.dir.parent, errno.EFBIG)]
    assert manager.dir_failures is not None
    assert manager.dir_failures.offline == {log.dir.parent}
    assert log.log_end_offset == 3


async def test_an_index_write_the_disk_refuses_after_an_off_loop_write_is_reported(
    manager: LogManager,
    failures: Failures,
    make_batch: MakeBatch,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The log takes the written batch in on the loop, writing its index entries: an error
    there is the log dir's too, and the appender hears of it rather than waiting for ever."""
    monkeypatch.setattr("tidewater.broker.log.log.OFF_LOOP_WRITE_BYTES", 0)
    log = manager.get_or_create_log("t", 0, LogConfig(index_interval_bytes=1))
    await log.append_batch_off_loop(make_batch(3), 1, lambda _: None)
    enospc = OSError(errno.ENOSPC, "No space left on device")

    def index_write_fails(fd: int, data: bytes) -> int:
        raise enospc

    monkeypatch.setattr(index_module.os, "write", index_write_fails)
    with pytest.raises(StorageError):
        await asyncio.wait_for(
            log.append_batch_off_loop(make_batch(3, body=b"x" * 100), 1, lambda _: None), 10
        )
    assert failures.seen == [(log.dir.parent, enospc)]


async def test_a_follower_append_the_disk_refuses_takes_the_log_dir_offline(
    manager: LogManager, failures: Failures, make_batch: MakeBatch
) -> None:
    log = manager.get_or_create_log("t", 0, CONFIG)
    with limit_past_end(manager), pytest.raises(StorageError):
        await log.append_as_follower_off_loop(
            make_batch(3, body=b"x" * 100, epoch=1), lambda _: None
        )
    assert failures.errnos() == [(log.dir.parent, errno.EFBIG)]


def test_a_checkpoint_the_disk_refuses_takes_the_log_dir_offline(
    tmp_path: Path, failures: Failures
) -> None:
    writer = OffsetCheckpointWriter("replication-offset-checkpoint", failures.channel)
    with files_limited_to(4), pytest.raises(StorageError):
        writer.write(tmp_path, {("t", 0): 123456})
    assert failures.errnos() == [(tmp_path, errno.EFBIG)]


def test_a_new_leader_epoch_the_disk_refuses_takes_the_log_dir_offline(
    manager: LogManager, failures: Failures
) -> None:
    """The epoch a new leader records is written from outside the log, by the partition."""
    log = manager.get_or_create_log("t", 0, CONFIG)
    with files_limited_to(4), pytest.raises(StorageError):
        log.leader_epoch_cache.assign(5, log.log_end_offset)
    assert failures.errnos() == [(log.dir.parent, errno.EFBIG)]


@pytest.mark.parametrize("background", [False, True], ids=["flush", "background-flush"])
async def test_a_failed_flush_takes_the_log_dir_offline_and_moves_no_recovery_point(
    manager: LogManager,
    failures: Failures,
    make_batch: MakeBatch,
    monkeypatch: pytest.MonkeyPatch,
    background: bool,
) -> None:
    """After a failed fsync the kernel may have dropped the pages it could not write, and the
    next fsync may say all is well: the recovery point must not pass them."""
    log = manager.get_or_create_log("t", 0, CONFIG)
    log.append_as_leader(make_batch(2), 1)
    eio = OSError(errno.EIO, "Input/output error")

    def fsync_fails(fd: int) -> None:
        raise eio

    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(StorageError):
        if background:
            job = log.flush_job(log.log_end_offset)
            assert job is not None
            manager._flush_in_background(log, job)
            assert manager._flushing is not None
            await manager._flushing
        else:
            log.flush()
    assert failures.seen == [(log.dir.parent, eio)]
    assert log.recovery_point == 0


async def test_a_clean_shutdown_waits_for_a_background_flush_and_its_failure(
    tmp_path: Path, failures: Failures, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own fsync of the same file could report clean what the failed one did not write,
    and the recovery points it checkpoints would then skip recovery of those pages."""
    config = BrokerConfig.from_properties(
        {"broker.id": 1, "listeners": "127.0.0.1:0", "log.dirs": str(tmp_path / "disk")}
    )
    server = BrokerServer(config, on_log_dir_failure=failures.channel.failed)
    await server.start()
    log = server.log_manager.get_or_create_log("t", 0, CONFIG)
    log.append_as_leader(make_batch(2), 1)
    started, stopping = threading.Event(), threading.Event()
    eio = OSError(errno.EIO, "Input/output error")
    fsync = os.fsync

    def first_fsync_fails_slowly(fd: int) -> None:
        """The kernel's way: the first fsync after a failed writeback fails, later ones
        of the same file succeed."""
        if started.is_set():
            fsync(fd)
            return
        started.set()
        stopping.wait(10)  # still running when the shutdown begins
        raise eio

    monkeypatch.setattr(os, "fsync", first_fsync_fails_slowly)
    job = log.flush_job(log.log_end_offset)
    assert job is not None
    server.log_manager._flush_in_background(log, job)
    await asyncio.to_thread(started.wait, 10)
    stop = asyncio.ensure_future(server.stop(grace_s=0))
    await asyncio.sleep(0)  # the shutdown has begun
    stopping.set()
    await stop
    assert failures.seen == [(log.dir.parent, eio)]


def test_errors_that_are_not_the_disks_leave_the_log_dir_online(
    manager: LogManager, failures: Failures, make_batch: MakeBatch
) -> None:
    log = manager.get_or_create_log("t", 0, CONFIG)
    log.append_as_leader(make_batch(2), 1)
    with pytest.raises(OffsetOutOfRange):
        log.read(10, 1000)
    with pytest.raises(CorruptMessage):
        log.append_as_follower(b"\x00" * 70)  # not a batch
    # OSErrors too, but a timeout's, a connection's or the process's limits, not the disk's.
    too_many_files = OSError(errno.EMFILE, "Too many open files")
    for error in (TimeoutError(), ConnectionResetError(), too_many_files):
        with pytest.raises(type(error)), failures.channel.guard(log.dir.parent):
            raise error
    assert failures.seen == []


def test_a_broker_stops_at_once_when_a_log_dir_fails(tmp_path: Path) -> None:
    code = (
        "from pathlib import Path\n"
        "from tidewater.broker.log.dir_failure import LogDirFailureChannel\n"
        "LogDirFailureChannel().failed(Path('/data/disk-1'), OSError(28, 'No space left'))\n"
        "print('still running')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == HALT_EXIT_CODE
    assert "still running" not in done.stdout
    assert "stopping the broker: log dir /data/disk-1 failed" in done.stderr
