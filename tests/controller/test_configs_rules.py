"""The rules of IncrementalAlterConfigs and DescribeConfigs (tidewater.controller.configs),
without a controller: Kafka's SET and DELETE, the checks that refuse a whole topic's change,
and what DescribeConfigs lists."""

from __future__ import annotations

import pytest

from tidewater.controller.configs import (
    DEFAULTS,
    ConfigChange,
    Operation,
    alter_configs,
    describe_configs,
)
from tidewater.errors import InvalidConfig, InvalidRequest

SET, DELETE = Operation.SET, Operation.DELETE


def test_set_and_delete_leave_the_other_keys_as_they_are() -> None:
    current = {"retention.ms": "1000", "segment.bytes": "4096"}
    changes = [
        ConfigChange("retention.ms", SET, "2000"),
        ConfigChange("segment.bytes", DELETE),
        ConfigChange("min.insync.replicas", SET, "2"),
    ]
    assert alter_configs(current, changes) == {"retention.ms": "2000", "min.insync.replicas": "2"}
    assert current == {"retention.ms": "1000", "segment.bytes": "4096"}  # not changed in place


def test_deleting_a_key_the_topic_does_not_set_is_no_error() -> None:
    assert alter_configs({"retention.ms": "1"}, [ConfigChange("segment.ms", DELETE)]) == {
        "retention.ms": "1"
    }


@pytest.mark.parametrize(
    ("changes", "error", "named"),
    [
        ([ConfigChange("no.such.key", SET, "1")], InvalidConfig, "no.such.key"),
        ([ConfigChange("no.such.key", DELETE)], InvalidConfig, "no.such.key"),
        ([ConfigChange("retention.ms", SET, "soon")], InvalidConfig, "retention.ms"),
        ([ConfigChange("retention.ms", SET, "")], InvalidConfig, "retention.ms"),
        ([ConfigChange("segment.bytes", SET, "1")], InvalidConfig, "segment.bytes"),
        ([ConfigChange("min.insync.replicas", SET, "0")], InvalidConfig, "min.insync"),
        ([ConfigChange("unclean.leader.election.enable", SET, "yes")], InvalidConfig, "unclean"),
        (
            [ConfigChange("retention.ms", SET, "1"), ConfigChange("retention.ms", DELETE)],
            InvalidRequest,
            "retention.ms",
        ),
        ([ConfigChange("retention.ms", 7, "1")], InvalidRequest, "operation"),
        # A good change with a bad one: refused whole.
        (
            [ConfigChange("segment.ms", SET, "5"), ConfigChange("max.message.bytes", SET, "-1")],
            InvalidConfig,
            "max.message.bytes",
        ),
    ],
)
def test_refused_changes(changes: list[ConfigChange], error: type[Exception], named: str) -> None:
    with pytest.raises(error, match=named.replace(".", r"\.")):
        alter_configs({"retention.ms": "1000"}, changes)


def test_describe_lists_every_key_with_overrides_over_defaults() -> None:
    entries = describe_configs({"retention.ms": "1000", "flush.ms": "50"})
    by_name = {e.name: e for e in entries}
    assert [e.name for e in entries] == sorted(by_name)
    assert set(by_name) == set(DEFAULTS) | {"flush.ms"}
    assert (by_name["retention.ms"].value, by_name["retention.ms"].is_override) == ("1000", True)
    assert (by_name["flush.ms"].value, by_name["flush.ms"].is_override) == ("50", True)
    assert (by_name["segment.bytes"].value, by_name["segment.bytes"].is_override) == (
        str(1 << 30),
        False,
    )
    assert by_name["min.insync.replicas"].value == "1"
    assert by_name["unclean.leader.election.enable"].value == "false"
    assert "flush.messages" not in by_name  # no default: listed only when set
