from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tidewater.errors import (
    CorruptMessage,
    MessageTooLarge,
    TidewaterError,
    UnsupportedCompressionType,
    UnsupportedVersion,
)
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.records.header import (
    CONTROL_BIT,
    HEADER_SIZE,
    TIMESTAMP_TYPE_BIT,
    TRANSACTIONAL_BIT,
    Compression,
    patch_base_offset_and_epoch,
    read_header,
)
from tidewater.records.validate import (
    find_offset_by_timestamp,
    iter_batch_headers,
    validate_batch,
)

CODECS = [Compression.NONE, Compression.GZIP, Compression.LZ4, Compression.ZSTD]
LIMIT = 1 << 20
T0 = 1_700_000_000_000


def three_records(codec: Compression = Compression.NONE) -> bytes:
    records = [Record(key=b"k", value=b"value %d" % i, timestamp_ms=T0 + i) for i in range(3)]
    return build_batch(records, compression=codec)


def with_int(batch: bytes, pos: int, size: int, value: int) -> bytes:
    """`batch` with a big-endian integer field overwritten and the CRC left as it was."""
    return batch[:pos] + value.to_bytes(size, "big", signed=True) + batch[pos + size :]


@pytest.mark.parametrize("codec", CODECS)
def test_valid_batch_returns_its_header(codec: Compression) -> None:
    batch = three_records(codec)
    for buf in (batch, bytearray(batch), memoryview(batch)):
        header = validate_batch(buf, LIMIT)
        assert header == read_header(batch)
        assert (header.record_count, header.compression) == (3, codec)


def test_batch_exactly_at_the_size_limit_is_accepted() -> None:
    batch = three_records()
    validate_batch(batch, len(batch))
    with pytest.raises(MessageTooLarge, match=f"{len(batch)} bytes"):
        validate_batch(batch, len(batch) - 1)


def test_fewer_bytes_than_a_header_is_corrupt() -> None:
    with pytest.raises(CorruptMessage, match="needs 61 bytes"):
        validate_batch(three_records()[: HEADER_SIZE - 1], LIMIT)


def test_negative_batch_length_is_corrupt() -> None:
    with pytest.raises(CorruptMessage, match="negative batch_length"):
        validate_batch(with_int(three_records(), 8, 4, -1), LIMIT)


def test_batch_length_too_small_for_the_header_is_corrupt() -> None:
    with pytest.raises(CorruptMessage, match="too small"):
        validate_batch(with_int(three_records(), 8, 4, 20), LIMIT)


@pytest.mark.parametrize("change", ["truncated", "extended", "two batches"])
def test_batch_length_not_matching_the_bytes_is_corrupt(change: str) -> None:
    batch = three_records()
    buf = {"truncated": batch[:-1], "extended": batch + b"\0", "two batches": batch + batch}
    with pytest.raises(CorruptMessage, match="exactly one whole batch"):
        validate_batch(buf[change], LIMIT)


@pytest.mark.parametrize("magic", [0, 1, 3])
def test_other_magic_is_unsupported(magic: int) -> None:
    with pytest.raises(UnsupportedVersion, match=f"magic {magic}"):
        validate_batch(with_int(three_records(), 16, 1, magic), LIMIT)


@pytest.mark.parametrize("pos", [21, 30, HEADER_SIZE, -1])
def test_crc_mismatch_is_corrupt(pos: int) -> None:
    batch = bytearray(three_records())
    batch[pos] ^= 0x40
    with pytest.raises(CorruptMessage, match="CRC32C"):
        validate_batch(batch, LIMIT)


def test_fields_outside_the_crc_may_change() -> None:
    batch = bytearray(three_records())
    patch_base_offset_and_epoch(batch, 0, 1234, 56)
    assert validate_batch(batch, LIMIT).base_offset == 1234


@pytest.mark.parametrize(
    ("bit", "message"), [(TRANSACTIONAL_BIT, "transactional"), (CONTROL_BIT, "control")]
)
def test_transactional_and_control_batches_are_unsupported(
    bit: int, message: str, rewrite: Callable[..., bytes]
) -> None:
    with pytest.raises(UnsupportedVersion, match=message):
        validate_batch(rewrite(three_records(), attributes=bit), LIMIT)


