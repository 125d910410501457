"""Topic configs: Kafka's IncrementalAlterConfigs and DescribeConfigs rules, as pure functions
of a topic's stored overrides. The service (service.py) stores and announces what they return.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tidewater.broker.topic_config import TOPIC_CONFIG_NAMES, TopicConfig
from tidewater.errors import InvalidConfig, InvalidRequest

# Kafka's default of every topic config that has one (flush.messages and flush.ms do not:
# unset, the OS flushes).
DEFAULTS = TopicConfig().to_properties()


class Operation(enum.IntEnum):
    """AlterConfigOp's types that the protocol carries (ConfigOperation's numbers)."""

    SET = 0
    DELETE = 1


@dataclass(frozen=True)
class ConfigChange:
    name: str
    operation: int  # an Operation, or an unknown number from the wire
    value: str = ""


@dataclass(frozen=True)
class ConfigEntry:
    name: str
    value: str
    # True: the topic sets it (Kafka's DYNAMIC_TOPIC_CONFIG); False: the default.
    is_override: bool


def alter_configs(current: Mapping[str, str], changes: Sequence[ConfigChange]) -> dict[str, str]:
    """The topic's overrides after `changes`, validated whole with the validator CreateTopics
    uses: InvalidRequest for a key given twice or an unknown operation, InvalidConfig for an
    unknown key or a bad value (then nothing changes). Deleting a key the topic does not set
    is no error, as in Kafka."""
    names = [c.name for c in changes]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InvalidRequest(f"config keys given more than once: {', '.join(repeated)}")
    configs = dict(current)
    for change in changes:
        if change.name not in TOPIC_CONFIG_NAMES:
            raise InvalidConfig(f"unknown topic config: {change.name}")
        if change.operation == Operation.SET:
            configs[change.name] = change.value
        elif change.operation == Operation.DELETE:
            configs.pop(change.name, None)
        else:
            raise InvalidRequest(f"unknown config operation {change.operation} for {change.name}")
    TopicConfig.from_properties(configs)  # InvalidConfig names the bad key
    return configs


def describe_configs(overrides: Mapping[str, str]) -> list[ConfigEntry]:
    """Every key, by name: the topic's overrides, and the defaults of the keys it does not
    set."""
    values = {**DEFAULTS, **overrides}
    return [ConfigEntry(name, values[name], name in overrides) for name in sorted(values)]
