from __future__ import annotations

import gzip
import os
from concurrent.futures import ThreadPoolExecutor

import lz4.frame
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from tidewater.errors import CorruptMessage, UnsupportedCompressionType
from tidewater.records import compression
from tidewater.records.compression import compress, decompress
from tidewater.records.header import Compression

CODECS = [Compression.GZIP, Compression.LZ4, Compression.ZSTD]
SAMPLES = [b"", b"x", b"abc" * 50_000, os.urandom(70_000)]


@pytest.mark.parametrize("codec", [*CODECS, Compression.NONE])
@pytest.mark.parametrize("data", SAMPLES, ids=["empty", "one-byte", "repetitive", "random"])
def test_round_trip(codec: Compression, data: bytes) -> None:
    assert decompress(codec, compress(codec, data), len(data)) == data


@given(st.sampled_from(CODECS), st.binary(max_size=2_000))
def test_round_trip_property(codec: Compression, data: bytes) -> None:
    assert decompress(codec, compress(codec, data), len(data)) == data


def test_outputs_are_the_standard_formats() -> None:
    data = b"tidewater " * 100
    assert gzip.decompress(compress(Compression.GZIP, data)) == data
    assert lz4.frame.decompress(compress(Compression.LZ4, data)) == data
    assert zstandard.ZstdDecompressor().decompress(compress(Compression.ZSTD, data)) == data


@pytest.mark.parametrize("codec", CODECS)
def test_concatenated_frames_decompress_as_one(codec: Compression) -> None:
    blob = compress(codec, b"first ") + compress(codec, b"second")
    assert decompress(codec, blob, 100) == b"first second"


@pytest.mark.parametrize("codec", [*CODECS, Compression.NONE])
def test_output_above_the_limit_is_refused(codec: Compression) -> None:
    data = b"\0" * 100_000
    with pytest.raises(CorruptMessage, match="more than 99999 bytes"):
        decompress(codec, compress(codec, data), len(data) - 1)


@pytest.mark.parametrize("codec", CODECS)
def test_zip_bomb_is_refused_early(codec: Compression) -> None:
    bomb = compress(codec, bytes(64 * 1024 * 1024))
    assert len(bomb) < 1024 * 1024
    with pytest.raises(CorruptMessage, match="more than 1048576 bytes"):
        decompress(codec, bomb, 1024 * 1024)


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_data_is_corrupt(codec: Compression) -> None:
    blob = compress(codec, os.urandom(10_000))
    for cut in (1, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CorruptMessage):
            decompress(codec, blob[:cut], 20_000)


@pytest.mark.parametrize("codec", CODECS)
def test_garbage_is_corrupt(codec: Compression) -> None:
    with pytest.raises(CorruptMessage, match=codec.name):
        decompress(codec, b"definitely not compressed data", 1000)


@pytest.mark.parametrize("codec", [Compression.SNAPPY, 5, 7])
def test_snappy_and_unknown_codecs_are_unsupported(codec: int) -> None:
    with pytest.raises(UnsupportedCompressionType):
        compress(codec, b"data")
    with pytest.raises(UnsupportedCompressionType):
        decompress(codec, b"data", 100)


@pytest.mark.parametrize("codec", CODECS)
def test_threads_decompress_at_once(codec: Compression) -> None:
    """The broker checks large compressed batches in worker threads, several at once: a
    zstd decompressor shared by them crashed the process (python-zstandard's contexts are not
    thread-safe)."""
    sections = [bytes([i]) * 300_000 + bytes(range(256)) * i for i in range(8)]
    compressed = [compress(codec, s) for s in sections]

    def decompress_all(_: int) -> bool:
        return all(
            decompress(codec, c, 1 << 20) == s
            for _ in range(20)
            for c, s in zip(compressed, sections, strict=True)
        )

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(decompress_all, range(4)))


@pytest.mark.parametrize("codec", CODECS)
def test_decompressed_records_are_not_copied_into_bytes(codec: Compression) -> None:
    """The output is returned as built (up to 64 MiB for the broker), not copied once more."""
    assert type(decompress(codec, compress(codec, b"records"), 100)) is bytearray


def test_a_zstd_context_grown_by_a_large_output_is_not_kept() -> None:
    """A thread keeps its zstd decompressor across small outputs, and takes a new one after an
    output of more than 8 MiB, finished or refused: the old one's buffers (up to a 128 MiB
    window) would stay resident with the thread. Before, every context was kept."""
    small = compress(Compression.ZSTD, bytes(1 << 20))
    large = compress(Compression.ZSTD, bytes(9 << 20))
    kept = compression._zstd.decompressor
    decompress(Compression.ZSTD, small, 1 << 20)
    assert compression._zstd.decompressor is kept
    decompress(Compression.ZSTD, large, 9 << 20)
    replaced = compression._zstd.decompressor
    assert replaced is not kept
    with pytest.raises(CorruptMessage, match="more than"):
        decompress(Compression.ZSTD, large, (8 << 20) + 1)
    assert compression._zstd.decompressor is not replaced
