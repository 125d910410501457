"""Client side of the record batch format: build a batch from records, decode fetched batches.

The layout is Kafka's record batch v2 (see protos/RECORD_BATCH.md and header.py). A producer
builds with base_offset 0; the leader stamps the real base offset and its leader epoch, both
outside the CRC.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tidewater.errors import CorruptMessage
from tidewater.records.compression import compress
from tidewater.records.header import (
    CRC_OFFSET,
    HEADER,
    HEADER_SIZE,
    LOG_OVERHEAD,
    MAGIC,
    NO_PARTITION_LEADER_EPOCH,
    NO_PRODUCER_EPOCH,
    NO_PRODUCER_ID,
    NO_SEQUENCE,
    BatchHeader,
    Compression,
    compute_crc,
)
from tidewater.records.validate import (
    MAX_RECORDS_SECTION_BYTES,
    check_batch,
    iter_batch_headers,
    iter_record_bounds,
    records_section,
)
from tidewater.records.varint import (
    Buffer,
    decode_varint,
    decode_varlong,
    encode_varint,
    encode_varlong,
)

Headers = tuple[tuple[str, bytes | None], ...]

_CRC = struct.Struct(">I")
_NULL = encode_varint(-1)
# A record's attributes byte (always 0) and, reused, an empty header count.
_ZERO = b"\x00"


class Record(NamedTuple):
    """A record to produce. timestamp_ms None means the time the batch is built. A named
    tuple: a producer makes one per send(), and a tuple is three times cheaper to make than
    a frozen dataclass."""

    key: bytes | None = None
    value: bytes | None = None
    headers: Headers = ()
    timestamp_ms: int | None = None


@dataclass(frozen=True, slots=True)
class ConsumerRecord:
    """A fetched record; leader_epoch is the epoch of the leader that appended its batch."""

    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: Headers
    leader_epoch: int


def build_batch(
    records: Sequence[Record],
    *,
    compression: Compression = Compression.NONE,
    base_offset: int = 0,
    partition_leader_epoch: int = NO_PARTITION_LEADER_EPOCH,
    producer_id: int = NO_PRODUCER_ID,
    producer_epoch: int = NO_PRODUCER_EPOCH,
    base_sequence: int = NO_SEQUENCE,
    now_ms: int | None = None,
) -> bytes:
    """One record batch (CreateTime timestamps) holding `records` in order."""
    if not records:
        raise ValueError("a record batch needs at least one record")
    if now_ms is None:
        now_ms = time.time_ns() // 1_000_000
    first_timestamp = records[0].timestamp_ms
    if first_timestamp is None:
        first_timestamp = now_ms
    max_timestamp = first_timestamp
    # Byte strings joined once: cheaper than growing a bytearray field by field.
    parts = [bytes(HEADER_SIZE)]
    append = parts.append
    for offset_delta, (key, value, headers, timestamp) in enumerate(records):
        if timestamp is None:
            timestamp = now_ms
        if timestamp > max_timestamp:
            max_timestamp = timestamp
        body = b"".join(
            (
                _ZERO,
                encode_varlong(timestamp - first_timestamp),
                encode_varint(offset_delta),
                _NULL if key is None else encode_varint(len(key)) + key,
                _NULL if value is None else encode_varint(len(value)) + value,
                _encode_headers(headers) if headers else _ZERO,
            )
        )
        append(encode_varint(len(body)))
        append(body)
    batch = bytearray().join(parts)
    if compression != Compression.NONE:
        section = compress(compression, batch[HEADER_SIZE:])
        del batch[HEADER_SIZE:]
        batch += section
    HEADER.pack_into(
        batch,
        0,
        base_offset,
        len(batch) - LOG_OVERHEAD,
        partition_leader_epoch,
        MAGIC,
        0,  # the CRC, computed below over everything from the attributes on
        int(compression),
        len(records) - 1,
        first_timestamp,
        max_timestamp,
        producer_id,
        producer_epoch,
        base_sequence,
        len(records),
    )
    _CRC.pack_into(batch, CRC_OFFSET, compute_crc(batch))
    return bytes(batch)


def _encode_headers(headers: Headers) -> bytes:
    parts = [encode_varint(len(headers))]
    for key, value in headers:
        key_bytes = key.encode()
        parts.append(encode_varint(len(key_bytes)))
        parts.append(key_bytes)
        parts.append(_NULL if value is None else encode_varint(len(value)) + value)
    return b"".join(parts)


def decode_batches(
    buf: Buffer, *, limit: int = MAX_RECORDS_SECTION_BYTES
) -> Iterator[ConsumerRecord]:
    """The records of one or more concatenated batches, as a fetch returns them. A partial
    batch at the end (a fetch cut at its size limit) is ignored; a batch that fails its CRC
    or is malformed raises the matching TidewaterError. `limit` caps a batch's decompressed
    records section."""
    view = memoryview(buf)
    for pos, header in iter_batch_headers(view, ignore_partial_tail=True):
        batch = view[pos : pos + header.size]
        check_batch(batch, header)
        yield from _decode_records(bytes(records_section(batch, header, limit)), header)


def _decode_records(section: bytes, header: BatchHeader) -> Iterator[ConsumerRecord]:
    base_offset = header.base_offset
    first_timestamp = header.first_timestamp
    append_time = header.max_timestamp if header.log_append_time else None
    epoch = header.partition_leader_epoch
    for body, end in iter_record_bounds(section, 0, len(section), header.record_count):
        # body[0] is the record's attributes byte, unused in v2.
        timestamp_delta, pos = decode_varlong(section, body + 1)
        offset_delta, pos = decode_varint(section, pos)
        key, pos = _read_bytes(section, pos, end)
        value, pos = _read_bytes(section, pos, end)
        headers, pos = _read_headers(section, pos, end)
        if pos != end:
            raise CorruptMessage(
                f"record at offset {base_offset + offset_delta} does not fill its length"
            )
        yield ConsumerRecord(
            base_offset + offset_delta,
            first_timestamp + timestamp_delta if append_time is None else append_time,
            key,
            value,
            headers,
            epoch,
        )


def _read_bytes(section: bytes, pos: int, end: int) -> tuple[bytes | None, int]:
    length, pos = decode_varint(section, pos)
    if length == -1:
        return None, pos
    if length < 0 or pos + length > end:
        raise CorruptMessage(f"field length {length} at byte {pos} overruns its record")
    return section[pos : pos + length], pos + length


def _read_headers(section: bytes, pos: int, end: int) -> tuple[Headers, int]:
    count, pos = decode_varint(section, pos)
    if count == 0:
        return (), pos
    # Each header takes at least two bytes (key and value lengths).
    if count < 0 or 2 * count > end - pos:
        raise CorruptMessage(f"header count {count} at byte {pos} overruns its record")
    headers = []
    for _ in range(count):
        key, pos = _read_bytes(section, pos, end)
        if key is None:
            raise CorruptMessage(f"header key at byte {pos} is null")
        try:
            name = key.decode()
        except UnicodeDecodeError as e:
            raise CorruptMessage(f"header key at byte {pos} is not UTF-8") from e
        value, pos = _read_bytes(section, pos, end)
        headers.append((name, value))
    return tuple(headers), pos
