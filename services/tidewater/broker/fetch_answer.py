"""A FetchResponse as the leader sends it: the record bytes spliced into the wire encoding.

protobuf's Python messages copy a bytes field at every step (set it, CopyFrom it into the
response, serialize): three or four copies of every MiB a leader serves, each ~75 µs when the
bytes are not in the CPU cache. protobuf's wire format lets a message be written as its fields
one after the other, in any order, so the small fields go through protobuf and each
partition's records are joined into the encoding once."""

from __future__ import annotations

from collections.abc import Sequence

from tidewater.records.varint import encode_unsigned_varint
from tidewater.v1 import broker_pb2 as pb

# One partition's answer: everything but its records, and its records (whole batches).
PartitionAnswer = tuple[pb.FetchPartitionResponse, bytes | memoryview]

_LEN = 2  # protobuf wire type of length-delimited fields


def _tag(message: type[pb.FetchResponse] | type[pb.FetchPartitionResponse], field: str) -> bytes:
    return encode_unsigned_varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | _LEN)


_PARTITIONS_TAG = _tag(pb.FetchResponse, "partitions")
_RECORD_BATCHES_TAG = _tag(pb.FetchPartitionResponse, "record_batches")


class FetchAnswer:
    """`header`: the response's own fields (no partitions); `partitions`: each partition's
    answer, whose protobuf part leaves record_batches empty."""

    __slots__ = ("header", "partitions")

    def __init__(
        self, header: pb.FetchResponse, partitions: Sequence[PartitionAnswer] = ()
    ) -> None:
        self.header = header
        self.partitions = partitions

    @property
    def error_code(self) -> int:
        return self.header.error_code

    @property
    def error_message(self) -> str:
        return self.header.error_message

    def serialize(self) -> bytes:
        """The FetchResponse's encoding, with each partition's records copied once."""
        parts = [self.header.SerializeToString()]
        for response, records in self.partitions:
            encoded = response.SerializeToString()
            if records:
                length = encode_unsigned_varint(len(records))
                size = len(encoded) + len(_RECORD_BATCHES_TAG) + len(length) + len(records)
                parts += (_PARTITIONS_TAG, encode_unsigned_varint(size), encoded)
                parts += (_RECORD_BATCHES_TAG, length, records)
            else:
                parts += (_PARTITIONS_TAG, encode_unsigned_varint(len(encoded)), encoded)
        return b"".join(parts)
