"""A partition log's settings, under Kafka's topic config names and with Kafka's defaults."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import NamedTuple

from tidewater.errors import InvalidConfig
from tidewater.records.header import HEADER_SIZE

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
_DAY_MS = 24 * 60 * 60 * 1000
# Kafka's ConfigDef reads an INT or LONG as Java does: the value trimmed of ASCII spaces and
# control characters (String.trim), then an optional sign and ASCII digits (parseLong), so
# "1_0", "1e3", "2.0" and non-ASCII digits are refused (Python's int() takes the first and
# the last).
_INTEGER = re.compile(r"[+-]?[0-9]+")
_JAVA_TRIM = "".join(map(chr, range(33)))


def parse_integer(name: str, raw: object) -> int:
    """A config value as Kafka parses an integer; InvalidConfig names the key."""
    text = str(raw).strip(_JAVA_TRIM)
    if not _INTEGER.fullmatch(text):
        raise InvalidConfig(f"{name} must be an integer, got {raw!r}")
    return int(text)


class _Setting(NamedTuple):
    attribute: str
    minimum: int
    maximum: int = INT64_MAX
    optional: bool = False  # None allowed (means "not set")


# Kafka property name → attribute and allowed range.
_SETTINGS = {
    # Positions in a segment are int32, and a segment must hold at least one batch header.
    "segment.bytes": _Setting("segment_bytes", HEADER_SIZE, INT32_MAX),
    "segment.ms": _Setting("segment_ms", 1),
    # One time index entry (12 bytes) at least, or every segment would be born full.
    "segment.index.bytes": _Setting("segment_index_bytes", 12, INT32_MAX),
    "index.interval.bytes": _Setting("index_interval_bytes", 0, INT32_MAX),
    "retention.ms": _Setting("retention_ms", -1),
    "retention.bytes": _Setting("retention_bytes", -1),
    "flush.messages": _Setting("flush_messages", 1, optional=True),
    "flush.ms": _Setting("flush_ms", 0, optional=True),
    "max.message.bytes": _Setting("max_message_bytes", 0, INT32_MAX),
    "message.timestamp.before.max.ms": _Setting("message_timestamp_before_max_ms", 0),
    "message.timestamp.after.max.ms": _Setting("message_timestamp_after_max_ms", 0),
    "cache.drop.behind.bytes": _Setting("cache_drop_behind_bytes", -1),
}

LOG_CONFIG_NAMES = frozenset(_SETTINGS)


@dataclass(frozen=True)
class LogConfig:
    """-1 retention means unbounded; None flush settings leave flushing to the OS (Kafka's way:
    durability comes from replication, and recovery handles what the OS had not written).
    cache.drop.behind.bytes (not Kafka's) keeps that much of each segment's tail in the OS page
    cache and lets the OS drop what is older, so a broker's memory stays bounded and new
    writes reuse warm pages; -1 leaves the page cache to the OS, as Kafka does."""

    segment_bytes: int = 1 << 30
    segment_ms: int = 7 * _DAY_MS
    segment_index_bytes: int = 10 * 1024 * 1024
    index_interval_bytes: int = 4096
    retention_ms: int = 7 * _DAY_MS
    retention_bytes: int = -1
    flush_messages: int | None = None
    flush_ms: int | None = None
    max_message_bytes: int = 1048588
    # KIP-937, with Kafka 4.0's defaults: any past timestamp, at most an hour ahead (one far
    # in the future would hold its segment, and those after it, past retention.ms).
    message_timestamp_before_max_ms: int = INT64_MAX
    message_timestamp_after_max_ms: int = 60 * 60 * 1000
    cache_drop_behind_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        for name, setting in _SETTINGS.items():
            value = getattr(self, setting.attribute)
            if value is None and setting.optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidConfig(f"{name} must be an integer, got {value!r}")
            if not setting.minimum <= value <= setting.maximum:
                raise InvalidConfig(
                    f"{name} must be between {setting.minimum} and {setting.maximum}, got {value}"
                )

    @classmethod
    def from_properties(cls, props: Mapping[str, str]) -> LogConfig:
        """Kafka topic config names ("segment.bytes", "retention.ms", ...) → LogConfig;
        unset names keep their defaults. InvalidConfig names the offending key."""
        values: dict[str, int] = {}
        for name, raw in props.items():
            setting = _SETTINGS.get(name)
            if setting is None:
                raise InvalidConfig(f"unknown topic config: {name}")
            values[setting.attribute] = parse_integer(name, raw)
        return cls(**values)

    def to_properties(self) -> dict[str, str]:
        """The inverse of from_properties; unset flush settings are left out."""
        values = asdict(self)
        return {
            name: str(values[setting.attribute])
            for name, setting in _SETTINGS.items()
            if values[setting.attribute] is not None
        }
