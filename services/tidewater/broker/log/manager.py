"""Every partition log on a broker, across its log dirs (Kafka's LogManager).

Each log dir holds partition directories, a `recovery-point-offset-checkpoint` and a
`log-start-offset-checkpoint`; a `.lock` file keeps a second broker out. A clean shutdown
leaves a `clean-shutdown` file naming the broker epoch (Kafka's `.kafka_cleanshutdown`,
KIP-966); the next start reads it and removes it at once. Background work
(retention, flush.ms, recovery point and log start offset checkpoints) runs in
`run_background_tasks` on the broker's event loop; the fsyncs of rolled segments, and of the
producer state snapshots taken when they roll, run in a worker thread, one after the other,
so an append never waits for the disk.

Stray logs (tidewater.broker.stray_logs) are renamed `<topic>-<partition>.<id>-stray` at once,
so that nothing loads or serves them again, and deleted file.delete.delay.ms later, as Kafka
deletes its logs; a start finds the ones left and deletes them after that delay too.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, KeysView, Mapping
from pathlib import Path

from tidewater.broker import background
from tidewater.broker.log.checkpoints import (
    TEMP_SUFFIX,
    CorruptCheckpoint,
    OffsetCheckpoint,
    OffsetCheckpointWriter,
    fsync_dir,
    write_atomically,
)
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.dir_failure import LogDirFailureChannel, guarded
from tidewater.broker.log.log import (
    DELETE_DIR_SUFFIX,
    ORPHANED_DIR_SUFFIX,
    STRAY_DIR_SUFFIX,
    FlushJob,
    Log,
    parse_partition_dir,
    wall_clock_ms,
)
from tidewater.broker.topic_ids import (
    read_partition_metadata,
    topic_id_text,
    write_partition_metadata,
)
from tidewater.errors import StorageError, UnknownTopicOrPartition

log = logging.getLogger(__name__)

RECOVERY_POINT_CHECKPOINT = "recovery-point-offset-checkpoint"
CLEAN_SHUTDOWN_FILE = "clean-shutdown"
LOG_START_OFFSET_CHECKPOINT = "log-start-offset-checkpoint"
LOCK_FILE = ".lock"
# Kafka's file.delete.delay.ms: how long a stray log stays on disk, renamed, before deletion.
FILE_DELETE_DELAY_MS = 60000
TopicPartition = tuple[str, int]


class LogManager:
    def __init__(
        self,
        log_dirs: list[Path],
        default_config: LogConfig,
        time_ms: Callable[[], int] = wall_clock_ms,
        dir_failures: LogDirFailureChannel | None = None,
        file_delete_delay_ms: int = FILE_DELETE_DELAY_MS,
    ) -> None:
        """Lock every log dir and load every partition in it. An I/O error in a log dir
        after that goes to `dir_failures` (see dir_failure)."""
        self.log_dirs = [Path(d) for d in log_dirs]
        self.default_config = default_config
        self._time_ms = time_ms
        self.dir_failures = dir_failures
        self.file_delete_delay_ms = file_delete_delay_ms
        # Renamed stray log directories → when to delete them (ms); set when one is added.
        self._strays: dict[Path, int] = {}
        self._stray_added = asyncio.Event()
        self._logs: dict[TopicPartition, Log] = {}
        self._recovery_point_writer = OffsetCheckpointWriter(
            RECOVERY_POINT_CHECKPOINT, dir_failures
        )
        self._log_start_writer = OffsetCheckpointWriter(LOG_START_OFFSET_CHECKPOINT, dir_failures)
        # Set by the ReplicaManager: a hosted partition's HW, else -1. Retention deletes only
        # segments the HW has passed: none of a log whose HW is not known yet.
        self.high_watermark: Callable[[TopicPartition], int] = lambda _: -1
        # Told when retention moves a log's start: fetch answers carry it.
        self.log_start_moved: Callable[[TopicPartition], object] = lambda _: None
        # The partitions in each log dir, for placement and per-dir checkpoints.
        self._partitions_in: dict[Path, set[TopicPartition]] = {d: set() for d in self.log_dirs}
        self._lock_fds: list[int] = []
        self._closed = False
        # The last background flush; each waits for the one before, so recovery points only
        # move over what is on disk.
        self._flushing: asyncio.Task[None] | None = None
        try:
            for log_dir in self.log_dirs:
                log_dir.mkdir(parents=True, exist_ok=True)
                self._lock(log_dir)
            # The broker epoch the last run shut down cleanly in (every log flushed), else 0.
            self.clean_shutdown_broker_epoch = self._take_clean_shutdown_epoch()
            for log_dir in self.log_dirs:
                self._load_dir(log_dir)
        except BaseException:
            self._close_all()
            raise

    def _lock(self, log_dir: Path) -> None:
        fd = os.open(log_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StorageError(f"log dir {log_dir} is in use by another process") from None
        self._lock_fds.append(fd)

    def _take_clean_shutdown_epoch(self) -> int:
        """The broker epoch every log dir's clean-shutdown file names, else 0; the files are
        removed (durably) before this run can append, so that a crash later in this run is
        never taken for a clean shutdown."""
        epochs = set()
        for log_dir in self.log_dirs:
            path = log_dir / CLEAN_SHUTDOWN_FILE
            try:
                epochs.add(int(json.loads(path.read_bytes())["broker_epoch"]))
            except FileNotFoundError:
                epochs.add(0)
                continue
            except (ValueError, KeyError, TypeError) as e:
                log.warning("%s is unreadable (%s): not a clean shutdown", path, e)
                epochs.add(0)
            path.unlink()
            fsync_dir(log_dir)
        return epochs.pop() if len(epochs) == 1 else 0

    def _load_dir(self, log_dir: Path) -> None:
        try:
            recovery_points = OffsetCheckpoint(log_dir / RECOVERY_POINT_CHECKPOINT).read()
        except CorruptCheckpoint as e:
            log.warning("%s; recovering every log in %s in full", e, log_dir)
            recovery_points = {}
        try:
            log_starts = OffsetCheckpoint(log_dir / LOG_START_OFFSET_CHECKPOINT).read()
        except CorruptCheckpoint as e:
            # Kafka's way too: the logs start at their first segments, records that were
            # below their log starts readable again until retention or the leader moves them.
            log.warning("%s; every log in %s starts at its first segment", e, log_dir)
            log_starts = {}
        for child in sorted(log_dir.iterdir()):
            if child.name.endswith(TEMP_SUFFIX) and child.is_file():
                child.unlink()
            if not child.is_dir():
                continue
            if child.name.endswith(DELETE_DIR_SUFFIX):
                log.info("%s: finishing an interrupted log deletion", child)
                shutil.rmtree(child)
                continue
            if child.name.endswith(ORPHANED_DIR_SUFFIX):
                log.error("%s: an orphaned log kept for an operator (never loaded)", child)
                continue
            if child.name.endswith(STRAY_DIR_SUFFIX):
                log.warning(
                    "%s: a stray log renamed before the last stop; deleted in %d ms "
                    "(file.delete.delay.ms)",
                    child,
                    self.file_delete_delay_ms,
                )
                self._add_stray(child)
                continue
            try:
                tp = parse_partition_dir(child.name)
            except StorageError as e:
                log.warning("%s: skipped: %s", child, e)
                continue
            if tp in self._logs:
                raise StorageError(
                    f"{tp[0]}-{tp[1]} is in two log dirs: {self._logs[tp].dir} and {child}"
                )
            loaded = Log.open(
                child,
                self.default_config,
                recovery_points.get(tp, 0),
                self._time_ms,
                log_starts.get(tp, 0),
            )
            self._add(tp, loaded)
            # A corrupt file stops the start, as Kafka takes its log dir offline: the log
            # could be a deleted topic's, and without its id would be taken for the new one.
            loaded.topic_id = read_partition_metadata(child)
        log.info("%s: loaded %d logs", log_dir, len(self._partitions_in[log_dir]))
        named = set(recovery_points) | set(log_starts)
        if named - self._partitions_in[log_dir]:
            # Offsets of logs deleted, or renamed stray, before a crash let the checkpoints
            # be rewritten: a new log of the partition would inherit them (review 28 #1).
            self._checkpoint_offsets(log_dir)

    def _add(self, tp: TopicPartition, lg: Log) -> None:
        lg.flush_in_background = self._flush_in_background
        lg.offsets_lowered = self._checkpoint_offsets_in
        lg.dir_failures = self.dir_failures
        self._logs[tp] = lg
        self._partitions_in[lg.dir.parent].add(tp)

    # -- logs ----------------------------------------------------------------------------

    def get_log(self, topic: str, partition: int) -> Log | None:
        return self._logs.get((topic, partition))

    def get_or_create_log(
        self, topic: str, partition: int, config: LogConfig, topic_id: bytes = b""
    ) -> Log:
        """The partition's log, with `config` now in force; a new log goes to the log dir
        holding the fewest partitions, with `topic_id` (if not empty) in its
        partition.metadata."""
        if partition < 0:
            raise UnknownTopicOrPartition(f"partition {partition} of {topic} is negative")
        existing = self._logs.get((topic, partition))
        if existing is not None:
            existing.config = config
            return existing
        log_dir = min(self.log_dirs, key=lambda d: len(self._partitions_in[d]))
        with guarded(self.dir_failures, log_dir):
            created = Log.open(log_dir / f"{topic}-{partition}", config, 0, self._time_ms)
        self._add((topic, partition), created)
        if topic_id:
            self.assign_topic_id(created, topic_id)
        log.info("created log %s in %s", created.name, log_dir)
        return created

    def assign_topic_id(self, lg: Log, topic_id: bytes) -> None:
        """Give a log its topic id, on disk (partition.metadata, fsynced) before in memory."""
        with guarded(self.dir_failures, lg.log_dir):
            write_partition_metadata(lg.dir, topic_id)
        lg.topic_id = topic_id
        log.info("log %s has topic id %s", lg.name, topic_id_text(topic_id))

    async def delete_logs(self, partitions: Iterable[TopicPartition]) -> None:
        """Delete these logs (StopReplica with delete): each renamed out of the way (a crash
        then leaves a directory the next start removes), their log dirs' checkpoints
        rewritten at once, as Kafka's asyncDelete (a recovery point or log start left there
        would apply, after a crash, to a new log of the partition, skipping its recovery or
        hiding its first records), and only then the files removed, on a worker thread.
        Yields between logs, and checkpoints each dir once: a topic of thousands of
        partitions held the event loop past the broker's session (review 28 #2), and the
        removal before the checkpoint left a crash window as long as it took (review 28 #1)."""
        doomed: list[tuple[TopicPartition, Path]] = []
        for topic, partition in partitions:
            await asyncio.sleep(0)
            lg = self._require(topic, partition)
            doomed.append(((topic, partition), lg.rename_for_deletion()))
            del self._logs[(topic, partition)]
            self._partitions_in[lg.dir.parent].discard((topic, partition))
        for log_dir in {path.parent for _, path in doomed}:
            self._checkpoint_offsets(log_dir)
        for (topic, partition), path in doomed:
            with guarded(self.dir_failures, path.parent):
                await asyncio.to_thread(_remove_tree, path)
            log.info("deleted log %s-%d", topic, partition)

    def local_logs(self) -> KeysView[TopicPartition]:
        return self._logs.keys()

    async def remove_stray_logs(
        self, strays: Mapping[TopicPartition, str], keep: Iterable[TopicPartition] = ()
    ) -> None:
        """Rename each stray log (see stray_logs; the values say why it is stray) out of the
        way now, with a WARN naming it, and delete it after file.delete.delay.ms; those in
        `keep` (their topic unknown to the view) are renamed `-orphaned` and never deleted,
        with an ERROR. Yields to the event loop between logs (a rename fsyncs the log dir): a
        broker that missed the moves of many partitions must not stall its heartbeats."""
        dirs: set[Path] = set()
        kept = set(keep)
        for (topic, partition), why in strays.items():
            await asyncio.sleep(0)
            stray = self._require(topic, partition)
            orphaned = (topic, partition) in kept
            renamed = stray.rename_stray(orphaned)
            del self._logs[(topic, partition)]
            self._partitions_in[stray.dir.parent].discard((topic, partition))
            dirs.add(stray.dir.parent)
            if orphaned:
                log.error(
                    "log %s-%d: %s (a controller on a new or emptied etcd?); renamed to %s "
                    "and kept: delete it by hand once the topic is known to be gone",
                    topic,
                    partition,
                    why,
                    renamed,
                )
                continue
            self._add_stray(renamed)
            log.warning(
                "stray log %s-%d: %s; renamed to %s, deleted in %d ms (file.delete.delay.ms)",
                topic,
                partition,
                why,
                renamed,
                self.file_delete_delay_ms,
            )
        # A recovery point or log start left in the checkpoints would apply to a new log of
        # the partition.
        for log_dir in dirs:
            self._checkpoint_offsets(log_dir)

    def _add_stray(self, renamed: Path) -> None:
        self._strays[renamed] = self._time_ms() + self.file_delete_delay_ms
        self._stray_added.set()

    async def delete_due_strays(self) -> int | None:
        """Delete the stray logs whose delay is over (in a worker thread: a log may be
        large). Returns the ms until the next one is due; None when none is left."""
        for path, due in list(self._strays.items()):
            if due > self._time_ms():
                continue
            with guarded(self.dir_failures, path.parent):
                await asyncio.to_thread(_remove_tree, path)
            del self._strays[path]
            log.info("deleted stray log %s", path)
        if not self._strays:
            return None
        return max(min(self._strays.values()) - self._time_ms(), 0)

    async def _delete_strays_when_due(self) -> None:
        while True:
            self._stray_added.clear()
            try:
                wait_ms = await self.delete_due_strays()
            except Exception:
                log.exception("deleting stray logs failed; trying again later")
                wait_ms = self.file_delete_delay_ms
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._stray_added.wait(), None if wait_ms is None else wait_ms / 1000
                )

    def _require(self, topic: str, partition: int) -> Log:
        found = self._logs.get((topic, partition))
        if found is None:
            raise UnknownTopicOrPartition(f"no log for {topic}-{partition} on this broker")
        return found

    # -- durability ----------------------------------------------------------------------

    def _flush_in_background(self, lg: Log, job: FlushJob) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop to keep going: flush now
            with guarded(self.dir_failures, lg.log_dir):
                job.run()
            lg.finish_flush(job)
            return
        self._flushing = loop.create_task(self._flush_after(self._flushing, lg, job))

    async def _flush_after(
        self, previous: asyncio.Task[None] | None, lg: Log, job: FlushJob
    ) -> None:
        try:
            if previous is not None:
                await asyncio.wait([previous])
        except asyncio.CancelledError:
            job.close()
            raise
        # A failed fsync is not retried: the kernel may have dropped the pages it could not
        # write and report the next fsync clean.
        with guarded(self.dir_failures, lg.log_dir):
            await asyncio.to_thread(job.run)  # which closes the job's descriptors
        lg.finish_flush(job)

    def checkpoint_recovery_points(self) -> None:
        """Write each log dir's recovery-point-offset-checkpoint."""
        for log_dir in self.log_dirs:
            self._recovery_point_writer.write(log_dir, self._recovery_points(log_dir))

    def checkpoint_log_start_offsets(self) -> None:
        """Write each log dir's log-start-offset-checkpoint."""
        for log_dir in self.log_dirs:
            self._write_log_starts(log_dir)

    def _write_log_starts(self, log_dir: Path) -> None:
        self._log_start_writer.write(log_dir, self._log_start_offsets(log_dir))
        self._log_starts_on_disk(log_dir)

    def _log_starts_on_disk(self, log_dir: Path) -> None:
        """`log_dir`'s log-start-offset-checkpoint was written: each log's leader epoch
        checkpoint may now let go of the epochs below the log start it holds, and not before
        (review 13 L3). Read on the event loop right after the write: what the writer says
        is on disk is the file's content (a write off the loop asked for before and not
        landed yet never lands, see OffsetCheckpointWriter)."""
        on_disk = self._log_start_writer.on_disk(log_dir)
        for tp in self._partitions_in[log_dir]:
            if tp in on_disk:
                self._logs[tp].log_start_checkpointed(on_disk[tp])

    def _checkpoint_offsets_in(self, lg: Log) -> None:
        """A truncation lowered `lg`'s recovery point or log start offset: its log dir's
        checkpoints now, as Kafka's LogManager.truncateTo and truncateFullyAndStartAt, or a
        crash after appending again would have the next start trust the new bytes below the
        old recovery point without checking them, or start the log at the old log start."""
        self._checkpoint_offsets(lg.dir.parent)

    def _checkpoint_offsets(self, log_dir: Path) -> None:
        self._recovery_point_writer.write(log_dir, self._recovery_points(log_dir))
        self._write_log_starts(log_dir)

    async def _checkpoint_offsets_off_loop(self) -> None:
        for log_dir in self.log_dirs:
            # Each dir's offsets taken as its write is asked for: a truncation's checkpoint
            # written meanwhile stays (see OffsetCheckpointWriter).
            await self._recovery_point_writer.write_off_loop(
                log_dir, self._recovery_points(log_dir)
            )
            await self._log_start_writer.write_off_loop(log_dir, self._log_start_offsets(log_dir))
            self._log_starts_on_disk(log_dir)

    def _recovery_points(self, log_dir: Path) -> dict[TopicPartition, int]:
        return {tp: self._logs[tp].recovery_point for tp in self._partitions_in[log_dir]}

    def _log_start_offsets(self, log_dir: Path) -> dict[TopicPartition, int]:
        return {tp: self._logs[tp].log_start_offset for tp in self._partitions_in[log_dir]}

    async def background_flushes_done(self) -> None:
        """Wait for the fsyncs in flight (one that fails stops the broker). shutdown() must
        come after them: it fsyncs the same files, and after a failed fsync another one of
        the same file can report success for pages that were never written."""
        flushing = self._flushing
        if flushing is not None:
            await asyncio.wait([flushing])
            if not flushing.cancelled():
                flushing.exception()  # reported already; taken, so that it is not logged

    def shutdown(self, broker_epoch: int = 0) -> None:
        """Flush every log, checkpoint the recovery points (now the LEOs) and log start
        offsets, close everything: the next start recovers nothing. With the broker's epoch
        (registered), write the clean-shutdown files that prove it to the controller. Only the
        first call does anything."""
        if self._closed:
            return
        for lg in self._logs.values():
            lg.flush()
        self.checkpoint_recovery_points()
        self.checkpoint_log_start_offsets()
        if broker_epoch:
            marker = json.dumps({"version": 0, "broker_epoch": broker_epoch}).encode()
            for log_dir in self.log_dirs:
                write_atomically(log_dir / CLEAN_SHUTDOWN_FILE, marker)
        self._close_all()

    def _close_all(self) -> None:
        self._closed = True
        for lg in self._logs.values():
            lg.close()
        self._logs.clear()
        for partitions in self._partitions_in.values():
            partitions.clear()
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds.clear()

    # -- background work -----------------------------------------------------------------

    async def run_background_tasks(
        self,
        retention_check_interval_ms: int = 300000,
        flush_check_interval_ms: int = 1000,
        recovery_point_checkpoint_interval_ms: int = 60000,
    ) -> None:
        """Retention, flush.ms and recovery point and log start offset checkpoints, each on its
        own period, and stray logs' deletions, each when due, until cancelled."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._delete_strays_when_due())
            # A run that fails otherwise than by the disk (which stops the broker) is logged,
            # and the next one tries again.
            for interval_ms, job in (
                (retention_check_interval_ms, self._apply_retention),
                (flush_check_interval_ms, self._flush_due_logs),
                (recovery_point_checkpoint_interval_ms, self._checkpoint_offsets_off_loop),
            ):
                group.create_task(background.every(interval_ms / 1000, job, job.__name__))

    def _apply_retention(self) -> None:
        now = self._time_ms()
        for tp, lg in list(self._logs.items()):
            if lg.delete_retention_segments(now, self.high_watermark(tp)):
                self.log_start_moved(tp)

    def _flush_due_logs(self) -> None:
        now = self._time_ms()
        for lg in list(self._logs.values()):
            lg.flush_if_due(now)


def _remove_tree(path: Path) -> None:
    # Gone already (an operator took it): nothing left to do.
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
