"""Compression codecs for a batch's records section (attributes bits 0-2).

gzip is RFC 1952, lz4 is the LZ4 *frame* format, zstd is the zstd frame format; each may be
several concatenated frames (members), as Kafka's Java readers accept. Decompression is
bounded: a caller names the most output it will take, and a batch that would decompress to
more is refused before that much memory is spent (zip bombs).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable

import lz4.frame
import zstandard
from isal import isal_zlib

from tidewater.errors import CorruptMessage, UnsupportedCompressionType
from tidewater.records.header import Compression

GZIP_LEVEL = 6  # Kafka's default
ZSTD_LEVEL = 3  # Kafka's default
# zlib's window bits for "gzip header and trailer only".
_GZIP_WBITS = 16 + zlib.MAX_WBITS
# The largest zstd block decodes to 128 KiB from at least 4 input bytes (an RLE block), which
# bounds how far one decompress() call can overshoot the budget for a given input slice.
# Slices are never shorter than 64 bytes (at most 2 MiB of overshoot) to keep calls few.
_ZSTD_BLOCK_MAX = 128 * 1024
_ZSTD_MIN_BLOCK_BYTES = 4
_ZSTD_MIN_SLICE = 64
# python-lz4 allocates a call's whole max_length up front: a 64 MiB buffer mapped afresh at
# each call cost more than decompressing 1 MiB of records (2.3 against 0.5 ms on this VM),
# so each call asks for at most this much.
_LZ4_MAX_CALL = 1 << 20
# A zstd context keeps the buffers a frame made it grow to (up to the 128 MiB window a frame
# may declare, which clients at high levels use): after a call that produced more than this,
# the thread takes a new one. 12 checks of a 60 MiB record with a 2^27 window left 420 MiB
# resident with kept contexts; below this bound a context's buffers stay small.
_ZSTD_KEEP_CONTEXT_BYTES = 8 * 1024 * 1024


class _ZstdContexts(threading.local):
    """A thread's own zstd contexts: python-zstandard's are not thread-safe (a decompressor
    shared by the broker's worker threads crashed the process), and a new one per call costs
    an allocation of its window."""

    def __init__(self) -> None:
        self.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.decompressor = zstandard.ZstdDecompressor()


_zstd = _ZstdContexts()


def compress(codec: int, data: bytes | bytearray | memoryview) -> bytes:
    """The records section `data` compressed with `codec`."""
    if codec == Compression.NONE:
        return bytes(data)
    if codec == Compression.GZIP:
        # mtime=0 keeps the output a pure function of the input.
        deflate = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, _GZIP_WBITS)
        return deflate.compress(data) + deflate.flush()
    if codec == Compression.LZ4:
        # Independent blocks, as Kafka writes them: its Java reader decodes each block alone.
        return lz4.frame.compress(data, block_linked=False)
    if codec == Compression.ZSTD:
        return _zstd.compressor.compress(data)
    raise _unsupported(codec)


def decompress(codec: int, data: bytes | bytearray | memoryview, limit: int) -> bytes | bytearray:
    """`data` decompressed with `codec` (a bytearray, not copied into bytes: up to `limit`);
    CorruptMessage if it is malformed, truncated, or would decompress to more than `limit`
    bytes."""
    if codec == Compression.NONE:
        if len(data) > limit:
            raise _too_large(limit)
        return bytes(data)
    decoder = _DECODERS.get(codec)
    if decoder is None:
        raise _unsupported(codec)
    try:
        return decoder(bytes(data), limit)
    except (isal_zlib.error, RuntimeError, zstandard.ZstdError) as e:
        # lz4.frame reports malformed input as RuntimeError.
        raise CorruptMessage(f"{Compression(codec).name} data is malformed: {e}") from e


def _gunzip(data: bytes, limit: int) -> bytearray:
    # ISA-L's inflate, zlib's interface: 3x faster than zlib's own (1.7 against 5.2 ms for a
    # batch of 1,000 1 KiB records of text), and the leader inflates every gzip batch.
    out = bytearray()
    while True:
        member = isal_zlib.decompressobj(_GZIP_WBITS)
        out += member.decompress(data, limit + 1 - len(out))
        while member.unconsumed_tail and len(out) <= limit:
            out += member.decompress(member.unconsumed_tail, limit + 1 - len(out))
        if len(out) > limit:
            raise _too_large(limit)
        if not member.eof:
            raise CorruptMessage("GZIP data is truncated")
        data = member.unused_data
        if not data:
            return out


def _unlz4(data: bytes, limit: int) -> bytearray:
    out = bytearray()
    while True:
        frame = lz4.frame.LZ4FrameDecompressor()
        out += frame.decompress(data, max_length=min(limit + 1 - len(out), _LZ4_MAX_CALL))
        while not frame.eof and not frame.needs_input and len(out) <= limit:
            out += frame.decompress(b"", max_length=min(limit + 1 - len(out), _LZ4_MAX_CALL))
        if len(out) > limit:
            raise _too_large(limit)
        if not frame.eof:
            raise CorruptMessage("LZ4 data is truncated")
        data = frame.unused_data
        if not data:
            return out


def _unzstd(data: bytes, limit: int) -> bytearray:
    out = bytearray()
    try:
        _unzstd_into(out, data, limit)
    finally:
        if len(out) > _ZSTD_KEEP_CONTEXT_BYTES:
            _zstd.decompressor = zstandard.ZstdDecompressor()
    return out


def _unzstd_into(out: bytearray, data: bytes, limit: int) -> None:
    # python-zstandard has no output cap for streams, so feed the input in slices small enough
    # that none can decode to much more than the remaining budget.
    decompressor = _zstd.decompressor
    frame = decompressor.decompressobj()
    pos = 0
    while pos < len(data):
        if frame.eof:
            frame = decompressor.decompressobj()
        budget = limit - len(out)
        step = max(_ZSTD_MIN_SLICE, budget // _ZSTD_BLOCK_MAX * _ZSTD_MIN_BLOCK_BYTES)
        chunk = data[pos : pos + step]
        pos += len(chunk)
        out += frame.decompress(chunk)
        if len(out) > limit:
            raise _too_large(limit)
        if frame.eof and frame.unused_data:
            # The slice ran past the end of a frame: hand the rest to the next frame.
            pos -= len(frame.unused_data)
    if not frame.eof:
        raise CorruptMessage("ZSTD data is truncated")


_DECODERS: dict[int, Callable[[bytes, int], bytearray]] = {
    Compression.GZIP: _gunzip,
    Compression.LZ4: _unlz4,
    Compression.ZSTD: _unzstd,
}


def _unsupported(codec: int) -> UnsupportedCompressionType:
    try:
        name = Compression(codec).name
    except ValueError:
        name = str(codec)
    return UnsupportedCompressionType(f"compression codec {name} is not supported")


class DecompressedTooLarge(CorruptMessage):
    """A records section that would decompress to more than the reader's limit."""


def _too_large(limit: int) -> CorruptMessage:
    return DecompressedTooLarge(f"records section decompresses to more than {limit} bytes")
