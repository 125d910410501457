"""KIP-320's rules for the consumer's positions (positions.py): when a leader change calls for
validation, and what the new leader's OffsetForLeaderEpoch answer makes of the position."""

from __future__ import annotations

import pytest

from tidewater.client.errors import LogTruncation, error_for
from tidewater.client.positions import (
    NO_EPOCH,
    FetchPosition,
    for_current_leader,
    validated,
)
from tidewater.errors import OffsetOutOfRange
from tidewater.v1.errors_pb2 import ErrorCode

TP = ("t", 0)
# Offset 10, after a record of epoch 5, fetched from broker 1 in leader epoch 5.
AT_10 = FetchPosition(10, 5, (1, 5))


def test_the_same_leader_and_epoch_needs_no_validation() -> None:
    assert for_current_leader(AT_10, (1, 5)) == (AT_10, False)


@pytest.mark.parametrize("leader", [(2, 6), (1, 6)])
def test_a_new_leader_or_leader_epoch_calls_for_validation(leader: tuple[int, int]) -> None:
    assert for_current_leader(AT_10, leader) == (FetchPosition(10, 5, leader), True)


def test_a_position_without_epoch_follows_the_new_leader_unvalidated() -> None:
    """As after Kafka's seek(offset): nothing to check the new leader's log against."""
    sought = FetchPosition(10)
    assert for_current_leader(sought, (2, 6)) == (FetchPosition(10, NO_EPOCH, (2, 6)), False)


@pytest.mark.parametrize("policy", ["earliest", "latest", "none"])
@pytest.mark.parametrize(("end_epoch", "end_offset"), [(5, 10), (5, 12), (4, 11)])
def test_a_log_that_holds_the_position_keeps_it(
    policy: str, end_epoch: int, end_offset: int
) -> None:
    assert validated(TP, AT_10, end_epoch, end_offset, policy) == AT_10


@pytest.mark.parametrize("policy", ["earliest", "latest"])
@pytest.mark.parametrize(("end_epoch", "end_offset"), [(5, 7), (3, 4), (5, 0)])
def test_a_truncated_log_moves_the_position_to_the_divergence_point(
    policy: str, end_epoch: int, end_offset: int
) -> None:
    """Whatever the policy: the records from the divergence point on are the new history,
    neither the log's start nor its end (Kafka's maybeCompleteValidation)."""
    assert validated(TP, AT_10, end_epoch, end_offset, policy) == FetchPosition(
        end_offset, end_epoch, (1, 5)
    )


def test_a_truncated_log_without_reset_policy_raises_log_truncation() -> None:
    with pytest.raises(LogTruncation) as raised:
        validated(TP, AT_10, 3, 4, "none")
    error = raised.value
    assert (error.topic_partition, error.position, error.divergent_offset) == (TP, 10, 4)
    assert error.code == ErrorCode.OFFSET_OUT_OF_RANGE
    assert str(error) == (
        "OFFSET_OUT_OF_RANGE: t-0: log truncation detected: fetch position 10, but the "
        "leader's log diverges from offset 4"
    )


@pytest.mark.parametrize("policy", ["earliest", "latest"])
def test_a_leader_without_any_epoch_as_old_resets_by_the_policy(policy: str) -> None:
    assert validated(TP, AT_10, NO_EPOCH, -1, policy) is None


def test_a_leader_without_any_epoch_as_old_and_no_reset_policy_is_out_of_range() -> None:
    with pytest.raises(OffsetOutOfRange, match=r"t-0: fetch position 10 is out of range") as e:
        validated(TP, AT_10, NO_EPOCH, -1, "none")
    assert not isinstance(e.value, LogTruncation)


def test_an_out_of_range_answer_is_not_taken_for_a_log_truncation() -> None:
    """LogTruncation shares OFFSET_OUT_OF_RANGE's code; a response's code still makes the
    plain error."""
    assert type(error_for(ErrorCode.OFFSET_OUT_OF_RANGE, "x")) is OffsetOutOfRange
