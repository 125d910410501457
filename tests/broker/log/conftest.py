"""Fixtures of the log tests: raw batches, a settable clock (tests/broker/log/clock.py), logs
in tmp_path."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.broker.log.clock import START_MS, Clock
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.log import Log
from tidewater.records.header import (
    CRC_OFFSET,
    HEADER,
    HEADER_SIZE,
    LOG_OVERHEAD,
    MAGIC,
    compute_crc,
    read_header,
)


def _make_batch(
    records: int = 1,
    *,
    body: bytes = b"payload",
    timestamp: int = START_MS,
    max_timestamp: int | None = None,
    base_offset: int = 0,
    epoch: int = -1,
) -> bytearray:
    """One v2 batch with a valid CRC. The log never parses records, so the records section is
    just `body`."""
    batch = bytearray(
        HEADER.pack(
            base_offset,
            HEADER_SIZE - LOG_OVERHEAD + len(body),
            epoch,
            MAGIC,
            0,  # crc, set below
            0,  # attributes: uncompressed, CreateTime
            records - 1,
            timestamp,
            timestamp if max_timestamp is None else max_timestamp,
            -1,
            -1,
            -1,
            records,
        )
    )
    batch += body
    struct.pack_into(">I", batch, CRC_OFFSET, compute_crc(batch))
    return batch


def _split(data: bytes | bytearray | memoryview) -> list[bytes]:
    """The batches in `data`, each as bytes."""
    data = bytes(data)
    out = []
    position = 0
    while position < len(data):
        size = read_header(data, position).size
        out.append(data[position : position + size])
        position += size
    return out


@pytest.fixture
def make_batch() -> Callable[..., bytearray]:
    """make_batch(records=1, *, body, timestamp, max_timestamp, base_offset, epoch)."""
    return _make_batch


@pytest.fixture
def split() -> Callable[[bytes | bytearray | memoryview], list[bytes]]:
    return _split


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "events-0"


@pytest.fixture
def open_log(log_dir: Path, clock: Clock) -> Iterator[Callable[..., Log]]:
    """open_log(recovery_point=0, **LogConfig fields): the log in log_dir on the test clock.
    Logs still open at the end are closed."""
    opened: list[Log] = []

    def open_(recovery_point: int = 0, **config: int | None) -> Log:
        opened.append(Log.open(log_dir, LogConfig(**config), recovery_point, clock))
        return opened[-1]

    yield open_
    for log in opened:
        for segment in log.segments:
            segment.close()
