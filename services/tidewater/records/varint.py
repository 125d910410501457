"""Zigzag varints, as in Kafka's record format (and protobuf's sint32/sint64).

Zigzag maps signed to unsigned so small magnitudes stay short (0→0, -1→1, 1→2, -2→3, ...);
the result is written 7 bits at a time, least significant group first, with the high bit of
each byte set when another byte follows. A varint holds an int32 (at most 5 bytes), a varlong
an int64 (at most 10 bytes). Like Kafka, decoding accepts non-minimal encodings within those
lengths; anything longer, truncated or out of range is a CorruptMessage.
"""

from __future__ import annotations

from tidewater.errors import CorruptMessage

# What the codec reads from: a whole fetch response, a log segment slice, a single batch.
Buffer = bytes | bytearray | memoryview

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_VARINT_MAX_BYTES = 5
_VARLONG_MAX_BYTES = 10

# Lengths, deltas and counts in a batch are nearly always small: encode those by lookup.
_CACHED_ZIGZAG = 1 << 12


def _encode_unsigned(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_CACHE = tuple(_encode_unsigned(zz) for zz in range(_CACHED_ZIGZAG))


def encode_unsigned_varint(value: int) -> bytes:
    """A value >= 0 in 7-bit groups, without zigzag: protobuf's plain varint, and the last
    step of the zigzag encoders."""
    return _CACHE[value] if value < _CACHED_ZIGZAG else _encode_unsigned(value)


def encode_varint(value: int) -> bytes:
    """Zigzag varint of an int32; ValueError if out of range."""
    zz = value << 1 if value >= 0 else (-value << 1) - 1
    if zz < _CACHED_ZIGZAG:
        return _CACHE[zz]
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise ValueError(f"{value} does not fit a varint (int32)")
    return _encode_unsigned(zz)


def encode_varlong(value: int) -> bytes:
    """Zigzag varlong of an int64; ValueError if out of range."""
    zz = value << 1 if value >= 0 else (-value << 1) - 1
    if zz < _CACHED_ZIGZAG:
        return _CACHE[zz]
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"{value} does not fit a varlong (int64)")
    return _encode_unsigned(zz)


def decode_varint(buf: Buffer, pos: int) -> tuple[int, int]:
    """(int32 value, position after it) of the varint at buf[pos]."""
    # One- and two-byte values (up to ±8191) take the fast path: nearly every length in a batch.
    if pos + 1 < len(buf):
        b = buf[pos]
        if b < 0x80:
            return (b >> 1) ^ -(b & 1), pos + 1
        b2 = buf[pos + 1]
        if b2 < 0x80:
            zz = (b & 0x7F) | (b2 << 7)
            return (zz >> 1) ^ -(zz & 1), pos + 2
    zz, end = _decode_unsigned(buf, pos, _VARINT_MAX_BYTES, 32, "varint")
    return (zz >> 1) ^ -(zz & 1), end


def decode_varlong(buf: Buffer, pos: int) -> tuple[int, int]:
    """(int64 value, position after it) of the varlong at buf[pos]."""
    if pos < len(buf):
        b = buf[pos]
        if b < 0x80:
            return (b >> 1) ^ -(b & 1), pos + 1
    zz, end = _decode_unsigned(buf, pos, _VARLONG_MAX_BYTES, 64, "varlong")
    return (zz >> 1) ^ -(zz & 1), end


def decode_unsigned_varint(buf: Buffer, pos: int) -> tuple[int, int]:
    """(value, position after it) of the plain varint (protobuf's, up to 64 bits) at buf[pos]:
    the inverse of encode_unsigned_varint."""
    if pos < len(buf):
        b = buf[pos]
        if b < 0x80:
            return b, pos + 1
    return _decode_unsigned(buf, pos, _VARLONG_MAX_BYTES, 64, "varint")


def _decode_unsigned(
    buf: Buffer, pos: int, max_bytes: int, bits: int, kind: str
) -> tuple[int, int]:
    end = min(len(buf), pos + max_bytes)
    value = 0
    shift = 0
    for i in range(pos, end):
        b = buf[i]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            if value >> bits:
                raise CorruptMessage(f"{kind} at byte {pos} overflows {bits} bits")
            return value, i + 1
        shift += 7
    if end - pos == max_bytes:
        raise CorruptMessage(f"{kind} at byte {pos} is longer than {max_bytes} bytes")
    raise CorruptMessage(f"{kind} at byte {pos} is cut off by the end of the buffer")
