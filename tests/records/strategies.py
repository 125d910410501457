"""Hypothesis strategies for records, shared by the record and broker tests."""

from __future__ import annotations

from hypothesis import strategies as st

from tidewater.records.batch import Record, build_batch
from tidewater.records.header import Compression

# The codecs Tidewater supports (Kafka's SNAPPY is not among them).
CODECS = [Compression.NONE, Compression.GZIP, Compression.LZ4, Compression.ZSTD]

HEADERS = st.lists(
    st.tuples(st.text(max_size=8), st.none() | st.binary(max_size=16)), max_size=3
).map(tuple)


def record_lists(max_records: int, max_value: int) -> st.SearchStrategy[list[Record]]:
    """1 to `max_records` records: a key and a value (of up to `max_value` bytes) or none,
    headers, and a timestamp or none (the batch's time)."""
    return st.lists(
        st.builds(
            Record,
            key=st.none() | st.binary(max_size=32),
            value=st.none() | st.binary(max_size=max_value),
            headers=HEADERS,
            timestamp_ms=st.none() | st.integers(0, 2**50),
        ),
        min_size=1,
        max_size=max_records,
    )


# The time a batch gives records without one. Fixed, because a batch whose length follows
# the clock makes Hypothesis draw differently when it replays an example.
NOW_MS = 1_700_000_000_000


def batches(max_records: int, max_value: int) -> st.SearchStrategy[bytes]:
    """One valid batch of `record_lists(max_records, max_value)` in a supported codec."""
    return st.builds(
        lambda records, codec: bytes(build_batch(records, compression=codec, now_ms=NOW_MS)),
        record_lists(max_records, max_value),
        st.sampled_from(CODECS),
    )
