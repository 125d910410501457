"""Broker-side checks of record batches.

The broker stores and serves batches as the producer built them, never re-encoded: it checks
the 61-byte header and the CRC32C, and for uncompressed batches walks the record length
varints to count records and the timestamp deltas. A compressed batch is stored compressed,
exactly as it came, but first decompressed (to at most MAX_RECORDS_SECTION_BYTES) and its
records walked as Kafka's LogValidator does: their count, offset deltas and field lengths,
skipping keys, values and headers (Kafka's skipKeyValueIterator), so that garbage compressed
under a valid CRC is refused rather than stored for consumers to fail on. The records'
timestamps must agree with the header's max timestamp (timestamp lookups and retention go by
it) and fall within the topic's message.timestamp.before/after.max.ms of the leader's clock
(KIP-937). Whatever a client could see is raised as a named TidewaterError.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from tidewater.errors import (
    CorruptMessage,
    InvalidTimestamp,
    MessageTooLarge,
    UnsupportedCompressionType,
    UnsupportedVersion,
)
from tidewater.records.compression import decompress
from tidewater.records.header import (
    CONTROL_BIT,
    HEADER_SIZE,
    LOG_OVERHEAD,
    MAGIC,
    NO_TIMESTAMP,
    TIMESTAMP_TYPE_BIT,
    TRANSACTIONAL_BIT,
    BatchHeader,
    Compression,
    crc_matches,
    read_header,
    read_offset_and_length,
)
from tidewater.records.varint import Buffer, decode_varint, decode_varlong

# The most a compressed records section may inflate to when someone must read its records
# (the leader checking a produced batch, consumers, ListOffsets); anything larger is treated
# as a zip bomb. One bound for all: a batch the leader takes is one its consumers can read.
MAX_RECORDS_SECTION_BYTES = 64 * 1024 * 1024
# attributes (1) + timestamp delta, offset delta, key length, value length, header count
# (at least 1 each): the smallest record that can exist after its length varint.
MIN_RECORD_BODY = 6
_MIN_RECORD_BODY_ZIGZAG = MIN_RECORD_BODY << 1
_MIN_BATCH_LENGTH = HEADER_SIZE - LOG_OVERHEAD
_HIGHEST_CODEC = max(Compression)
# Below and above any int64 timestamp delta: where a walk's lowest and highest start.
_ABOVE_DELTAS = 1 << 64


class TimestampDeltas(NamedTuple):
    """The lowest and highest timestamp delta of a batch's records."""

    lowest: int
    highest: int


class TimestampBounds(NamedTuple):
    """The CreateTime timestamps a leader takes (KIP-937): from `now_ms` back
    message.timestamp.before.max.ms to forward message.timestamp.after.max.ms."""

    now_ms: int
    before_max_ms: int
    after_max_ms: int


def validate_batch(
    buf: Buffer, max_message_bytes: int, bounds: TimestampBounds | None = None
) -> BatchHeader:
    """Check that `buf` is exactly one well-formed batch no larger than `max_message_bytes`
    (its timestamps within `bounds`, if given) and return its header; raise the
    TidewaterError a producer should see otherwise."""
    header = validate_batch_short_of_compressed_records(buf, max_message_bytes, bounds)
    if header.compression != Compression.NONE:
        check_compressed_records(buf, header, bounds=bounds)
    return header


def validate_batch_short_of_compressed_records(
    buf: Buffer, max_message_bytes: int, bounds: TimestampBounds | None = None
) -> BatchHeader:
    """validate_batch but for a compressed batch's records, which check_compressed_records
    checks: the one part that may cost more than a pass over the bytes received."""
    header = read_header(buf)
    _check_batch_length(header.batch_length, 0)
    if header.size != len(buf):
        raise CorruptMessage(
            f"batch_length {header.batch_length} describes a {header.size}-byte batch but "
            f"{len(buf)} bytes were sent; produce takes exactly one whole batch"
        )
    if header.size > max_message_bytes:
        raise MessageTooLarge(
            f"record batch is {header.size} bytes, above max.message.bytes {max_message_bytes}"
        )
    check_batch(buf, header)
    if header.compression == Compression.NONE:
        deltas = check_record_framing(buf, HEADER_SIZE, len(buf), header.record_count)
        check_timestamps(header, deltas, bounds)
    return header


