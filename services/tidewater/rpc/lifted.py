"""Parsing messages that carry record batches without protobuf's copies of them.

protobuf's Python messages copy a bytes field when they parse it and again at each read: two
copies of every MiB of records a broker receives (a produce's batch on a leader, a fetch
answer's batches on a follower), besides the one gRPC makes. protobuf's wire format lets a
reader find a field in the encoding: a Lifter parses a message with one bytes field of every
element of one repeated field taken out, as views of the received buffer, and passes the rest
(a few dozen bytes) to protobuf. Small messages, whose copies cost less than walking them in
Python, go to protobuf whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError, Message

from tidewater.errors import CorruptMessage
from tidewater.records.varint import decode_unsigned_varint, encode_unsigned_varint

M = TypeVar("M", bound=Message)

# Below this many bytes a message is parsed by protobuf alone.
LIFT_MIN_BYTES = 64 * 1024
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


class Lifted(Generic[M]):
    """`message`: the message, less the lifted fields; `views[i]`: the lifted field of its
    i-th element, or None if it is in the message (absent, or a message parsed whole)."""

    __slots__ = ("message", "views")

    def __init__(self, message: M, views: Sequence[memoryview | None]) -> None:
        self.message = message
        self.views = views


class Lifter(Generic[M]):
    """Parses `message_type`, lifting `field` (bytes) out of each element of `repeated`."""

    def __init__(self, message_type: type[M], repeated: str, field: str) -> None:
        self.message_type = message_type
        outer = message_type.DESCRIPTOR.fields_by_name[repeated]
        self._repeated = repeated
        self._outer_number = outer.number
        self._outer_tag = encode_unsigned_varint(outer.number << 3 | _LEN)
        self._inner_number = outer.message_type.fields_by_name[field].number

    def parse(self, raw: bytes) -> Lifted[M]:
        """The gRPC deserializer: DecodeError for what protobuf would not parse either."""
        if len(raw) >= LIFT_MIN_BYTES:
            try:
                return self._lift(raw)
            except (ValueError, CorruptMessage, DecodeError):
                pass  # not an encoding protobuf writes: protobuf judges it alone
        message = self.message_type.FromString(raw)
        return Lifted(message, [None] * len(getattr(message, self._repeated)))

    def _lift(self, raw: bytes) -> Lifted[M]:
        view = memoryview(raw)
        parts: list[bytes] = []
        views: list[memoryview | None] = []
        done = 0  # raw[:done] is in parts
        for number, wire_type, start, value_start, end in _fields(raw, 0, len(raw)):
            if number != self._outer_number:
                continue
            if wire_type != _LEN:
                raise ValueError("a repeated message field that is not length-delimited")
            element: list[bytes] = []
            lifted = None
            kept_from = value_start
            for inner, inner_type, inner_start, inner_value, inner_end in _fields(
                raw, value_start, end
            ):
                if inner == self._inner_number and inner_type == _LEN:
                    element.append(raw[kept_from:inner_start])
                    kept_from = inner_end
                    lifted = view[inner_value:inner_end]  # the last one wins, as in protobuf
            views.append(lifted)
            if lifted is None:
                continue
            element.append(raw[kept_from:end])
            rest = b"".join(element)
            parts += (
                raw[done:start],
                self._outer_tag,
                encode_unsigned_varint(len(rest)),
                rest,
            )
            done = end
        parts.append(raw[done:])
        message = self.message_type.FromString(b"".join(parts))
        if len(getattr(message, self._repeated)) != len(views):
            raise ValueError("repeated elements miscounted")
        return Lifted(message, views)


def _fields(buf: bytes, start: int, end: int) -> list[tuple[int, int, int, int, int]]:
    """(number, wire type, start, value start, end) of each field in buf[start:end];
    ValueError or CorruptMessage for anything but whole fields of wire types 0, 1, 2 and 5."""
    fields = []
    pos = start
    while pos < end:
        key, value_start = decode_unsigned_varint(buf, pos)
        wire_type = key & 7
        if wire_type == _VARINT:
            _, value_end = decode_unsigned_varint(buf, value_start)
        elif wire_type == _LEN:
            length, value_start = decode_unsigned_varint(buf, value_start)
            value_end = value_start + length
        elif wire_type == _FIXED64:
            value_end = value_start + 8
        elif wire_type == _FIXED32:
            value_end = value_start + 4
        else:
            raise ValueError(f"wire type {wire_type}")
        if value_end > end or key >> 3 == 0:
            raise ValueError("a field beyond its message, or numbered 0")
        fields.append((key >> 3, wire_type, pos, value_start, value_end))
        pos = value_end
    return fields
