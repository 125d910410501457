from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidewater.errors import CorruptMessage
from tidewater.records.varint import (
    decode_unsigned_varint,
    decode_varint,
    decode_varlong,
    encode_unsigned_varint,
    encode_varint,
    encode_varlong,
)

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, "00"),
        (-1, "01"),
        (1, "02"),
        (-2, "03"),
        (63, "7e"),
        (-64, "7f"),
        (64, "8001"),
        (300, "d804"),
        (2**31 - 1, "feffffff0f"),
        (-(2**31), "ffffffff0f"),
    ],
)
def test_varint_matches_kafka_encoding(value: int, encoded: str) -> None:
    assert encode_varint(value).hex() == encoded
    assert decode_varint(bytes.fromhex(encoded), 0) == (value, len(encoded) // 2)


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, "00"),
        (-1, "01"),
        (5, "0a"),
        (2**63 - 1, "feffffffffffffffff01"),
        (-(2**63), "ffffffffffffffffff01"),
    ],
)
def test_varlong_matches_kafka_encoding(value: int, encoded: str) -> None:
    assert encode_varlong(value).hex() == encoded
    assert decode_varlong(bytes.fromhex(encoded), 0) == (value, len(encoded) // 2)


@given(INT32, st.binary(max_size=3), st.binary(max_size=3))
def test_varint_round_trips_inside_a_buffer(value: int, before: bytes, after: bytes) -> None:
    encoded = encode_varint(value)
    buf = before + encoded + after
    for kind in (bytes, bytearray, memoryview):
        assert decode_varint(kind(buf), len(before)) == (value, len(before) + len(encoded))


@given(INT64, st.binary(max_size=3), st.binary(max_size=3))
def test_varlong_round_trips_inside_a_buffer(value: int, before: bytes, after: bytes) -> None:
    encoded = encode_varlong(value)
    buf = before + encoded + after
    for kind in (bytes, bytearray, memoryview):
        assert decode_varlong(kind(buf), len(before)) == (value, len(before) + len(encoded))


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1])
def test_varint_refuses_values_outside_int32(value: int) -> None:
    with pytest.raises(ValueError, match="int32"):
        encode_varint(value)


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1])
def test_varlong_refuses_values_outside_int64(value: int) -> None:
    with pytest.raises(ValueError, match="int64"):
        encode_varlong(value)


def test_non_minimal_encoding_is_accepted_like_kafka() -> None:
    assert decode_varint(bytes.fromhex("8000"), 0) == (0, 2)
    assert decode_varlong(bytes.fromhex("8280808000"), 0) == (1, 5)


@pytest.mark.parametrize(
    ("encoded", "pos", "message"),
    [
        ("", 0, "cut off"),
        ("02", 1, "cut off"),
        ("80", 0, "cut off"),
        ("ffffff", 0, "cut off"),
        ("808080808000", 0, "longer than 5 bytes"),
        ("ffffffff1f", 0, "overflows 32 bits"),
    ],
)
def test_malformed_varint_is_corrupt(encoded: str, pos: int, message: str) -> None:
    with pytest.raises(CorruptMessage, match=message):
        decode_varint(bytes.fromhex(encoded), pos)


@pytest.mark.parametrize("decode", [decode_varlong, decode_unsigned_varint])
@pytest.mark.parametrize(
    ("encoded", "message"),
    [
        ("", "cut off"),
        ("80", "cut off"),
        ("ffffffffffffffffff", "cut off"),
        ("8080808080808080808000", "longer than 10 bytes"),
        ("ffffffffffffffffff02", "overflows 64 bits"),
    ],
)
def test_malformed_64_bit_varint_is_corrupt(
    decode: Callable[[bytes, int], tuple[int, int]], encoded: str, message: str
) -> None:
    """A zigzag varlong and a plain (protobuf) varint share their limits."""
    with pytest.raises(CorruptMessage, match=message):
        decode(bytes.fromhex(encoded), 0)


@given(st.integers(0, 2**64 - 1), st.binary(max_size=3), st.binary(max_size=3))
def test_plain_varint_round_trips_inside_a_buffer(value: int, before: bytes, after: bytes) -> None:
    encoded = encode_unsigned_varint(value)
    buf = before + encoded + after
    for kind in (bytes, bytearray, memoryview):
        assert decode_unsigned_varint(kind(buf), len(before)) == (value, len(before) + len(encoded))
