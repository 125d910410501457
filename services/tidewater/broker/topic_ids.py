"""Topic ids on a broker (KIP-516): the rules, and the `partition.metadata` file that keeps a
log's topic id in its directory.

A topic deleted and created again under its name is another topic with another id. The
broker keeps each hosted partition's id with its log, so that neither a client holding the
old topic's id nor a LeaderAndIsr for the new topic reaches the old one's log by its name.
An empty id is "not known": a client or a controller without ids, or a log written before
them; nothing is checked against it (Kafka's hasConsistentTopicId).

`partition.metadata` is Kafka's file, with the id as a UUID's text:

    version: 0
    topic_id: 4f6c5b5e-7d0b-4c4e-9d1e-2b0f3a7c9e11
"""

from __future__ import annotations

import uuid
from pathlib import Path

from tidewater.broker.log.checkpoints import write_atomically
from tidewater.errors import StorageError

PARTITION_METADATA = "partition.metadata"
_VERSION = 0


class CorruptPartitionMetadata(StorageError):
    pass


def topic_ids_match(held: bytes, asked: bytes) -> bool:
    """Whether a request naming `asked` may use a partition whose log holds `held`: yes
    unless both are known and differ."""
    return not (held and asked and held != asked)


def topic_id_text(topic_id: bytes) -> str:
    return str(uuid.UUID(bytes=topic_id)) if len(topic_id) == 16 else topic_id.hex() or "none"


def format_partition_metadata(topic_id: bytes) -> bytes:
    return f"version: {_VERSION}\ntopic_id: {uuid.UUID(bytes=topic_id)}\n".encode("ascii")


def parse_partition_metadata(data: bytes, path: Path) -> bytes:
    """The topic id in a `partition.metadata` file's bytes."""

    def corrupt(detail: str) -> CorruptPartitionMetadata:
        return CorruptPartitionMetadata(f"corrupt {path}: {detail}")

    try:
        lines = data.decode("ascii").split("\n")
    except UnicodeDecodeError:
        raise corrupt("not ASCII text") from None
    if lines[-1] == "":
        lines.pop()
    if len(lines) != 2:
        raise corrupt(f"{len(lines)} lines, expected 2")
    if lines[0] != f"version: {_VERSION}":
        raise corrupt(f"unknown version line {lines[0]!r}")
    key, _, value = lines[1].partition(": ")
    if key != "topic_id":
        raise corrupt(f"no topic_id line: {lines[1]!r}")
    try:
        return uuid.UUID(value).bytes
    except ValueError:
        raise corrupt(f"{value!r} is not a topic id") from None


def read_partition_metadata(log_dir: Path) -> bytes:
    """The topic id a log's directory holds; empty when it has no `partition.metadata`.
    Raises CorruptPartitionMetadata."""
    path = log_dir / PARTITION_METADATA
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return b""
    return parse_partition_metadata(data, path)


def write_partition_metadata(log_dir: Path, topic_id: bytes) -> None:
    """Atomically and durably (a crash leaves the old file or the new one, never a torn one)."""
    write_atomically(log_dir / PARTITION_METADATA, format_partition_metadata(topic_id))
