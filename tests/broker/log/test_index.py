from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tidewater.broker.log.index import CorruptIndex, OffsetIndex, TimeIndex

BASE = 1000


def offset_index(tmp_path: Path, entries: list[tuple[int, int]]) -> OffsetIndex:
    index = OffsetIndex(tmp_path / "00000000000000001000.index", BASE)
    for offset, position in entries:
        index.append(offset, position)
    index.write_pending()
    return index


def time_index(tmp_path: Path, entries: list[tuple[int, int]]) -> TimeIndex:
    index = TimeIndex(tmp_path / "00000000000000001000.timeindex", BASE)
    for timestamp, offset in entries:
        index.maybe_append(timestamp, offset)
    index.write_pending()
    return index


def test_offset_lookup_finds_the_largest_entry_at_or_below(tmp_path: Path) -> None:
    index = offset_index(tmp_path, [(1009, 4100), (1020, 8300), (1031, 12400)])
    assert index.lookup(999) == (BASE, 0)
    assert index.lookup(1008) == (BASE, 0)
    assert index.lookup(1009) == (1009, 4100)
    assert index.lookup(1019) == (1009, 4100)
    assert index.lookup(1020) == (1020, 8300)
    assert index.lookup(5000) == (1031, 12400)


def test_offset_index_file_is_kafkas_layout_and_reloads(tmp_path: Path) -> None:
    index = offset_index(tmp_path, [(1009, 4100), (1020, 8300)])
    assert index.path.read_bytes() == struct.pack(">iiii", 9, 4100, 20, 8300)
    reloaded = OffsetIndex(index.path, BASE)
    assert reloaded.entries == 2
    assert reloaded.lookup(1025) == (1020, 8300)
    reloaded.sanity_check(log_size=9000)


def test_offset_truncate_drops_entries_at_or_above(tmp_path: Path) -> None:
    index = offset_index(tmp_path, [(1009, 4100), (1020, 8300), (1031, 12400)])
    index.truncate_to(1020)
    assert index.entries == 1
    assert index.lookup(5000) == (1009, 4100)
    assert OffsetIndex(index.path, BASE).entries == 1
    index.append(1015, 6000)
    index.write_pending()
    assert OffsetIndex(index.path, BASE).lookup(1016) == (1015, 6000)


def test_is_full_counts_entries_against_the_byte_limit(tmp_path: Path) -> None:
    index = offset_index(tmp_path, [(1001, 10), (1002, 20)])
    assert index.is_full(16)
    assert not index.is_full(24)
    times = time_index(tmp_path, [(5, 1001)])
    assert times.is_full(12)
    assert times.is_full(23)
    assert not times.is_full(24)


@pytest.mark.parametrize(
    ("raw", "log_size", "complaint"),
    [
        (struct.pack(">ii", 9, 4100) + b"\x00\x01\x02", 9000, "trailing bytes"),
        (struct.pack(">iiii", 20, 8300, 9, 4100), 9000, "increasing order"),
        (struct.pack(">iiii", 9, 4100, 9, 8300), 9000, "increasing order"),
        (struct.pack(">iiii", 9, 4100, 20, 4100), 9000, "increasing order"),
        (struct.pack(">ii", -1, 0), 9000, "negative"),
        (struct.pack(">ii", 9, 9000), 9000, "past the end"),
    ],
)
def test_offset_sanity_check_rejects_a_broken_file(
    tmp_path: Path, raw: bytes, log_size: int, complaint: str
) -> None:
    path = tmp_path / "00000000000000001000.index"
    path.write_bytes(raw)
    with pytest.raises(CorruptIndex, match=complaint):
        OffsetIndex(path, BASE).sanity_check(log_size)


def test_time_index_appends_only_when_the_timestamp_grows(tmp_path: Path) -> None:
    index = time_index(tmp_path, [(100, 1005), (100, 1010), (90, 1012), (200, 1020)])
    assert index.entries == 2
    assert index.last_entry == (200, 1020)
    assert index.path.read_bytes() == struct.pack(">qiqi", 100, 5, 200, 20)


def test_time_lookup_finds_the_largest_timestamp_at_or_below(tmp_path: Path) -> None:
    index = time_index(tmp_path, [(100, 1005), (200, 1020), (300, 1030)])
    assert index.lookup(99) == (-1, BASE)
    assert index.lookup(100) == (100, 1005)
    assert index.lookup(250) == (200, 1020)
    assert index.lookup(10**12) == (300, 1030)


def test_time_truncate_and_reload(tmp_path: Path) -> None:
    index = time_index(tmp_path, [(100, 1005), (200, 1020), (300, 1030)])
    index.truncate_to(1020)
    assert index.last_entry == (100, 1005)
    reloaded = TimeIndex(index.path, BASE)
    assert reloaded.last_entry == (100, 1005)
    reloaded.sanity_check(last_offset=1005)


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        (struct.pack(">qi", 100, 5) + b"\x00" * 5, "trailing bytes"),
        (struct.pack(">qiqi", 200, 5, 100, 6), "increasing order"),
        (struct.pack(">qiqi", 100, 6, 200, 5), "increasing order"),
        (struct.pack(">qi", 100, 50), "outside the segment"),
    ],
)
def test_time_sanity_check_rejects_a_broken_file(
    tmp_path: Path, raw: bytes, complaint: str
) -> None:
    path = tmp_path / "00000000000000001000.timeindex"
    path.write_bytes(raw)
    with pytest.raises(CorruptIndex, match=complaint):
        TimeIndex(path, BASE).sanity_check(last_offset=1020)


def test_reset_creates_an_empty_file(tmp_path: Path) -> None:
    index = OffsetIndex(tmp_path / "00000000000000001000.index", BASE)
    assert not index.path.exists()
    index.reset()
    assert index.path.read_bytes() == b""
    index.flush()
    index.delete()
    assert not index.path.exists()
