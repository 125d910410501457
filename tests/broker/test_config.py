"""Broker and topic configuration: Kafka names in, clear errors out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidewater import cli
from tidewater.broker.config import BrokerConfig, load_properties
from tidewater.broker.topic_config import TopicConfig
from tidewater.errors import InvalidConfig


def test_toml_file_with_kafka_names_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "broker.toml"
    path.write_text(
        'broker.id = 3\nlisteners = "127.0.0.1:9093"\nlog.dirs = ["/a", "/b"]\n'
        "log.retention.ms = 1000\nmin.insync.replicas = 2\n"
        'advertised.listeners = "PLAINTEXT://b3.internal:19093"\n'
    )
    config = BrokerConfig.from_properties(load_properties(path, {"log.dirs": "/c"}))
    assert (config.broker_id, config.host, config.port) == (3, "127.0.0.1", 9093)
    assert str(config.advertised_address(9093)) == "b3.internal:19093"
    assert config.log_dirs == (Path("/c"),)
    assert config.topic_defaults == {"retention.ms": "1000", "min.insync.replicas": "2"}
    topic = TopicConfig.from_properties(dict(config.topic_defaults))
    assert topic.min_insync_replicas == 2
    assert topic.log.retention_ms == 1000


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({"log.dirs": "/a"}, "broker.id is required"),
        ({"broker.id": "x", "log.dirs": "/a"}, "broker.id must be an integer"),
        ({"broker.id": 1}, "log.dirs is required"),
        (
            {"broker.id": 1, "log.dirs": "/a", "listeners": "nope"},
            "listeners \\(--listen\\) must be HOST:PORT",
        ),
        ({"broker.id": 1, "log.dirs": "/a", "bogus.key": 1}, "unknown broker config: bogus.key"),
        (
            {"broker.id": 1, "log.dirs": "/a", "producer.id.expiration.check.interval.ms": 0},
            "producer.id.expiration.check.interval.ms must be at least 1",
        ),
        ({"broker.id": 1, "log.dirs": "/a", "fetch.max.bytes": 1023}, "fetch.max.bytes must be"),
        (
            {"broker.id": 1, "log.dirs": "/a", "fetch.max.bytes": 128 << 20},
            "fetch.max.bytes must be from 1024 to",
        ),
        (
            {"broker.id": 1, "log.dirs": "/a", "controllers": "127.0.0.1:9093,127.0.0.1:70000"},
            "controllers must be HOST:PORT, got '127.0.0.1:70000'",
        ),
        (
            {"broker.id": 1, "log.dirs": "/a", "controllers": ["127.0.0.1:0"]},
            "controllers must be HOST:PORT, got '127.0.0.1:0'",
        ),
    ],
)
def test_bad_broker_config(props: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        BrokerConfig.from_properties(props)


@pytest.mark.parametrize(
    ("props", "key"),
    [
        ({"min.insync.replicas": "0"}, "min.insync.replicas"),
        ({"unclean.leader.election.enable": "maybe"}, "unclean.leader.election.enable"),
        ({"retention.ms": "soon"}, "retention.ms"),
        ({"no.such.config": "1"}, "no.such.config"),
    ],
)
def test_bad_topic_config_names_the_key(props: dict[str, str], key: str) -> None:
    with pytest.raises(InvalidConfig, match=key):
        TopicConfig.from_properties(props)


@pytest.mark.parametrize(
    ("key", "raw"),
    [
        ("min.insync.replicas", "1_0"),
        ("min.insync.replicas", "\u0662"),  # ARABIC-INDIC DIGIT TWO
        ("min.insync.replicas", "2.0"),
        ("min.insync.replicas", "1e1"),
        ("min.insync.replicas", "2 2"),
        ("min.insync.replicas", "\u00a02"),  # a no-break space: not what Java's trim() takes
        ("min.insync.replicas", "2147483648"),
        ("retention.ms", "1_000"),
        ("retention.ms", "\u0661\u0660"),
    ],
)
def test_integer_topic_configs_are_refused_unless_plain_integers(key: str, raw: str) -> None:
    # Before, min.insync.replicas took whatever Python's int() takes: "1_0", non-ASCII digits.
    with pytest.raises(InvalidConfig, match=key):
        TopicConfig.from_properties({key: raw})


@pytest.mark.parametrize(("raw", "value"), [("2", 2), (" 2\t", 2), ("+2", 2)])
def test_integer_topic_configs_are_read_as_kafka_reads_them(raw: str, value: int) -> None:
    # Kafka's ConfigDef trims the value (Java's String.trim) and takes a sign.
    config = TopicConfig.from_properties({"min.insync.replicas": raw, "retention.ms": raw})
    assert (config.min_insync_replicas, config.log.retention_ms) == (value, value)


def test_unreadable_config_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("broker.id = = 1")
    with pytest.raises(InvalidConfig, match="cannot read config file"):
        load_properties(path, {})


def test_unset_settings_take_the_defaults_and_kafka_names_set_the_others() -> None:
    required = {"broker.id": 1, "log.dirs": "/d"}
    assert BrokerConfig.from_properties(required) == BrokerConfig(1, (Path("/d"),))
    config = BrokerConfig.from_properties(
        {**required, "replica.fetch.max.bytes": 5, "num.replica.fetchers": 0}
    )
    assert (config.replica_fetch_max_bytes, config.num_replica_fetchers) == (5, 1)


@pytest.mark.parametrize(
    ("listeners", "advertised", "bind", "published"),
    [
        # Unset: the bound address, as before advertised.listeners existed.
        ("127.0.0.1:0", "", ("127.0.0.1", 0), "127.0.0.1:41000"),
        # Kafka's form; a wildcard bind with the name others dial.
        (
            "PLAINTEXT://0.0.0.0:9092",
            "PLAINTEXT://broker-1.internal:9092",
            ("0.0.0.0", 9092),
            "broker-1.internal:9092",
        ),
        # A free port bound, an explicit port advertised (a proxy or NAT in front).
        ("127.0.0.1:0", "broker-1.internal:19092", ("127.0.0.1", 0), "broker-1.internal:19092"),
        ("[::]:9092", "[fd00::7]:9092", ("[::]", 9092), "[fd00::7]:9092"),
    ],
)
def test_advertised_listeners_is_what_the_broker_publishes(
    listeners: str, advertised: str, bind: tuple[str, int], published: str
) -> None:
    config = BrokerConfig.from_properties(
        {
            "broker.id": 1,
            "log.dirs": "/d",
            "listeners": listeners,
            "advertised.listeners": advertised,
        }
    )
    assert (config.host, config.port) == bind
    assert str(config.advertised_address(41000)) == published


@pytest.mark.parametrize(
    ("props", "message"),
    [
        (
            {"listeners": "SSL://b:9093"},
            "listeners .* must be .*: every service is plaintext gRPC, no SSL listener",
        ),
        (
            {"listeners": "0.0.0.0:9092"},
            r"listeners \(--listen\) binds the wildcard address 0.0.0.0, which nobody can "
            r"dial: set advertised.listeners \(--advertised-address\) to",
        ),
        ({"listeners": "PLAINTEXT://[::]:0"}, "binds the wildcard address \\[::\\]"),
        (
            {"advertised.listeners": "PLAINTEXT://a:9092,PLAINTEXT://b:9092"},
            "advertised.listeners .* must be .*one listener",
        ),
        (
            {"advertised.listeners": "SASL_SSL://b:9093"},
            "advertised.listeners .*no SASL_SSL listener",
        ),
        (
            {"advertised.listeners": "broker-1.internal"},
            "advertised.listeners .* must be HOST:PORT or PLAINTEXT://HOST:PORT, got",
        ),
        (
            {"advertised.listeners": "PLAINTEXT://:9092"},
            "advertised.listeners .* must be HOST:PORT",
        ),
        ({"advertised.listeners": "b:65536"}, "advertised.listeners .* must be HOST:PORT"),
        (
            {"advertised.listeners": "0.0.0.0:9092"},
            "advertised.listeners .* cannot be the wildcard address 0.0.0.0",
        ),
        (
            {"advertised.listeners": "[::]:9092"},
            r"advertised.listeners .* cannot be the wildcard address \[::\]",
        ),
        ({"advertised.listeners": "fd00::7:9092"}, r"an IPv6 host in brackets \(\[::1\]:9092\)"),
        (
            {"advertised.listeners": "b:0"},
            "advertised.listeners .* needs the port others dial, not 0",
        ),
    ],
)
def test_refused_listeners(props: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        BrokerConfig.from_properties({"broker.id": 1, "log.dirs": "/d", **props})


def test_advertised_address_flag_sets_advertised_listeners() -> None:
    args = cli.parser().parse_args(
        [
            "broker",
            "--broker-id",
            "1",
            "--log-dirs",
            "/d",
            "--listen",
            "0.0.0.0:9092",
            "--advertised-address",
            "b1:9092",
        ]
    )
    assert str(cli.broker_config(args).advertised_address(9092)) == "b1:9092"
