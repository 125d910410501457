"""A topic's effective configuration: log settings plus the replication ones."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tidewater.broker.log.config import INT32_MAX, LOG_CONFIG_NAMES, LogConfig, parse_integer
from tidewater.errors import InvalidConfig

_BOOLEANS = {"true": True, "false": False}
_REPLICATION_NAMES = frozenset({"min.insync.replicas", "unclean.leader.election.enable"})
# Every Kafka topic config name a topic may set.
TOPIC_CONFIG_NAMES = LOG_CONFIG_NAMES | _REPLICATION_NAMES


@dataclass(frozen=True)
class TopicConfig:
    log: LogConfig = field(default_factory=LogConfig)
    min_insync_replicas: int = 1
    unclean_leader_election_enable: bool = False

    @classmethod
    def from_properties(cls, props: Mapping[str, str]) -> TopicConfig:
        """Kafka topic config names → TopicConfig; InvalidConfig names the bad key. The one
        validator of topic configs: CreateTopics, IncrementalAlterConfigs and brokers."""
        log_props = dict(props)
        raw_min_isr = log_props.pop("min.insync.replicas", "1")
        raw_unclean = log_props.pop("unclean.leader.election.enable", "false")
        min_isr = parse_integer("min.insync.replicas", raw_min_isr)
        if not 1 <= min_isr <= INT32_MAX:
            raise InvalidConfig(
                f"min.insync.replicas must be between 1 and {INT32_MAX}, got {min_isr}"
            )
        unclean = _BOOLEANS.get(str(raw_unclean).lower())
        if unclean is None:
            raise InvalidConfig(
                f"unclean.leader.election.enable must be true or false, got {raw_unclean!r}"
            )
        return cls(LogConfig.from_properties(log_props), min_isr, unclean)

    def to_properties(self) -> dict[str, str]:
        """The inverse of from_properties (unset flush settings are left out)."""
        return {
            **self.log.to_properties(),
            "min.insync.replicas": str(self.min_insync_replicas),
            "unclean.leader.election.enable": str(self.unclean_leader_election_enable).lower(),
        }