def check_timestamps(
    header: BatchHeader, deltas: TimestampDeltas, bounds: TimestampBounds | None
) -> None:
    """The header's max timestamp is its records' largest, as Kafka's LogValidator computes it
    (it rewrites the header; a producer's own batch always agrees, so one that does not is
    refused here, CORRUPT_MESSAGE): an understated one hid records from timestamp lookups and
    let retention delete them early. The type is CreateTime: LogAppendTime is a broker's to
    set. With `bounds`, every record's timestamp is within them (INVALID_TIMESTAMP), but for
    records without one (-1)."""
    if header.attributes & TIMESTAMP_TYPE_BIT:
        raise InvalidTimestamp(
            "the batch says LogAppendTime: a producer's timestamps are CreateTime (the broker "
            "sets LogAppendTime, and this topic's message.timestamp.type is CreateTime)"
        )
    first = header.first_timestamp
    if first + deltas.highest != header.max_timestamp:
        raise CorruptMessage(
            f"the batch header's max timestamp {header.max_timestamp} is not its records' "
            f"largest, {first + deltas.highest}"
        )
    if bounds is None or header.max_timestamp == NO_TIMESTAMP:
        return
    earliest = bounds.now_ms - bounds.before_max_ms
    latest = bounds.now_ms + bounds.after_max_ms
    lowest = first + deltas.lowest
    # A record without a timestamp among others is not checked (Kafka skips it); the walk
    # keeps no second lowest, so the others' earliest is not checked then either (review
    # 24 #4: the batch was refused).
    if (lowest != NO_TIMESTAMP and lowest < earliest) or header.max_timestamp > latest:
        raise InvalidTimestamp(
            f"record timestamps {lowest}..{header.max_timestamp} are not all "
            f"within [{earliest}, {latest}]: at most message.timestamp.before.max.ms "
            f"({bounds.before_max_ms}) before the broker's clock ({bounds.now_ms}) and "
            f"message.timestamp.after.max.ms ({bounds.after_max_ms}) after it"
        )


def check_compressed_records(
    batch: Buffer,
    header: BatchHeader,
    limit: int = MAX_RECORDS_SECTION_BYTES,
    bounds: TimestampBounds | None = None,
) -> None:
    """The records of one whole compressed batch, decompressed to at most `limit` bytes (else
    DecompressedTooLarge), as check_records takes them, and their timestamps
    (check_timestamps).

    Kafka answers INVALID_RECORD for records that do not parse in a decompressed batch (and
    UNKNOWN_SERVER_ERROR when it does not decompress); this protocol has no INVALID_RECORD
    and answers CORRUPT_MESSAGE for the same defects in an uncompressed batch, as Kafka did
    before KIP-467. Both tell the producer not to retry: the CRC matched, so the batch was
    built so, not damaged on the way."""
    deltas = check_records(records_section(batch, header, limit), header.record_count)
    check_timestamps(header, deltas, bounds)


def check_batch(batch: Buffer, header: BatchHeader) -> None:
    """Checks on one whole batch short of its records: magic, CRC32C, attributes, counts.
    `batch` holds exactly the batch's bytes, which the CRC covers to the end."""
    if header.magic != MAGIC:
        raise UnsupportedVersion(
            f"record batch magic {header.magic} is not supported (only {MAGIC})"
        )
    if not crc_matches(batch, header):
        raise CorruptMessage(
            f"record batch at offset {header.base_offset} fails its CRC32C check "
            f"(header says {header.crc:#010x})"
        )
    if header.attributes & TRANSACTIONAL_BIT:
        raise UnsupportedVersion("transactional record batches are not supported")
    if header.attributes & CONTROL_BIT:
        raise UnsupportedVersion("control record batches are not supported")
    codec = header.compression
    if codec == Compression.SNAPPY:
        raise UnsupportedCompressionType("snappy compression is not supported")
    if codec > _HIGHEST_CODEC:
        raise CorruptMessage(f"record batch attributes name unknown compression codec {codec}")
    if header.record_count < 1:
        raise CorruptMessage(f"record batch has record_count {header.record_count}")
    if header.last_offset_delta != header.record_count - 1:
        raise CorruptMessage(
            f"record batch has last_offset_delta {header.last_offset_delta} for "
            f"{header.record_count} records"
        )


