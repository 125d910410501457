from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.records.strategies import CODECS, batches
from tidewater.errors import (
    CorruptMessage,
    InvalidTimestamp,
    MessageTooLarge,
    TidewaterError,
    UnsupportedCompressionType,
    UnsupportedVersion,
)
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.records.compression import compress
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
    MAX_RECORDS_SECTION_BYTES,
    TimestampBounds,
    find_offset_by_timestamp,
    iter_batch_headers,
    validate_batch,
)
from tidewater.records.varint import encode_varint, encode_varlong

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


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("change", [-1, 1, 5000])
def test_a_max_timestamp_that_is_not_the_records_largest_is_corrupt(
    codec: Compression, change: int, rewrite: Callable[..., bytes]
) -> None:
    """Review 21 #2: the broker took the header's max timestamp on trust; an understated one
    hid records from timestamp lookups and let retention delete them early. Kafka's
    LogValidator computes it from the records (and rewrites the header); a producer's own
    batch always agrees, so one that does not is refused."""
    batch = rewrite(three_records(codec), max_timestamp=T0 + 2 + change)
    with pytest.raises(
        CorruptMessage, match=f"max timestamp {T0 + 2 + change} .* largest, {T0 + 2}"
    ):
        validate_batch(batch, LIMIT)


@pytest.mark.parametrize("codec", CODECS)
def test_the_largest_timestamp_need_not_be_the_last_records(codec: Compression) -> None:
    stamps = [T0 + 5, T0 + 900_000, T0 - 70_000, T0 + 3]  # deltas of 1 to 3 varint bytes
    records = [Record(value=b"v", timestamp_ms=t) for t in stamps]
    header = validate_batch(build_batch(records, compression=codec), LIMIT)
    assert header.max_timestamp == T0 + 900_000


def test_a_producer_batch_may_not_claim_log_append_time(rewrite: Callable[..., bytes]) -> None:
    batch = rewrite(three_records(), attributes=TIMESTAMP_TYPE_BIT)
    with pytest.raises(InvalidTimestamp, match="LogAppendTime"):
        validate_batch(batch, LIMIT)


@pytest.mark.parametrize("codec", CODECS)
def test_record_timestamps_must_be_within_the_topics_bounds(codec: Compression) -> None:
    """KIP-937's message.timestamp.before.max.ms and after.max.ms, every record's (not only
    the first or the largest): a record far in the future held its segment, and those after
    it, past retention.ms."""
    stamps = [T0, T0 - 10_000, T0 + 20_000]
    batch = build_batch([Record(value=b"v", timestamp_ms=t) for t in stamps], compression=codec)
    validate_batch(batch, LIMIT, TimestampBounds(T0, 10_000, 20_000))
    for bounds in (TimestampBounds(T0, 9_999, 20_000), TimestampBounds(T0, 10_000, 19_999)):
        with pytest.raises(InvalidTimestamp, match=r"not all within"):
            validate_batch(batch, LIMIT, bounds)
    # Records without a timestamp (-1) are not checked, alone or among others (review 24 #4).
    untimed = build_batch([Record(value=b"v", timestamp_ms=-1)] * 2, compression=codec)
    validate_batch(untimed, LIMIT, TimestampBounds(T0, 0, 0))
    for mixed in ([-1, T0], [T0, -1]):
        records = [Record(value=b"v", timestamp_ms=t) for t in mixed]
        validate_batch(build_batch(records, compression=codec), LIMIT, TimestampBounds(T0, 0, 0))


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


COMPRESSED = [Compression.GZIP, Compression.LZ4, Compression.ZSTD]
CODEC_NAMES = [c.name.lower() for c in COMPRESSED]


def raw_record(offset_delta: int, *, key_length: int = -1, tail: bytes = b"") -> bytes:
    """One record as it stands in a records section: a null key (or just a key length), the
    value b"v", no headers; `tail` is added inside its length."""
    body = (
        b"\x00"  # attributes
        + encode_varlong(0)  # timestamp delta
        + encode_varint(offset_delta)
        + encode_varint(key_length)
        + encode_varint(1)
        + b"v"
        + encode_varint(0)  # header count
        + tail
    )
    return encode_varint(len(body)) + body


def three_raw(*deltas: int) -> bytes:
    return b"".join(raw_record(d) for d in deltas or (0, 1, 2))


@pytest.mark.parametrize("codec", COMPRESSED, ids=CODEC_NAMES)
def test_raw_records_are_what_a_producer_writes(
    codec: Compression, rewrite: Callable[..., bytes]
) -> None:
    # The helper's section is a valid one: the malformations below are its only defects.
    batch = build_batch([Record(value=b"v", timestamp_ms=T0)] * 3, compression=codec)
    section = compress(codec, three_raw())
    batch = rewrite(batch, section=section)
    assert validate_batch(batch, LIMIT).record_count == 3
    assert [r.value for r in decode_batches(batch)] == [b"v"] * 3