def test_snappy_is_unsupported(rewrite: Callable[..., bytes]) -> None:
    with pytest.raises(UnsupportedCompressionType, match="snappy"):
        validate_batch(rewrite(three_records(), attributes=Compression.SNAPPY), LIMIT)


@pytest.mark.parametrize("codec", [5, 6, 7])
def test_unknown_codec_is_corrupt(codec: int, rewrite: Callable[..., bytes]) -> None:
    with pytest.raises(CorruptMessage, match=f"unknown compression codec {codec}"):
        validate_batch(rewrite(three_records(), attributes=codec), LIMIT)


@pytest.mark.parametrize("count", [0, -1])
def test_record_count_below_one_is_corrupt(count: int, rewrite: Callable[..., bytes]) -> None:
    batch = rewrite(three_records(), record_count=count, last_offset_delta=count - 1)
    with pytest.raises(CorruptMessage, match=f"record_count {count}"):
        validate_batch(batch, LIMIT)


def test_last_offset_delta_must_match_record_count(rewrite: Callable[..., bytes]) -> None:
    with pytest.raises(CorruptMessage, match="last_offset_delta 5 for 3 records"):
        validate_batch(rewrite(three_records(), last_offset_delta=5), LIMIT)


@pytest.mark.parametrize(("count", "message"), [(2, "more than"), (4, "holds 3 records")])
def test_record_count_must_match_the_records(
    count: int, message: str, rewrite: Callable[..., bytes]
) -> None:
    batch = rewrite(three_records(), record_count=count, last_offset_delta=count - 1)
    with pytest.raises(CorruptMessage, match=message):
        validate_batch(batch, LIMIT)


@pytest.mark.parametrize("count", [4, 6])
def test_record_count_is_checked_for_lengths_of_every_varint_size(
    count: int, rewrite: Callable[..., bytes]
) -> None:
    # Length varints of one (under 64 bytes), two (under 8 KiB) and three bytes.
    batch = build_batch([Record(value=bytes(size)) for size in (10, 100, 9000, 20000, 5)])
    assert validate_batch(batch, LIMIT).record_count == 5
    with pytest.raises(CorruptMessage, match="holds"):
        validate_batch(rewrite(batch, record_count=count, last_offset_delta=count - 1), LIMIT)


def test_record_lengths_must_tile_the_section(rewrite: Callable[..., bytes]) -> None:
    batch = three_records()
    section = batch[HEADER_SIZE:]
    for broken in (
        section + b"\x00",  # a stray byte after the last record
        section[:-1],  # the last record cut short
        bytes([section[0] + 2]) + section[1:],  # first length one byte too long
        bytes([section[0] - 2]) + section[1:],  # first length one byte too short
        b"\x08" + bytes(4) + section,  # a 4-byte record, shorter than any record can be
        b"\x80" * 6 + section,  # an overlong length varint
    ):
        with pytest.raises(CorruptMessage):
            validate_batch(rewrite(batch, section=broken), LIMIT)


def test_compressed_records_are_not_inspected(rewrite: Callable[..., bytes]) -> None:
    batch = rewrite(three_records(Compression.ZSTD), section=b"not zstd at all")
    assert validate_batch(batch, LIMIT).compression == Compression.ZSTD
    with pytest.raises(CorruptMessage, match="ZSTD"):
        list(decode_batches(batch))


def test_iter_batch_headers_walks_concatenated_batches() -> None:
    b1 = three_records()
    b2 = three_records(Compression.GZIP)
    walked = list(iter_batch_headers(b1 + b2))
    assert walked == [(0, read_header(b1)), (len(b1), read_header(b2))]
    assert list(iter_batch_headers(b"")) == []


@pytest.mark.parametrize("tail", [1, 11, 12, 60, 61, -1])
def test_iter_batch_headers_refuses_a_partial_tail(tail: int) -> None:
    b1 = three_records()
    buf = b1 + three_records()[:tail]
    with pytest.raises(CorruptMessage, match="partial record batch"):
        list(iter_batch_headers(buf))
    assert list(iter_batch_headers(buf, ignore_partial_tail=True)) == [(0, read_header(b1))]


