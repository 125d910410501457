"""Helpers shared by the record batch tests."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

from tidewater.records.header import (
    CRC_OFFSET,
    HEADER,
    HEADER_SIZE,
    LOG_OVERHEAD,
    compute_crc,
    read_header,
)


def _rewrite(batch: bytes, *, section: bytes | None = None, **fields: int) -> bytes:
    header = read_header(batch)
    body = batch[HEADER_SIZE : header.size] if section is None else section
    fields.setdefault("batch_length", HEADER_SIZE - LOG_OVERHEAD + len(body))
    new = bytearray(HEADER.pack(*header._replace(**fields))) + body
    struct.pack_into(">I", new, CRC_OFFSET, compute_crc(new))
    return bytes(new)


@pytest.fixture
def rewrite() -> Callable[..., bytes]:
    """rewrite(batch, section=..., **header_fields): the batch with its records section and/or
    header fields replaced and a fresh, valid CRC, as a buggy or hostile producer could send."""
    return _rewrite