@pytest.mark.parametrize("codec", COMPRESSED, ids=CODEC_NAMES)
@pytest.mark.parametrize(
    ("section", "count", "message"),
    [
        pytest.param(None, 3, "malformed|truncated", id="garbage"),
        pytest.param(three_raw(), 4, "holds 3 records", id="fewer-records-than-count"),
        pytest.param(three_raw(), 2, "bytes after its record_count 2", id="more-than-count"),
        pytest.param(three_raw() + b"\x00", 3, "1 bytes after", id="trailing-byte"),
        pytest.param(three_raw(0, 2, 3), 3, "record 1 has offset delta 2", id="offset-gap"),
        pytest.param(three_raw(0, 0, 1), 3, "record 1 has offset delta 0", id="offset-repeat"),
        pytest.param(three_raw(1, 2, 3), 3, "record 0 has offset delta 1", id="offset-start"),
        pytest.param(b"\x80" * 6 + three_raw(), 3, "longer than 5 bytes", id="overlong-length"),
        pytest.param(b"\x03" + three_raw(), 3, "record 0 has length -2", id="negative-length"),
        pytest.param(b"\x08" + bytes(4) + three_raw(), 3, "has length 4", id="short-record"),
        pytest.param(
            three_raw()[:-1],
            3,
            "record 2 has length 7: below 6 or past the 6 bytes",
            id="cut-short",
        ),
        pytest.param(
            raw_record(0, tail=b"\x00") + raw_record(1) + raw_record(2),
            3,
            "record 0 does not fill its length",
            id="record-not-filled",
        ),
        pytest.param(
            raw_record(0, key_length=-2) + raw_record(1) + raw_record(2),
            3,
            "record 0 has a field of length -2",
            id="negative-key-length",
        ),
        pytest.param(
            raw_record(0, key_length=40) + raw_record(1) + raw_record(2),
            3,
            "record 0 does not fill|runs past",
            id="key-past-its-record",
        ),
    ],
)
def test_compressed_records_are_checked(
    codec: Compression,
    section: bytes | None,
    count: int,
    message: str,
    rewrite: Callable[..., bytes],
) -> None:
    """The records of a compressed batch are decompressed and walked as Kafka's LogValidator
    does; every defect is CORRUPT_MESSAGE. Before, only the header and CRC were checked, and
    these batches were accepted."""
    body = b"not compressed at all" if section is None else compress(codec, section)
    batch = rewrite(
        three_records(codec), section=body, record_count=count, last_offset_delta=count - 1
    )
    with pytest.raises(CorruptMessage, match=message):
        validate_batch(batch, LIMIT)


def record_with_headers(headers: bytes) -> bytes:
    """Record 0 with a null key, the value b"v" and `headers` (count and headers) as given."""
    body = b"\x00" + encode_varlong(0) + encode_varint(0) + b"\x01" + b"\x02v" + headers
    return encode_varint(len(body)) + body


@pytest.mark.parametrize("codec", COMPRESSED, ids=CODEC_NAMES)
@pytest.mark.parametrize(
    ("headers", "message"),
    [
        pytest.param(encode_varint(-1), "record 0 has header count -1", id="negative-count"),
        pytest.param(
            encode_varint(1) + encode_varint(-1) + encode_varint(-1),
            "record 0 has a header key of length -1",
            id="null-key",
        ),
        pytest.param(
            encode_varint(1) + encode_varint(1) + b"h" + encode_varint(-2),
            "record 0 has a field of length -2",
            id="negative-value-length",
        ),
    ],
)
def test_header_defects_name_their_record(
    codec: Compression, headers: bytes, message: str, rewrite: Callable[..., bytes]
) -> None:
    """A header's defect is refused naming its record, as a key's or value's is (before, it
    named a byte position in the decompressed records, which the producer never sees)."""
    body = compress(codec, record_with_headers(headers))
    batch = rewrite(three_records(codec), section=body, record_count=1, last_offset_delta=0)
    with pytest.raises(CorruptMessage, match=message):
        validate_batch(batch, LIMIT)


@pytest.mark.parametrize("codec", COMPRESSED, ids=CODEC_NAMES)
def test_a_compressed_batch_decompressing_past_the_bound_is_refused(
    codec: Compression, rewrite: Callable[..., bytes]
) -> None:
    """A decompression bomb: a small batch whose records section inflates past what any
    reader will take (MAX_RECORDS_SECTION_BYTES) is refused before that much is held."""
    record = raw_record(0)
    section = record + bytes(MAX_RECORDS_SECTION_BYTES)
    batch = rewrite(
        three_records(codec),
        section=compress(codec, section),
        record_count=1,
        last_offset_delta=0,
    )
    assert len(batch) < LIMIT
    with pytest.raises(CorruptMessage, match="decompresses to more than"):
        validate_batch(batch, LIMIT)


@pytest.mark.parametrize("codec", COMPRESSED, ids=CODEC_NAMES)
def test_compressed_batches_of_every_shape_are_accepted(codec: Compression) -> None:
    """No false refusals: offset deltas of one to three bytes (up to 9,000 records),
    timestamp deltas of many bytes, null and empty keys and values, headers, long values."""
    records = [
        Record(
            key=None if i % 3 == 0 else b"k" * (i % 5),
            value=None if i % 7 == 0 else bytes(i % 300),
            headers=(("h", b"x"), ("empty", None)) if i % 11 == 0 else (),
            timestamp_ms=T0 + i * 1_000_003,
        )
        for i in range(9000)
    ]
    records.append(Record(value=bytes(20_000), timestamp_ms=T0 - 5))
    batch = build_batch(records, compression=codec)
    assert validate_batch(batch, len(batch)).record_count == 9001


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


BATCHES = batches(max_records=8, max_value=64)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(original, mutation): a valid batch and a damaged copy, re-signed or not."""
    batch = draw(BATCHES)
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
