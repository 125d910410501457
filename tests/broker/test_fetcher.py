"""Partitions spread over replica fetchers the way Kafka spreads them."""

from __future__ import annotations

from collections import Counter

from tidewater.broker.fetcher import fetcher_id, java_string_hash


def test_java_string_hash_matches_java() -> None:
    # Values of "...".hashCode() in Java.
    assert java_string_hash("") == 0
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("a much longer topic name than most") == _java(
        "a much longer topic name than most"
    )


def _java(text: str) -> int:
    """Java's s[0]*31^(n-1) + ... + s[n-1], in 32-bit two's complement."""
    h = sum(ord(c) * 31 ** (len(text) - 1 - i) for i, c in enumerate(text)) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def test_fetcher_id_is_kafkas_and_spreads_partitions() -> None:
    # Utils.abs(31 * "t".hashCode() + p) % n, with "t".hashCode() == 116.
    assert [fetcher_id("t", p, 4) for p in range(4)] == [(31 * 116 + p) % 4 for p in range(4)]
    spread = Counter(fetcher_id("events", p, 3) for p in range(300))
    assert sorted(spread) == [0, 1, 2]
    assert min(spread.values()) == 100
