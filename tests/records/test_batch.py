from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.records.strategies import CODECS, record_lists
from tidewater.errors import CorruptMessage, UnsupportedCompressionType
from tidewater.records.batch import ConsumerRecord, Record, build_batch, decode_batches
from tidewater.records.header import (
    HEADER_SIZE,
    TIMESTAMP_TYPE_BIT,
    Compression,
    crc_matches,
    patch_base_offset_and_epoch,
    read_header,
)
from tidewater.records.validate import validate_batch

T0 = 1_700_000_000_000
RECORD_BATCH_MD = Path(__file__).parents[2] / "protos" / "RECORD_BATCH.md"


def consumed(
    records: list[Record], *, now_ms: int, base_offset: int = 0, leader_epoch: int = -1
) -> list[ConsumerRecord]:
    """What a consumer should read back for `records`."""
    return [
        ConsumerRecord(
            offset=base_offset + i,
            timestamp_ms=now_ms if r.timestamp_ms is None else r.timestamp_ms,
            key=r.key,
            value=r.value,
            headers=r.headers,
            leader_epoch=leader_epoch,
        )
        for i, r in enumerate(records)
    ]


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_with_every_codec(codec: Compression) -> None:
    records = [
        Record(b"key", b"value", (("trace", b"1"), ("trace", None), ("ünïcode", b"")), T0),
        Record(None, None, (), T0 - 3),
        Record(b"", b"", (), None),
        Record(None, b"x" * 10_000, (), T0 + 10),
    ]
    batch = build_batch(records, compression=codec, now_ms=T0 + 7)

    header = read_header(batch)
    assert header.compression == codec
    assert header.size == len(batch)
    assert (header.record_count, header.last_offset_delta) == (4, 3)
    assert (header.first_timestamp, header.max_timestamp) == (T0, T0 + 10)
    assert crc_matches(batch, header)
    assert list(decode_batches(batch)) == consumed(records, now_ms=T0 + 7)


def test_compression_shrinks_repetitive_records() -> None:
    records = [Record(b"key", b"the same value, again and again " * 10)] * 50
    plain = len(build_batch(records))
    for codec in CODECS[1:]:
        assert len(build_batch(records, compression=codec)) < plain / 10


def test_header_carries_producer_fields_and_offsets_start_at_base_offset() -> None:
    records = [Record(value=b"a"), Record(value=b"b")]
    batch = build_batch(
        records,
        base_offset=100,
        partition_leader_epoch=7,
        producer_id=12345,
        producer_epoch=3,
        base_sequence=40,
        now_ms=T0,
    )
    header = read_header(batch)
    assert (header.base_offset, header.partition_leader_epoch) == (100, 7)
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (12345, 3, 40)
    assert list(decode_batches(batch)) == consumed(
        records, now_ms=T0, base_offset=100, leader_epoch=7
    )


def test_producer_defaults() -> None:
    header = read_header(build_batch([Record(value=b"a")]))
    assert (header.base_offset, header.partition_leader_epoch) == (0, -1)
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (-1, -1, -1)
    assert header.magic == 2
    assert not header.log_append_time


def test_missing_timestamps_default_to_the_build_time() -> None:
    before = time.time_ns() // 1_000_000
    batch = build_batch([Record(value=b"a"), Record(value=b"b", timestamp_ms=5)])
    after = time.time_ns() // 1_000_000
    first, second = decode_batches(batch)
    assert before <= first.timestamp_ms <= after
    assert second.timestamp_ms == 5
    assert read_header(batch).max_timestamp == first.timestamp_ms


def test_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one record"):
        build_batch([])


def test_snappy_is_unsupported() -> None:
    with pytest.raises(UnsupportedCompressionType):
        build_batch([Record(value=b"a")], compression=Compression.SNAPPY)


@pytest.mark.parametrize("codec", CODECS)
def test_broker_stamp_keeps_the_crc_valid(codec: Compression) -> None:
    records = [Record(value=b"a"), Record(value=b"b")]
    batch = bytearray(build_batch(records, compression=codec, now_ms=T0))
    patch_base_offset_and_epoch(batch, 0, 42, 3)
    validate_batch(batch, 1 << 20)
    assert list(decode_batches(batch)) == consumed(
        records, now_ms=T0, base_offset=42, leader_epoch=3
    )


def test_decodes_concatenated_batches_and_ignores_a_partial_tail() -> None:
    first = [Record(value=b"one"), Record(value=b"two"), Record(value=b"three")]
    second = [Record(key=b"k", value=b"four"), Record(value=b"five")]
    b1 = build_batch(first, now_ms=T0)
    b2 = build_batch(second, base_offset=3, compression=Compression.LZ4, now_ms=T0)
    everything = consumed(first, now_ms=T0) + consumed(second, now_ms=T0, base_offset=3)

    assert list(decode_batches(b1 + b2)) == everything
    assert list(decode_batches(memoryview(b1 + b2))) == everything
    for cut in range(len(b2)):
        assert list(decode_batches(b1 + b2[:cut])) == everything[:3]
    assert list(decode_batches(b"")) == []


