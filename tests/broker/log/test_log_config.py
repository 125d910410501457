from __future__ import annotations

import pytest

from tidewater.broker.log.config import LogConfig
from tidewater.errors import InvalidConfig


def test_defaults_are_kafkas() -> None:
    config = LogConfig()
    assert config.segment_bytes == 1073741824
    assert config.segment_ms == 604800000
    assert config.segment_index_bytes == 10485760
    assert config.index_interval_bytes == 4096
    assert config.retention_ms == 604800000
    assert config.retention_bytes == -1
    assert config.flush_messages is None
    assert config.flush_ms is None
    assert config.max_message_bytes == 1048588
    assert config.cache_drop_behind_bytes == 64 * 1024 * 1024  # not Kafka's: see LogConfig


def test_from_properties_reads_kafka_names() -> None:
    config = LogConfig.from_properties(
        {
            "segment.bytes": "2000",
            "segment.ms": "60000",
            "segment.index.bytes": "4096",
            "index.interval.bytes": "100",
            "retention.ms": "-1",
            "retention.bytes": "5000000",
            "flush.messages": "1",
            "flush.ms": "1000",
            "max.message.bytes": "500",
            "cache.drop.behind.bytes": "-1",
        }
    )
    assert config == LogConfig(
        segment_bytes=2000,
        segment_ms=60000,
        segment_index_bytes=4096,
        index_interval_bytes=100,
        retention_ms=-1,
        retention_bytes=5000000,
        flush_messages=1,
        flush_ms=1000,
        max_message_bytes=500,
        cache_drop_behind_bytes=-1,
    )


def test_unset_properties_keep_defaults() -> None:
    assert LogConfig.from_properties({"retention.ms": "1000"}) == LogConfig(retention_ms=1000)


@pytest.mark.parametrize(
    "config",
    [LogConfig(), LogConfig(segment_bytes=4096, flush_messages=10, flush_ms=5, retention_ms=-1)],
)
def test_to_properties_round_trips(config: LogConfig) -> None:
    props = config.to_properties()
    assert all(isinstance(v, str) for v in props.values())
    assert LogConfig.from_properties(props) == config


def test_to_properties_leaves_out_unset_flush_settings() -> None:
    props = LogConfig().to_properties()
    assert "flush.messages" not in props
    assert "flush.ms" not in props
    assert props["segment.bytes"] == "1073741824"


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({"cleanup.policy": "compact"}, "unknown topic config: cleanup.policy"),
        ({"retention.ms": "soon"}, "retention.ms must be an integer, got 'soon'"),
        ({"segment.bytes": "1.5"}, "segment.bytes must be an integer"),
        ({"segment.bytes": ""}, "segment.bytes must be an integer"),
        ({"segment.bytes": "10"}, "segment.bytes must be between 61 and 2147483647, got 10"),
        ({"segment.bytes": "4294967296"}, "segment.bytes must be between"),
        ({"segment.ms": "0"}, "segment.ms must be between 1"),
        ({"segment.index.bytes": "8"}, "segment.index.bytes must be between 12"),
        ({"index.interval.bytes": "-1"}, "index.interval.bytes must be between 0"),
        ({"retention.ms": "-2"}, "retention.ms must be between -1"),
        ({"retention.bytes": "-5"}, "retention.bytes must be between -1"),
        ({"flush.messages": "0"}, "flush.messages must be between 1"),
        ({"flush.ms": "-1"}, "flush.ms must be between 0"),
        ({"max.message.bytes": "-1"}, "max.message.bytes must be between 0"),
    ],
)
def test_bad_properties_raise_invalid_config_naming_the_key(
    props: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidConfig) as raised:
        LogConfig.from_properties(props)
    assert message in str(raised.value)


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(InvalidConfig, match=r"segment\.bytes"):
        LogConfig(segment_bytes=0)
