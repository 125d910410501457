"""Partitions spread over replica fetchers the way Kafka spreads them; what a fetcher's
session asks of the leader, without a leader."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from tidewater.broker import fetcher as fetcher_module
from tidewater.broker.config import BrokerConfig
from tidewater.broker.fetcher import (
    PartitionFetchState,
    ReplicaFetcher,
    SourceBroker,
    fetcher_id,
    java_string_hash,
)
from tidewater.replication.follower import FollowerFetch
from tidewater.v1.errors_pb2 import ErrorCode


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


def test_a_partition_removed_while_the_others_back_off_is_forgotten_at_the_next_fetch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P leaves the fetcher in a round where Q, the only other partition, backs off: no fetch
    is built then, and the next one, once Q is back, forgets P in the session. Not forgotten,
    P would stay quiet in the leader's session, every fetch of Q counting for it."""
    p, q = ("t", 0), ("t", 1)
    positions = {p: FollowerFetch(2, 10, 0, 1, 1), q: FollowerFetch(2, 20, 0, 1, 1)}
    # A hosted partition here is its fixed position.
    monkeypatch.setattr(fetcher_module, "next_fetch", lambda state, topic_id=b"": state)
    hosted = {
        tp: SimpleNamespace(state=fetch, log=SimpleNamespace(topic_id=b""))
        for tp, fetch in positions.items()
    }
    fetcher = ReplicaFetcher(
        SourceBroker(1, "127.0.0.1:1"),
        0,
        BrokerConfig(broker_id=2, log_dirs=(Path("/nonexistent"),)),
        hosted.get,  # type: ignore[arg-type]
        lambda: 5,
    )

    def fetch() -> tuple[list[tuple[str, int]], list[tuple[str, int]]] | None:
        """The next fetch's named and forgotten partitions; the leader answers it."""
        built = fetcher._build_request()
        if built is None:
            return None
        _, plan, _ = built
        fetcher.session.on_response(plan, ErrorCode.NONE, 7)
        return sorted(plan.send), sorted(plan.forgotten)

    for tp in (p, q):
        fetcher.partitions[tp] = PartitionFetchState(1)
        fetcher.mark_changed(tp)
    assert fetch() == ([p, q], [])  # full: opens session 7
    assert fetch() == ([], [])
    # The leader answers Q with a partition error: it backs off. Meanwhile P leaves the
    # fetcher (a StopReplica, or a leader move).
    fetcher.partitions[q].delayed_until = time.monotonic() + 3600
    fetcher.mark_changed(q)
    del fetcher.partitions[p]
    fetcher.mark_changed(p)
    assert fetch() is None  # every partition waits
    fetcher.partitions[q].delayed_until = 0.0  # its backoff is over
    assert fetch() == ([], [p])  # Q's position is the session's still
    assert fetch() == ([], [])
