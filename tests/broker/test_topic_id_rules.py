"""Topic ids on a broker (KIP-516), without gRPC: the rule requests are checked by, the
partition.metadata file, and the log manager keeping each log's id across a restart."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidewater.broker.fetch_session import FetchSessionHandler
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.manager import LogManager
from tidewater.broker.topic_ids import (
    PARTITION_METADATA,
    CorruptPartitionMetadata,
    format_partition_metadata,
    read_partition_metadata,
    topic_ids_match,
    write_partition_metadata,
)
from tidewater.replication.partition import FollowerFetch

OLD = uuid.UUID("4f6c5b5e-7d0b-4c4e-9d1e-2b0f3a7c9e11").bytes
NEW = uuid.uuid4().bytes


def test_a_request_is_checked_only_when_both_ids_are_known() -> None:
    assert topic_ids_match(OLD, OLD)
    assert not topic_ids_match(OLD, NEW)
    assert topic_ids_match(OLD, b"")  # an older client names none
    assert topic_ids_match(b"", NEW)  # a log written before topic ids holds none
    assert topic_ids_match(b"", b"")


def test_partition_metadata_is_written_and_read_back(tmp_path: Path) -> None:
    assert read_partition_metadata(tmp_path) == b""  # none yet
    write_partition_metadata(tmp_path, OLD)
    assert (tmp_path / PARTITION_METADATA).read_text() == (
        "version: 0\ntopic_id: 4f6c5b5e-7d0b-4c4e-9d1e-2b0f3a7c9e11\n"
    )
    assert read_partition_metadata(tmp_path) == OLD
    write_partition_metadata(tmp_path, NEW)
    assert read_partition_metadata(tmp_path) == NEW
    assert [p.name for p in tmp_path.iterdir()] == [PARTITION_METADATA]  # no temp file left


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\xff\xfe",
        b"version: 0\n",
        b"version: 1\ntopic_id: 4f6c5b5e-7d0b-4c4e-9d1e-2b0f3a7c9e11\n",
        b"version: 0\ntopic: 4f6c5b5e-7d0b-4c4e-9d1e-2b0f3a7c9e11\n",
        b"version: 0\ntopic_id: not-a-uuid\n",
        format_partition_metadata(OLD) + b"extra: line\n",
    ],
)
def test_a_corrupt_partition_metadata_file_is_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / PARTITION_METADATA).write_bytes(content)
    with pytest.raises(CorruptPartitionMetadata, match=PARTITION_METADATA):
        read_partition_metadata(tmp_path)


@pytest.fixture
def managers() -> Iterator[list[LogManager]]:
    started: list[LogManager] = []
    yield started
    for manager in started:
        manager.shutdown()


def test_a_log_keeps_its_topic_id_across_a_restart(
    tmp_path: Path, managers: list[LogManager]
) -> None:
    manager = LogManager([tmp_path], LogConfig())
    managers.append(manager)
    created = manager.get_or_create_log("events", 0, LogConfig(), OLD)
    assert created.topic_id == OLD
    assert read_partition_metadata(created.dir) == OLD
    # A log written before topic ids adopts the first one it is given.
    legacy = manager.get_or_create_log("legacy", 0, LogConfig())
    assert legacy.topic_id == b""
    assert not (legacy.dir / PARTITION_METADATA).exists()
    manager.assign_topic_id(legacy, NEW)
    manager.shutdown()
    managers.remove(manager)

    restarted = LogManager([tmp_path], LogConfig())
    managers.append(restarted)
    events, legacy_again = restarted.get_log("events", 0), restarted.get_log("legacy", 0)
    assert events is not None and events.topic_id == OLD
    assert legacy_again is not None and legacy_again.topic_id == NEW


def test_a_corrupt_partition_metadata_file_stops_the_start(
    tmp_path: Path, managers: list[LogManager]
) -> None:
    """As Kafka takes the log dir offline: without its id, a deleted topic's log could be
    taken for a new topic of that name."""
    manager = LogManager([tmp_path], LogConfig())
    log_dir = manager.get_or_create_log("events", 0, LogConfig(), OLD).dir
    manager.shutdown()
    (log_dir / PARTITION_METADATA).write_bytes(b"version: 0\ntopic_id: garbage\n")
    with pytest.raises(CorruptPartitionMetadata, match="events-0"):
        managers.append(LogManager([tmp_path], LogConfig()))


def test_a_follower_names_a_partition_again_in_its_session_when_its_id_changes() -> None:
    """The leader checks the id of a partition's last naming in the session: a topic
    created again under its name, at the same position, must be named with its new id."""
    handler: FetchSessionHandler[tuple[str, int], FollowerFetch] = FetchSessionHandler()
    tp = ("events", 0)
    first = FollowerFetch(2, 0, 0, -1, 0, topic_id=OLD)
    handler.on_response(handler.build({tp: first}, [tp]), 0, session_id=7)
    assert handler.build({tp: first}, [tp]).send == []
    assert handler.build({tp: first._replace(topic_id=NEW)}, [tp]).send == [tp]