def check_record_framing(buf: Buffer, start: int, end: int, record_count: int) -> TimestampDeltas:
    """CorruptMessage unless the record length varints tile the records section buf[start:end]
    into exactly record_count records, each long enough to be one; their timestamp deltas.

    The broker runs this over every byte produced to it, so the loop stays flat: one- and
    two-byte lengths (every record under 8 KiB) and timestamp deltas (under 8 s) are decoded
    inline, in zigzag form."""
    pos = start
    seen = 0
    lowest, highest = _ABOVE_DELTAS, -_ABOVE_DELTAS
    while pos < end:
        zz = buf[pos]
        if zz < 0x80:
            body = pos + 1
        elif pos + 1 < end and buf[pos + 1] < 0x80:
            zz = (zz & 0x7F) | (buf[pos + 1] << 7)
            body = pos + 2
        else:
            length, body = decode_varint(buf, pos)
            zz = (length << 1) ^ (length >> 31)
        # Odd zigzag values are negative lengths.
        if zz & 1 or zz < _MIN_RECORD_BODY_ZIGZAG:
            raise CorruptMessage(
                f"record {seen} has length {(zz >> 1) ^ -(zz & 1)}; a record takes at least "
                f"{MIN_RECORD_BODY}"
            )
        pos = body + (zz >> 1)
        if pos > end:
            raise CorruptMessage(
                f"record {seen} has length {zz >> 1} but only {end - body} bytes remain"
            )
        # buf[body] is the record's attributes byte; the timestamp delta follows, within the
        # record's MIN_RECORD_BODY bytes.
        zz = buf[body + 1]
        if zz >= 0x80:
            if buf[body + 2] < 0x80:  # under 8 s
                zz = (zz & 0x7F) | (buf[body + 2] << 7)
            else:
                zz = _varlong_zigzag(buf, body + 1, pos)[0]
        delta = (zz >> 1) ^ -(zz & 1)
        if delta > highest:
            highest = delta
        if delta < lowest:
            lowest = delta
        seen += 1
    if seen > record_count:
        raise CorruptMessage(f"record batch holds more than its record_count {record_count}")
    if seen != record_count:
        raise CorruptMessage(f"record batch holds {seen} records, record_count says {record_count}")
    return TimestampDeltas(lowest, highest)


