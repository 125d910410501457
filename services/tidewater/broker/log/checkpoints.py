"""Checkpoint files in Kafka's text formats, replaced atomically.

Every format is a version line (`0`), an entry count line, then one entry per line:
  replication-offset-checkpoint, recovery-point-offset-checkpoint (per log dir):
      `<topic> <partition> <offset>`
  leader-epoch-checkpoint (per partition directory):
      `<epoch> <start offset>`
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Awaitable, Mapping, Sequence
from itertools import count, pairwise
from pathlib import Path
from typing import NamedTuple

from tidewater.broker.log.dir_failure import LogDirFailureChannel, guarded
from tidewater.errors import InvalidTopic, StorageError
from tidewater.topic_names import validate_topic_name

TEMP_SUFFIX = ".tmp"
_VERSION = 0
_INTEGER = re.compile(r"-?[0-9]+")
_COUNT = re.compile(r"[0-9]+")


class CorruptCheckpoint(StorageError):
    pass


def fsync_dir(directory: Path) -> None:
    """Make a directory's entries (created, renamed, removed files) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes, durable: bool = True) -> None:
    """Replace `path` with `data` so that a reader sees either the old or the new content:
    write a temp file in the same directory and rename it over. `durable` fsyncs the file
    before the rename and the directory after, so that a crash too leaves one or the other;
    without, the caller makes it durable later, and a crash may leave a torn file."""
    temp = path.with_name(path.name + TEMP_SUFFIX)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)
    if durable:
        fsync_dir(path.parent)


class _CheckpointFile:
    """The shared text layout; subclasses say what an entry is."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _read_entries(self, fields: int) -> list[list[str]]:
        """Each entry line split into `fields` fields; [] if the file does not exist."""
        try:
            text = self.path.read_bytes().decode("ascii")
        except FileNotFoundError:
            return []
        except UnicodeDecodeError:
            raise self._corrupt("not ASCII text") from None
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()
        if len(lines) < 2:
            raise self._corrupt("missing the version or count line")
        if lines[0] != str(_VERSION):
            raise self._corrupt(f"unknown version {lines[0]!r}, expected {_VERSION}")
        if not _COUNT.fullmatch(lines[1]) or int(lines[1]) != len(lines) - 2:
            raise self._corrupt(f"count line {lines[1]!r} but {len(lines) - 2} entries")
        entries = []
        for number, line in enumerate(lines[2:], start=3):
            parts = line.split(" ")
            if len(parts) != fields:
                raise self._corrupt(f"line {number} {line!r} does not have {fields} fields")
            entries.append(parts)
        return entries

    def _write_entries(self, lines: Sequence[str]) -> None:
        text = "".join(f"{line}\n" for line in (str(_VERSION), str(len(lines)), *lines))
        write_atomically(self.path, text.encode("ascii"))

    def _int(self, text: str, minimum: int) -> int:
        if not _INTEGER.fullmatch(text) or int(text) < minimum:
            raise self._corrupt(f"{text!r} is not an integer >= {minimum}")
        return int(text)

    def _corrupt(self, detail: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"corrupt checkpoint file {self.path}: {detail}")


class OffsetCheckpoint(_CheckpointFile):
    """An offset per partition: HWs (replication-offset-checkpoint) or recovery points."""

    def read(self) -> dict[tuple[str, int], int]:
        offsets: dict[tuple[str, int], int] = {}
        for topic, partition, offset in self._read_entries(3):
            try:
                validate_topic_name(topic)
            except InvalidTopic as e:
                raise self._corrupt(str(e)) from None
            offsets[(topic, self._int(partition, 0))] = self._int(offset, 0)
        return offsets

    def write(self, offsets: Mapping[tuple[str, int], int]) -> None:
        self._write_entries(
            [f"{topic} {partition} {offset}" for (topic, partition), offset in offsets.items()]
        )


class EpochEntry(NamedTuple):
    epoch: int
    start_offset: int


class LeaderEpochCheckpoint(_CheckpointFile):
    """A partition's leader epochs and the offset where each began."""

    def read(self) -> list[EpochEntry]:
        entries = [
            EpochEntry(self._int(epoch, 0), self._int(start_offset, 0))
            for epoch, start_offset in self._read_entries(2)
        ]
        for before, after in pairwise(entries):
            if after.epoch <= before.epoch or after.start_offset < before.start_offset:
                raise self._corrupt(f"entry {tuple(after)} does not follow {tuple(before)}")
        return entries

    def write(self, entries: Sequence[EpochEntry]) -> None:
        self._write_entries([f"{e.epoch} {e.start_offset}" for e in entries])


class OffsetCheckpointWriter:
    """Writes one kind of per-log-dir offset checkpoint (`name`), one write at a time: from
    the event loop (at shutdown, after a truncation) or from a worker thread (the periodic
    ones). Each write ends with an fsync, which can wait hundreds of ms behind other writeback.
    Writes land in the order they were asked for: offsets handed to a worker thread never
    overwrite those of a later write that got to the file first. Offsets the file already
    holds are not written again."""

    def __init__(self, name: str, dir_failures: LogDirFailureChannel | None = None) -> None:
        self.name = name
        self.dir_failures = dir_failures
        self._lock = threading.Lock()
        self._asked = count()
        self._written: dict[Path, int] = {}  # per log dir, the latest write on disk
        self._on_disk: dict[Path, dict[tuple[str, int], int]] = {}  # and its offsets

    def write(self, log_dir: Path, offsets: Mapping[tuple[str, int], int]) -> None:
        with guarded(self.dir_failures, log_dir):
            self._write(log_dir, offsets, next(self._asked))

    def write_off_loop(
        self, log_dir: Path, offsets: Mapping[tuple[str, int], int]
    ) -> Awaitable[None]:
        """write() on a worker thread, in its place among the writes asked for by now."""
        return self._reported(
            log_dir, asyncio.to_thread(self._write, log_dir, offsets, next(self._asked))
        )

    def on_disk(self, log_dir: Path) -> Mapping[tuple[str, int], int]:
        """The offsets in `log_dir`'s file as of the last write that landed (none before the
        first)."""
        return self._on_disk.get(log_dir, {})

    async def _reported(self, log_dir: Path, write: Awaitable[None]) -> None:
        with guarded(self.dir_failures, log_dir):
            await write

    def _write(self, log_dir: Path, offsets: Mapping[tuple[str, int], int], asked: int) -> None:
        with self._lock:
            if asked < self._written.get(log_dir, -1):
                return
            # The offsets on disk already (idle logs): an fsync'd rewrite would only cost time.
            if self._on_disk.get(log_dir) != offsets:
                OffsetCheckpoint(log_dir / self.name).write(offsets)
                self._on_disk[log_dir] = dict(offsets)
            self._written[log_dir] = asked
