"""Log append and sequential read throughput as a ratio of a plain file, in the same run.

    .venv/bin/python tests/benchmarks/bench_log.py [--megabytes 768] [--rounds 3]
        [--drop-behind BYTES]

Appends 1 MiB batches of 1 KiB records with Log.append_as_leader, against os.write of the
same bytes to a plain file; both leave flushing to the OS and keep the same page cache window
(cache.drop.behind.bytes; the total stays under one segment, so no roll fsyncs). Then reads
everything back sequentially with Log.read(offset, 1 MiB), against os.pread of 1 MiB chunks
of the plain file, each read twice and the second pass timed: the first brings back into the
page cache what drop-behind let go (written back or not, by luck of timing), so the timed pass
compares the read paths, not the cache. Each round runs both, alternating; the best round of
each counts.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bare_grpc import DROP_BEHIND_BYTES, AppendFile

from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.log import Log
from tidewater.records.batch import Record, build_batch
from tidewater.records.header import read_header

CHUNK = 1 << 20
# What an append wrote, for the reads: a Log or a plain file's path.
T = TypeVar("T")


def log_append(directory: Path, batch: bytes, count: int, drop_behind: int) -> tuple[float, Log]:
    log = Log.open(directory / "bench-0", LogConfig(cache_drop_behind_bytes=drop_behind))
    buf = bytearray(batch)
    started = time.perf_counter()
    for _ in range(count):
        log.append_as_leader(buf, leader_epoch=1)
    return time.perf_counter() - started, log


def file_append(directory: Path, batch: bytes, count: int, drop_behind: int) -> tuple[float, Path]:
    path = directory / "plain.bin"
    out = AppendFile(path, drop_behind)
    started = time.perf_counter()
    for _ in range(count):
        out.write(batch)
    elapsed = time.perf_counter() - started
    out.close()
    return elapsed, path


def log_read(log: Log) -> tuple[float, int]:
    total = 0
    offset = 0
    started = time.perf_counter()
    while data := log.read(offset, CHUNK):
        total += len(data)
        position = 0
        while position < len(data):  # a consumer's walk to its next fetch offset
            header = read_header(data, position)
            position += header.size
        offset = header.next_offset
    return time.perf_counter() - started, total


def file_read(path: Path) -> tuple[float, int]:
    fd = os.open(path, os.O_RDONLY)
    total = 0
    started = time.perf_counter()
    while data := os.pread(fd, CHUNK, total):
        total += len(data)
    elapsed = time.perf_counter() - started
    os.close(fd)
    return elapsed, total


def main(megabytes: int, rounds: int, drop_behind: int) -> None:
    batch = build_batch([Record(value=os.urandom(1024)) for _ in range(1000)])
    count = megabytes * 2**20 // len(batch)
    size_mb = count * len(batch) / 1e6
    best = {"log append": 0.0, "file append": 0.0, "log read": 0.0, "file read": 0.0}

    def measure(
        kind: str,
        append: Callable[[Path, bytes, int, int], tuple[float, T]],
        read: Callable[[T], tuple[float, int]],
        directory: Path,
    ) -> T:
        """Append, then read twice and time the second pass; keep the best MB/s of each."""
        elapsed, written = append(directory, batch, count, drop_behind)
        best[f"{kind} append"] = max(best[f"{kind} append"], size_mb / elapsed)
        read(written)
        elapsed, total = read(written)
        assert total == count * len(batch)
        best[f"{kind} read"] = max(best[f"{kind} read"], size_mb / elapsed)
        return written

    for _ in range(rounds):
        with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
            measure("file", file_append, file_read, Path(tmp)).unlink()
            measure("log", log_append, log_read, Path(tmp)).delete()
    append_ratio = best["log append"] / best["file append"]
    read_ratio = best["log read"] / best["file read"]
    print(f"{count} batches of {len(batch) / 2**20:.2f} MiB ({size_mb:.0f} MB), best of {rounds}")
    for name, mbs in best.items():
        print(f"{name:12} {mbs:8.0f} MB/s")
    print(f"append ratio {append_ratio:8.2f}\nread ratio   {read_ratio:8.2f}")
    meets = append_ratio >= 0.8 and read_ratio >= 0.8
    print(
        f"SUMMARY log append {best['log append']:.0f} MB/s = {append_ratio:.2f} x plain file, "
        f"sequential read {best['log read']:.0f} MB/s = {read_ratio:.2f} x plain file "
        f"({'meets' if meets else 'misses'} goal 0.8 for both)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drop-behind", type=int, default=DROP_BEHIND_BYTES, help="-1: Kafka's")
    args = parser.parse_args()
    main(args.megabytes, args.rounds, args.drop_behind)
