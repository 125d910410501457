"""Exceptions that carry a protocol ErrorCode, so every layer can raise what a client will see."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tidewater.v1.errors_pb2 import ErrorCode

# A plain int for the data path: each ErrorCode.NONE looks the name up in protobuf's
# descriptors (about 1 us, several with cold caches), and the fetch and produce paths ask
# several times per request.
NO_ERROR: int = ErrorCode.NONE

# The codes whose request may succeed when sent again, maybe elsewhere or later: the
# "retriable" column of protos/README.md (a test holds them together).
RETRIABLE = frozenset(
    {
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.NOT_LEADER_OR_FOLLOWER,
        ErrorCode.LEADER_NOT_AVAILABLE,
        ErrorCode.NOT_ENOUGH_REPLICAS,
        ErrorCode.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        ErrorCode.REQUEST_TIMED_OUT,
        ErrorCode.FENCED_LEADER_EPOCH,
        ErrorCode.UNKNOWN_LEADER_EPOCH,
        ErrorCode.NOT_CONTROLLER,
        ErrorCode.NO_REPLICA_ONLINE,
        ErrorCode.STATE_CHANGE_FAILED,
        ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE,
        ErrorCode.PREFERRED_LEADER_NOT_AVAILABLE,
        ErrorCode.STORAGE_ERROR,
        ErrorCode.TOPIC_DELETION_IN_PROGRESS,
        ErrorCode.PRODUCER_ID_ALLOCATION_FAILED,
        ErrorCode.FETCH_SESSION_ID_NOT_FOUND,
        ErrorCode.INVALID_FETCH_SESSION_EPOCH,
        ErrorCode.UNKNOWN_TOPIC_ID,
        ErrorCode.INCONSISTENT_TOPIC_ID,
        ErrorCode.DUPLICATE_BROKER_REGISTRATION,
        ErrorCode.OFFSET_NOT_AVAILABLE,
    }
)


class TidewaterError(Exception):
    """An error with a name in the protocol. Subclasses fix the code; the message explains."""

    code: int = ErrorCode.UNKNOWN_SERVER_ERROR

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def code_name(self) -> str:
        return ErrorCode.Name(self.code)

    @property
    def retriable(self) -> bool:
        """Whether the same request may succeed when sent again (Kafka's RetriableException)."""
        return self.code in RETRIABLE

    @property
    def message(self) -> str:
        """The explanation without the code's name: what a response's error_message carries
        beside its error_code, so that a client naming the code does not repeat it."""
        return str(self.args[0])

    def __str__(self) -> str:
        return f"{self.code_name}: {self.message}"


class CorruptMessage(TidewaterError):
    code = ErrorCode.CORRUPT_MESSAGE


class MessageTooLarge(TidewaterError):
    code = ErrorCode.MESSAGE_TOO_LARGE


class UnsupportedCompressionType(TidewaterError):
    code = ErrorCode.UNSUPPORTED_COMPRESSION_TYPE


class UnsupportedVersion(TidewaterError):
    code = ErrorCode.UNSUPPORTED_VERSION


class FetchSessionIdNotFound(TidewaterError):
    code = ErrorCode.FETCH_SESSION_ID_NOT_FOUND


class InvalidFetchSessionEpoch(TidewaterError):
    code = ErrorCode.INVALID_FETCH_SESSION_EPOCH


class UnknownTopicOrPartition(TidewaterError):
    code = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION


class UnknownTopicId(TidewaterError):
    code = ErrorCode.UNKNOWN_TOPIC_ID


class InconsistentTopicId(TidewaterError):
    code = ErrorCode.INCONSISTENT_TOPIC_ID


class NotLeaderOrFollower(TidewaterError):
    code = ErrorCode.NOT_LEADER_OR_FOLLOWER


class OffsetOutOfRange(TidewaterError):
    code = ErrorCode.OFFSET_OUT_OF_RANGE


class InvalidTopic(TidewaterError):
    code = ErrorCode.INVALID_TOPIC


class InvalidRequest(TidewaterError):
    code = ErrorCode.INVALID_REQUEST


class InvalidConfig(TidewaterError):
    code = ErrorCode.INVALID_CONFIG


class StorageError(TidewaterError):
    code = ErrorCode.STORAGE_ERROR


class FencedLeaderEpoch(TidewaterError):
    code = ErrorCode.FENCED_LEADER_EPOCH


class UnknownLeaderEpoch(TidewaterError):
    code = ErrorCode.UNKNOWN_LEADER_EPOCH


class StaleControllerEpoch(TidewaterError):
    code = ErrorCode.STALE_CONTROLLER_EPOCH


class StaleBrokerEpoch(TidewaterError):
    code = ErrorCode.STALE_BROKER_EPOCH


class NotEnoughReplicas(TidewaterError):
    code = ErrorCode.NOT_ENOUGH_REPLICAS


class NotEnoughReplicasAfterAppend(TidewaterError):
    code = ErrorCode.NOT_ENOUGH_REPLICAS_AFTER_APPEND


class RequestTimedOut(TidewaterError):
    code = ErrorCode.REQUEST_TIMED_OUT


class InvalidRequiredAcks(TidewaterError):
    code = ErrorCode.INVALID_REQUIRED_ACKS


class NoReplicaOnline(TidewaterError):
    """Leader election found no replica that may lead."""

    code = ErrorCode.NO_REPLICA_ONLINE


class StateChangeFailed(TidewaterError):
    """A leader election's strategy could not be applied; the partition keeps its state."""

    code = ErrorCode.STATE_CHANGE_FAILED


class PreferredLeaderNotAvailable(StateChangeFailed):
    code = ErrorCode.PREFERRED_LEADER_NOT_AVAILABLE


class ElectionNotNeeded(TidewaterError):
    code = ErrorCode.ELECTION_NOT_NEEDED


class InvalidReplicationFactor(TidewaterError):
    code = ErrorCode.INVALID_REPLICATION_FACTOR


class InvalidPartitions(TidewaterError):
    code = ErrorCode.INVALID_PARTITIONS


class InvalidTimestamp(TidewaterError):
    code = ErrorCode.INVALID_TIMESTAMP


class InvalidReplicaAssignment(TidewaterError):
    code = ErrorCode.INVALID_REPLICA_ASSIGNMENT


class PolicyViolation(TidewaterError):
    code = ErrorCode.POLICY_VIOLATION


class BrokerNotAvailable(TidewaterError):
    code = ErrorCode.BROKER_NOT_AVAILABLE


class NotController(TidewaterError):
    """A write by a controller whose epoch is no longer the current controller epoch."""

    code = ErrorCode.NOT_CONTROLLER


class ControllerUnavailable(TidewaterError):
    """No controller answered as active (raised by the caller, not answered by a service).
    `answers`, from the Admin client: the results of a per-item request's items answered
    before it gave up (one per item, None where none came), so that an item applied is not
    reported as lost."""

    code = ErrorCode.NOT_CONTROLLER

    def __init__(self, message: str, answers: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.answers = list(answers)


class StoreUnavailable(TidewaterError):
    """The controller's call to etcd did not complete (unreachable, or timed out); retriable."""

    code = ErrorCode.REQUEST_TIMED_OUT


class OutOfOrderSequence(TidewaterError):
    """An idempotent batch does not continue its producer's sequence (a gap, or a retry of a
    batch older than the last five the partition remembers)."""

    code = ErrorCode.OUT_OF_ORDER_SEQUENCE


class UnknownProducerId(TidewaterError):
    """A batch with a sequence other than 0 from a producer the partition has no state for."""

    code = ErrorCode.UNKNOWN_PRODUCER_ID


class InvalidProducerEpoch(TidewaterError):
    """A batch from an older epoch of a producer id: a newer incarnation fenced it."""

    code = ErrorCode.INVALID_PRODUCER_EPOCH


class ProducerIdAllocationFailed(TidewaterError):
    code = ErrorCode.PRODUCER_ID_ALLOCATION_FAILED


class LeaderNotAvailable(TidewaterError):
    code = ErrorCode.LEADER_NOT_AVAILABLE


class ReplicaNotAvailable(TidewaterError):
    code = ErrorCode.REPLICA_NOT_AVAILABLE


class TopicAlreadyExists(TidewaterError):
    code = ErrorCode.TOPIC_ALREADY_EXISTS


class TopicDeletionInProgress(TidewaterError):
    code = ErrorCode.TOPIC_DELETION_IN_PROGRESS


class InvalidUpdateVersion(TidewaterError):
    code = ErrorCode.INVALID_UPDATE_VERSION


class IneligibleReplica(TidewaterError):
    code = ErrorCode.INELIGIBLE_REPLICA


class EligibleLeadersNotAvailable(TidewaterError):
    code = ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE


class NoReassignmentInProgress(TidewaterError):
    code = ErrorCode.NO_REASSIGNMENT_IN_PROGRESS


class DuplicateBrokerRegistration(TidewaterError):
    code = ErrorCode.DUPLICATE_BROKER_REGISTRATION


class OffsetNotAvailable(TidewaterError):
    code = ErrorCode.OFFSET_NOT_AVAILABLE
