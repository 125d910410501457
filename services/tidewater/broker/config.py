"""Broker configuration: Kafka's names, from a TOML file and command-line overrides.

A config file reads like Kafka's server.properties in TOML syntax:

    broker.id = 1
    listeners = "0.0.0.0:9092"
    advertised.listeners = "broker-1.internal:9092"
    log.dirs = ["/var/lib/tidewater/data"]
    log.retention.ms = 604800000

TOML turns dotted keys into nested tables; `flatten` turns them back into Kafka names.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tidewater.broker.log.manager import FILE_DELETE_DELAY_MS
from tidewater.errors import InvalidConfig
from tidewater.rpc.address import HostPort, listen_and_advertised, parse_addresses, published
from tidewater.rpc.server import MAX_MESSAGE_BYTES

# Broker-level defaults for topic configs, under Kafka's broker names → the topic config name.
TOPIC_DEFAULT_NAMES = {
    "log.segment.bytes": "segment.bytes",
    "log.roll.ms": "segment.ms",
    "log.index.size.max.bytes": "segment.index.bytes",
    "log.index.interval.bytes": "index.interval.bytes",
    "log.retention.ms": "retention.ms",
    "log.retention.bytes": "retention.bytes",
    "log.flush.interval.messages": "flush.messages",
    "log.flush.interval.ms": "flush.ms",
    "message.max.bytes": "max.message.bytes",
    "log.message.timestamp.before.max.ms": "message.timestamp.before.max.ms",
    "log.message.timestamp.after.max.ms": "message.timestamp.after.max.ms",
    "log.cache.drop.behind.bytes": "cache.drop.behind.bytes",
    "min.insync.replicas": "min.insync.replicas",
}


@dataclass(frozen=True)
class BrokerConfig:
    broker_id: int
    log_dirs: tuple[Path, ...]
    host: str = "127.0.0.1"
    port: int = 9092
    # Topic config defaults, under topic config names ("retention.ms", ...).
    topic_defaults: Mapping[str, str] = field(default_factory=dict)
    request_timeout_ms: int = 30000
    replica_high_watermark_checkpoint_interval_ms: int = 5000
    log_retention_check_interval_ms: int = 300000
    log_flush_offset_checkpoint_interval_ms: int = 60000
    log_flush_scheduler_interval_ms: int = 1000
    # How long a stray log stays on disk, renamed, before it is deleted.
    file_delete_delay_ms: int = FILE_DELETE_DELAY_MS
    replica_lag_time_max_ms: int = 30000
    num_replica_fetchers: int = 1
    replica_fetch_backoff_ms: int = 1000
    replica_fetch_wait_max_ms: int = 500
    replica_fetch_min_bytes: int = 1
    # Kafka's is 1 MiB: with batches near 1 MiB a follower then copies one batch per round
    # trip, and acks=all throughput is one batch per fetch (RF=3: 62 vs 165 MB/s at 8 MiB).
    # replica.fetch.response.max.bytes still bounds a whole response.
    replica_fetch_max_bytes: int = 8 * 1024 * 1024
    replica_fetch_response_max_bytes: int = 10485760
    # Kafka's fetch.max.bytes (55 MiB): bounds every fetch answer, whatever it asks for.
    fetch_max_bytes: int = 57671680
    max_incremental_fetch_session_cache_slots: int = 1000
    min_incremental_fetch_session_eviction_ms: int = 120000
    # The controllers' addresses: registration, heartbeats, ISR change proposals.
    controllers: tuple[str, ...] = ()
    broker_heartbeat_interval_ms: int = 500
    controlled_shutdown_timeout_ms: int = 15000
    isr_change_propagation_window_ms: int = 50
    # An idempotent producer with no batch in a partition for this long is forgotten there
    # (Kafka's defaults: 1 day, checked every 10 minutes).
    producer_id_expiration_ms: int = 86400000
    producer_id_expiration_check_interval_ms: int = 600000
    rack: str = ""
    # advertised.listeners: what the broker registers (followers and clients dial it); None:
    # its bound address.
    advertised: HostPort | None = None

    @property
    def listen_address(self) -> str:
        return f"{self.host}:{self.port}"

    def advertised_address(self, bound_port: int) -> HostPort:
        return published(HostPort(self.host, self.port), bound_port, self.advertised)

    @classmethod
    def from_properties(cls, props: Mapping[str, Any]) -> BrokerConfig:
        """Build from Kafka-named properties; unknown names and bad values raise InvalidConfig."""
        remaining = dict(props)

        def take_int(name: str, default: int | None = None) -> int:
            raw = remaining.pop(name, default)
            if raw is None:
                raise InvalidConfig(f"{name} is required")
            try:
                value = int(raw)
            except (TypeError, ValueError):
                raise InvalidConfig(f"{name} must be an integer, got {raw!r}") from None
            if value < 0:
                raise InvalidConfig(f"{name} must not be negative, got {value}")
            return value

        broker_id = take_int("broker.id")
        bind, advertised = listen_and_advertised(
            str(remaining.pop("listeners", "127.0.0.1:9092")),
            str(remaining.pop("advertised.listeners", "")),
            # The flags too: a unit file gives them as --listen and --advertised-address.
            "listeners (--listen)",
            "advertised.listeners (--advertised-address)",
        )
        raw_dirs = remaining.pop("log.dirs", None)
        if raw_dirs is None:
            raise InvalidConfig("log.dirs is required")
        dirs = raw_dirs.split(",") if isinstance(raw_dirs, str) else list(raw_dirs)
        if not dirs or not all(str(d).strip() for d in dirs):
            raise InvalidConfig(f"log.dirs must name at least one directory, got {raw_dirs!r}")
        topic_defaults = {
            TOPIC_DEFAULT_NAMES[name]: str(remaining.pop(name))
            for name in list(remaining)
            if name in TOPIC_DEFAULT_NAMES
        }
        # Every other integer setting: the field of the Kafka name, dots for underscores.
        integers = {
            f.name: take_int(f.name.replace("_", "."), f.default)
            for f in fields(cls)
            if f.type == "int" and f.name not in ("broker_id", "port")
        }
        integers["num_replica_fetchers"] = max(1, integers["num_replica_fetchers"])
        # Kafka's atLeast(1): a check every 0 ms would take the event loop (a heartbeat
        # every 0 ms took 35 % of a core and flooded the controller: review 27 L6).
        for name in (
            "producer_id_expiration_ms",
            "producer_id_expiration_check_interval_ms",
            "broker_heartbeat_interval_ms",
        ):
            if integers[name] < 1:
                raise InvalidConfig(f"{name.replace('_', '.')} must be at least 1")
        fetch_max_bytes_limit = MAX_MESSAGE_BYTES - (1 << 20)  # room for the answer's fields
        if not 1024 <= integers["fetch_max_bytes"] <= fetch_max_bytes_limit:
            raise InvalidConfig(
                f"fetch.max.bytes must be from 1024 to {fetch_max_bytes_limit}, "
                f"got {integers['fetch_max_bytes']}"
            )
        config = cls(
            broker_id=broker_id,
            log_dirs=tuple(Path(str(d).strip()) for d in dirs),
            host=bind.host,
            port=bind.port,
            topic_defaults=topic_defaults,
            **integers,
            controllers=_controllers(remaining.pop("controllers", ())),
            rack=str(remaining.pop("broker.rack", "")),
            advertised=advertised,
        )
        if remaining:
            raise InvalidConfig(f"unknown broker config: {', '.join(sorted(remaining))}")
        return config


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"log": {"dirs": [...]}} → {"log.dirs": [...]}."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def load_properties(path: Path | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Properties from a TOML file (if any), then command-line overrides on top."""
    props: dict[str, Any] = {}
    if path is not None:
        try:
            with path.open("rb") as f:
                props = flatten(tomllib.load(f))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise InvalidConfig(f"cannot read config file {path}: {e}") from None
    props.update({k: v for k, v in overrides.items() if v is not None})
    return props


def _controllers(raw: Any) -> tuple[str, ...]:
    """ "h:p,h:p" (the flag) or a TOML list → ("h:p", ...)."""
    text = raw if isinstance(raw, str) else ",".join(str(item) for item in raw)
    return tuple(parse_addresses(text, "controllers"))