@pytest.mark.parametrize(("length", "message"), [(-12, "negative"), (0, "too small")])
def test_iter_batch_headers_refuses_impossible_lengths(length: int, message: str) -> None:
    buf = three_records() + with_int(three_records(), 8, 4, length)
    for ignore in (False, True):
        with pytest.raises(CorruptMessage, match=message):
            list(iter_batch_headers(buf, ignore_partial_tail=ignore))


@pytest.mark.parametrize("codec", CODECS)
def test_find_offset_by_timestamp(codec: Compression) -> None:
    # CreateTime timestamps need not grow with offsets.
    timestamps = [T0 + 10, T0 + 30, T0 + 20, T0 + 40]
    batch = bytearray(
        build_batch([Record(value=b"v", timestamp_ms=t) for t in timestamps], compression=codec)
    )
    patch_base_offset_and_epoch(batch, 0, 500, 1)
    assert find_offset_by_timestamp(batch, 0) == (500, T0 + 10)
    assert find_offset_by_timestamp(batch, T0 + 10) == (500, T0 + 10)
    assert find_offset_by_timestamp(batch, T0 + 15) == (501, T0 + 30)
    assert find_offset_by_timestamp(batch, T0 + 25) == (501, T0 + 30)
    assert find_offset_by_timestamp(memoryview(batch), T0 + 31) == (503, T0 + 40)
    assert find_offset_by_timestamp(batch, T0 + 41) is None


def test_find_offset_by_timestamp_in_a_log_append_time_batch(rewrite: Callable[..., bytes]) -> None:
    batch = rewrite(
        build_batch([Record(value=b"v", timestamp_ms=T0 + i) for i in range(3)], base_offset=7),
        attributes=TIMESTAMP_TYPE_BIT,
        max_timestamp=T0 + 1000,
    )
    assert find_offset_by_timestamp(batch, T0 + 500) == (7, T0 + 1000)
    assert find_offset_by_timestamp(batch, T0 + 1001) is None


def test_find_offset_by_timestamp_bounds_decompression() -> None:
    batch = build_batch(
        [Record(value=bytes(100_000), timestamp_ms=T0)], compression=Compression.GZIP
    )
    with pytest.raises(CorruptMessage, match="more than 1000 bytes"):
        find_offset_by_timestamp(batch, T0, limit=1000)


RECORDS = st.lists(
    st.builds(
        Record,
        key=st.none() | st.binary(max_size=16),
        value=st.none() | st.binary(max_size=64),
        headers=st.lists(
            st.tuples(st.text(max_size=4), st.none() | st.binary(max_size=8)), max_size=2
        ).map(tuple),
        timestamp_ms=st.integers(0, 2**45),
    ),
    min_size=1,
    max_size=8,
)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(original, mutation): a valid batch and a damaged copy, re-signed or not."""
    batch = build_batch(draw(RECORDS), compression=draw(st.sampled_from(CODECS)))
    kind = draw(st.sampled_from(["flip", "overwrite", "truncate", "extend"]))
    buf = bytearray(batch)
    if kind == "flip":
        for pos in draw(st.lists(st.integers(0, len(buf) - 1), min_size=1, max_size=4)):
            buf[pos] ^= 1 << draw(st.integers(0, 7))
    elif kind == "overwrite":
        pos = draw(st.integers(0, len(buf) - 1))
        junk = draw(st.binary(min_size=1, max_size=8))
        buf[pos : pos + len(junk)] = junk
    elif kind == "truncate":
        del buf[draw(st.integers(0, len(buf) - 1)) :]
    else:
        buf += draw(st.binary(min_size=1, max_size=16))
    return batch, bytes(buf)


@settings(
    max_examples=500,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=mutated(), resign=st.booleans())
def test_mutations_are_accepted_or_refused_with_a_named_error(
    case: tuple[bytes, bytes], resign: bool, rewrite: Callable[..., bytes]
) -> None:
    original, buf = case
    assume(buf != original)
    if resign and len(buf) >= HEADER_SIZE:
        # A fresh length and CRC let the damage reach the checks behind them.
        buf = rewrite(buf, section=buf[HEADER_SIZE:])
    try:
        header = validate_batch(buf, LIMIT)
    except TidewaterError:
        return
    try:
        decoded = list(decode_batches(buf))
    except TidewaterError:
        # The broker does not parse records; the consumer finds the damage.
        return
    assert len(decoded) == header.record_count