def test_crc_mismatch_is_corrupt() -> None:
    batch = bytearray(build_batch([Record(value=b"hello")]))
    batch[-2] ^= 0x01
    with pytest.raises(CorruptMessage, match="CRC32C"):
        list(decode_batches(batch))


def test_impossible_batch_length_is_corrupt_not_a_partial_tail() -> None:
    batch = build_batch([Record(value=b"hello")])
    broken = batch[:8] + (-1).to_bytes(4, "big", signed=True) + batch[12:]
    with pytest.raises(CorruptMessage, match="negative batch_length"):
        list(decode_batches(batch + broken))


def test_log_append_time_gives_every_record_the_max_timestamp(
    rewrite: Callable[..., bytes],
) -> None:
    records = [Record(value=b"a", timestamp_ms=T0), Record(value=b"b", timestamp_ms=T0 + 9)]
    batch = build_batch(records)
    stamped = rewrite(batch, attributes=TIMESTAMP_TYPE_BIT, max_timestamp=T0 + 500)
    assert [r.timestamp_ms for r in decode_batches(stamped)] == [T0 + 500, T0 + 500]


def test_decompressed_size_is_bounded() -> None:
    batch = build_batch([Record(value=bytes(100_000))], compression=Compression.ZSTD)
    assert len(batch) < 1000
    with pytest.raises(CorruptMessage, match="more than 50000 bytes"):
        list(decode_batches(batch, limit=50_000))
    assert len(next(decode_batches(batch)).value or b"") == 100_000


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("000000 7e 01 00", "overruns"),  # key length 63, nothing follows
        ("000000 03 01 00", "overruns"),  # key length -2
        ("000000 01 01 7e 0000", "header count 63"),
        ("000000 01 01 02 01 01", "header key .* is null"),
        ("000000 01 01 02 02ff 01", "not UTF-8"),
        ("000000 01 01 00 00", "does not fill"),  # a stray byte after the headers
    ],
)
def test_malformed_record_is_corrupt(
    body: str, message: str, rewrite: Callable[..., bytes]
) -> None:
    raw = bytes.fromhex(body)
    section = bytes([len(raw) * 2]) + raw  # zigzag length varint, one byte for these sizes
    batch = rewrite(build_batch([Record(value=b"v")]), section=section)
    # The broker only checks framing, so it stores such a batch; its consumers refuse it.
    validate_batch(batch, 1 << 20)
    with pytest.raises(CorruptMessage, match=message):
        list(decode_batches(batch))


def _doc_block(marker: str) -> list[str]:
    """Lines of the fenced block that follows `<!-- marker -->` in RECORD_BATCH.md."""
    text = RECORD_BATCH_MD.read_text()
    match = re.search(rf"<!-- {marker} -->\n```text\n(.*?)\n```", text, re.DOTALL)
    assert match, f"no {marker} block in {RECORD_BATCH_MD}"
    return match.group(1).splitlines()


def test_documented_example_is_what_build_batch_produces() -> None:
    batch = build_batch(
        [
            Record(key=b"k", value=b"v", timestamp_ms=1_700_000_000_000),
            Record(key=None, value=b"w", headers=(("h", b"x"),), timestamp_ms=1_700_000_000_005),
        ]
    )
    (one_line,) = _doc_block("example-hex")
    assert bytes.fromhex(one_line) == batch

    annotated = bytearray()
    for line in _doc_block("example-fields"):
        offset, *hex_bytes = line.partition("|")[0].split()
        assert int(offset) == len(annotated), f"offset column is wrong at {line!r}"
        annotated += bytes.fromhex("".join(hex_bytes))
    assert annotated == batch


def test_documented_broker_stamp() -> None:
    (one_line,) = _doc_block("example-hex")
    batch = bytearray.fromhex(one_line)
    patch_base_offset_and_epoch(batch, 0, 42, 3)
    assert batch[0:8].hex(" ") == "00 00 00 00 00 00 00 2a"
    assert batch[12:16].hex(" ") == "00 00 00 03"
    assert batch[16:] == bytes.fromhex(one_line)[16:]
    assert batch[8:12] == bytes.fromhex(one_line)[8:12]


RECORDS = record_lists(max_records=30, max_value=300)


@given(RECORDS, st.sampled_from(CODECS), st.integers(0, 2**40), st.integers(-1, 2**31 - 1))
def test_random_records_round_trip(
    records: list[Record], codec: Compression, base_offset: int, epoch: int
) -> None:
    batch = build_batch(
        records,
        compression=codec,
        base_offset=base_offset,
        partition_leader_epoch=epoch,
        now_ms=T0,
    )
    assert validate_batch(batch, len(batch)).record_count == len(records)
    assert list(decode_batches(batch)) == consumed(
        records, now_ms=T0, base_offset=base_offset, leader_epoch=epoch
    )
    assert read_header(batch).size == len(batch) >= HEADER_SIZE
