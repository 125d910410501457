"""Byte layout of a record batch header (Kafka's v2 layout; see protos/RECORD_BATCH.md).

Everything the broker needs lives in these 61 bytes; it never decodes single records to
store or serve them. All integers are big-endian.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import crc32c

from tidewater.errors import CorruptMessage

#   base_offset int64 | batch_length int32 | partition_leader_epoch int32 | magic int8 |
#   crc uint32 | attributes int16 | last_offset_delta int32 | first_timestamp int64 |
#   max_timestamp int64 | producer_id int64 | producer_epoch int16 | base_sequence int32 |
#   record_count int32
HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size  # 61
# base_offset and batch_length precede what batch_length counts.
LOG_OVERHEAD = 12
PARTITION_LEADER_EPOCH_OFFSET = 12
MAGIC_OFFSET = 16
CRC_OFFSET = 17
# The CRC32C covers attributes through the end of the batch, so the broker can patch the
# base offset and leader epoch without recomputing it.
ATTRIBUTES_OFFSET = 21
MAGIC = 2

_OFFSET_AND_LENGTH = struct.Struct(">qi")
_LEADER_EPOCH = struct.Struct(">i")

NO_PRODUCER_ID = -1
NO_PRODUCER_EPOCH = -1
NO_SEQUENCE = -1
# The producer epoch is an int16; sequences are an int32 that wraps from SEQUENCE_MAX to 0.
MAX_PRODUCER_EPOCH = 2**15 - 1
SEQUENCE_MAX = 2**31 - 1
NO_PARTITION_LEADER_EPOCH = -1


class Compression(enum.IntEnum):
    """Attributes bits 0-2."""

    NONE = 0
    GZIP = 1
    SNAPPY = 2  # defined by Kafka, not supported by Tidewater
    LZ4 = 3
    ZSTD = 4


COMPRESSION_MASK = 0x07
TIMESTAMP_TYPE_BIT = 0x08  # 0 = CreateTime (producer's), 1 = LogAppendTime (broker's)
NO_TIMESTAMP = -1  # a record without a timestamp (Kafka's RecordBatch.NO_TIMESTAMP)
TRANSACTIONAL_BIT = 0x10
CONTROL_BIT = 0x20


class BatchHeader(NamedTuple):
    base_offset: int
    batch_length: int
    partition_leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    first_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    record_count: int

    @property
    def size(self) -> int:
        """Bytes of the whole batch, header included."""
        return self.batch_length + LOG_OVERHEAD

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.last_offset_delta + 1

    @property
    def compression(self) -> int:
        return self.attributes & COMPRESSION_MASK

    @property
    def log_append_time(self) -> bool:
        return bool(self.attributes & TIMESTAMP_TYPE_BIT)


def read_header(buf: bytes | bytearray | memoryview, pos: int = 0) -> BatchHeader:
    """Parse the header at buf[pos:]; CorruptMessage if fewer than HEADER_SIZE bytes remain."""
    if len(buf) - pos < HEADER_SIZE:
        raise CorruptMessage(
            f"record batch header needs {HEADER_SIZE} bytes, {len(buf) - pos} available"
        )
    return BatchHeader._make(HEADER.unpack_from(buf, pos))


def read_offset_and_length(buf: bytes | bytearray | memoryview, pos: int = 0) -> tuple[int, int]:
    """(base_offset, batch_length) of the batch at buf[pos:], for scans that need no more."""
    return _OFFSET_AND_LENGTH.unpack_from(buf, pos)


def next_offset_after(batches: bytes | bytearray | memoryview) -> int:
    """The offset after the last of whole `batches` (not empty): its header alone is read."""
    pos = last = 0
    while pos < len(batches):
        last = pos
        pos += LOG_OVERHEAD + read_offset_and_length(batches, pos)[1]
    return read_header(batches, last).next_offset


def patch_base_offset_and_epoch(
    buf: bytearray | memoryview, pos: int, base_offset: int, partition_leader_epoch: int
) -> None:
    """Stamp the broker-assigned base offset and the leader epoch; the CRC stays valid."""
    _OFFSET_AND_LENGTH.pack_into(buf, pos, base_offset, read_offset_and_length(buf, pos)[1])
    _LEADER_EPOCH.pack_into(buf, pos + PARTITION_LEADER_EPOCH_OFFSET, partition_leader_epoch)


def compute_crc(batch: bytes | bytearray | memoryview) -> int:
    """CRC32C of one whole batch, over attributes through the end."""
    return crc32c.crc32c(memoryview(batch)[ATTRIBUTES_OFFSET:])


def crc_matches(batch: bytes | bytearray | memoryview, header: BatchHeader) -> bool:
    return compute_crc(batch) == header.crc