def _varlong_zigzag(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    """(zigzag form, position after it) of the varlong of two or more bytes at buf[pos],
    which must end before `end` (its record's end). Two and three bytes (timestamp deltas
    under 8 s and 17 min) are decoded here, without the general decoder's loop (review 24
    #3: 11 times the walk's cost for records 10-100 ms apart). A record holds at least
    MIN_RECORD_BODY bytes after its length, so these three are its own."""
    second = buf[pos + 1]
    if second < 0x80:
        return (buf[pos] & 0x7F) | (second << 7), pos + 2
    third = buf[pos + 2]
    if third < 0x80:
        return (buf[pos] & 0x7F) | ((second & 0x7F) << 7) | (third << 14), pos + 3
    value, after = decode_varlong(buf, pos)
    if after > end:
        raise CorruptMessage(f"a record's timestamp delta runs past its end at {end}")
    return (value << 1) ^ (value >> 63), after


def check_records(section: Buffer, record_count: int) -> TimestampDeltas:
    """CorruptMessage unless the (decompressed) records section `section` is exactly
    record_count records, each filled by its fields, with offset deltas 0, 1, ...
    record_count - 1: attributes, timestamp delta, offset delta, then key, value and headers,
    whose lengths are checked and whose bytes are skipped (Kafka's skipKeyValueIterator); their
    timestamp deltas. A
    producer writes the deltas so; Kafka rewrites a batch whose deltas run otherwise, which
    this broker never does.

    The broker runs this over every compressed batch produced to it, and CPython's cost here
    is per bytecode, so the common record (one- or two-byte varints, a null or short key, no
    headers) is walked in one flat loop with no calls; anything else takes a helper that
    decodes in full. A read past the section's end is an IndexError, turned into
    CorruptMessage once for the whole walk."""
    size = len(section)
    pos = 0
    expected = 0
    lowest, highest = _ABOVE_DELTAS, -_ABOVE_DELTAS
    try:
        for expected in range(record_count):
            if pos >= size:
                break
            zz = section[pos]  # the record's length, as in check_record_framing
            if zz < 0x80:
                body = pos + 1
            elif section[pos + 1] < 0x80:
                zz = (zz & 0x7F) | (section[pos + 1] << 7)
                body = pos + 2
            else:
                length, body = decode_varint(section, pos)
                zz = (length << 1) ^ (length >> 31)
            end = body + (zz >> 1)
            if zz & 1 or zz < _MIN_RECORD_BODY_ZIGZAG or end > size:
                raise CorruptMessage(
                    f"record {expected} has length {(zz >> 1) ^ -(zz & 1)}: below "
                    f"{MIN_RECORD_BODY} or past the {size - body} bytes that remain"
                )
            # section[body] is the record's attributes byte; the timestamp delta follows,
            # a varlong of up to 10 bytes (1 for deltas under 64 ms).
            zz = section[body + 1]
            if zz < 0x80:
                pos = body + 2
            else:
                zz, pos = _varlong_zigzag(section, body + 1, end)
            delta = (zz >> 1) ^ -(zz & 1)
            if delta > highest:
                highest = delta
            if delta < lowest:
                lowest = delta
            zz = expected << 1  # the offset delta's zigzag form, in one to three bytes
            if zz < 0x80 and section[pos] == zz:
                pos += 1
            elif zz < 0x4000 and section[pos] == zz & 0x7F | 0x80 and section[pos + 1] == zz >> 7:
                pos += 2
            elif (
                zz < 0x200000
                and section[pos] == zz & 0x7F | 0x80
                and section[pos + 1] == (zz >> 7) & 0x7F | 0x80
                and section[pos + 2] == zz >> 14
            ):
                pos += 3
            else:
                offset_delta, pos = decode_varint(section, pos)
                if offset_delta != expected:
                    raise CorruptMessage(f"record {expected} has offset delta {offset_delta}")
            # Key and value: a length (-1, zigzag 1: null) and its bytes. Even zigzag values
            # are lengths >= 0; odd ones other than 1 are refused by _skip_field.
            zz = section[pos]
            if zz == 1:
                pos += 1
            elif zz < 0x80 and not zz & 1:
                pos += 1 + (zz >> 1)
            else:
                pos = _skip_field(section, pos, expected)
            zz = section[pos]
            if zz < 0x80 and not zz & 1:
                pos += 1 + (zz >> 1)
            elif zz >= 0x80 and not zz & 1 and section[pos + 1] < 0x80:
                pos += 2 + (((zz & 0x7F) | (section[pos + 1] << 7)) >> 1)
            else:
                pos = _skip_field(section, pos, expected)
            # No headers (a zero count) ending the record exactly, or the full walk.
            if pos + 1 != end or section[pos]:
                pos = _skip_headers(section, pos, expected)
                if pos != end:
                    raise CorruptMessage(f"record {expected} does not fill its length {end - body}")
            pos = end
        else:
            expected = record_count
    except IndexError:
        raise CorruptMessage(f"record {expected} runs past the end of the records") from None
    if expected < record_count:
        raise CorruptMessage(
            f"record batch holds {expected} records, record_count says {record_count}"
        )
    if pos != size:
        raise CorruptMessage(
            f"record batch has {size - pos} bytes after its record_count {record_count} records"
        )
    return TimestampDeltas(lowest, highest)


def _skip_field(section: Buffer, pos: int, record: int) -> int:
    """The position after the length-prefixed (-1: null) key, value or header value at
    `pos` in record number `record`."""
    length, pos = decode_varint(section, pos)
    if length < -1:
        raise CorruptMessage(f"record {record} has a field of length {length}")
    return pos + max(length, 0)


def _skip_headers(section: Buffer, pos: int, record: int) -> int:
    """The position after the header count and headers at `pos` in record number `record`."""
    count, pos = decode_varint(section, pos)
    if count < 0:
        raise CorruptMessage(f"record {record} has header count {count}")
    for _ in range(count):
        # A header's key is a string: a length >= 0, never null.
        zz = section[pos]
        if zz < 0x80 and not zz & 1:
            pos += 1 + (zz >> 1)
        else:
            key_length, pos = decode_varint(section, pos)
            if key_length < 0:
                raise CorruptMessage(f"record {record} has a header key of length {key_length}")
            pos += key_length
        zz = section[pos]
        if zz < 0x80 and not zz & 1:
            pos += 1 + (zz >> 1)
        else:
            pos = _skip_field(section, pos, record)
    return pos


def iter_record_bounds(
    buf: Buffer, start: int, end: int, record_count: int
) -> Iterator[tuple[int, int]]:
    """(start, end) of each record's body (what follows its length varint) in the records
    section buf[start:end]; CorruptMessage unless the lengths tile it into record_count
    records exactly."""
    check_record_framing(buf, start, end, record_count)
    pos = start
    while pos < end:
        length, body = decode_varint(buf, pos)
        pos = body + length
        yield body, pos


def records_section(batch: Buffer, header: BatchHeader, limit: int) -> Buffer:
    """The records of one whole batch, decompressed (to at most `limit` bytes) if need be."""
    body = memoryview(batch)[HEADER_SIZE : header.size]
    if header.compression == Compression.NONE:
        return body
    return decompress(header.compression, body, limit)


def iter_batch_headers(
    buf: Buffer, *, ignore_partial_tail: bool = False
) -> Iterator[tuple[int, BatchHeader]]:
    """(position, header) of each batch in concatenated whole batches. A trailing partial
    batch is a CorruptMessage, or silently ends the walk with `ignore_partial_tail` (as
    consumers read fetch responses). Only the framing is checked, not magic or CRC."""
    pos = 0
    end = len(buf)
    while pos < end:
        if end - pos >= LOG_OVERHEAD:
            _, batch_length = read_offset_and_length(buf, pos)
            _check_batch_length(batch_length, pos)
            if batch_length + LOG_OVERHEAD <= end - pos:
                header = read_header(buf, pos)
                yield pos, header
                pos += header.size
                continue
        if ignore_partial_tail:
            return
        raise CorruptMessage(f"partial record batch: {end - pos} trailing bytes at {pos}")


def find_offset_by_timestamp(
    batch: Buffer,
    target_ms: int,
    *,
    starting_offset: int = 0,
    limit: int = MAX_RECORDS_SECTION_BYTES,
) -> tuple[int, int] | None:
    """(offset, timestamp) of the first record of one whole batch at or after starting_offset
    with timestamp >= target_ms, or None. In a LogAppendTime batch every record carries
    max_timestamp. The batch comes from the log, validated on append, so its CRC is not
    checked again."""
    header = read_header(batch)
    if header.max_timestamp < target_ms:
        return None
    section = records_section(batch, header, limit)
    for body, _ in iter_record_bounds(section, 0, len(section), header.record_count):
        # body[0] is the record's attributes byte.
        timestamp_delta, pos = decode_varlong(section, body + 1)
        offset_delta, _ = decode_varint(section, pos)
        if header.log_append_time:
            timestamp = header.max_timestamp
        else:
            timestamp = header.first_timestamp + timestamp_delta
        if timestamp >= target_ms and header.base_offset + offset_delta >= starting_offset:
            return header.base_offset + offset_delta, timestamp
    return None


def _check_batch_length(batch_length: int, pos: int) -> None:
    if batch_length < 0:
        raise CorruptMessage(f"record batch at byte {pos} has negative batch_length {batch_length}")
    if batch_length < _MIN_BATCH_LENGTH:
        raise CorruptMessage(
            f"record batch at byte {pos} has batch_length {batch_length}, too small for the "
            f"{HEADER_SIZE}-byte header"
        )
