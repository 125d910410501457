"""Errors the client raises on its own, beside the protocol's TidewaterError subclasses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidewater.errors import ControllerUnavailable, OffsetOutOfRange, TidewaterError
from tidewater.v1.errors_pb2 import ErrorCode

if TYPE_CHECKING:  # metadata imports this module
    from tidewater.client.metadata import TopicPartition


class ClientError(Exception):
    """A failure on the client side that no broker answered with."""


class MetadataUnavailable(ClientError):
    """No metadata address answered: each refused, failed or let its deadline pass."""


class BufferExhausted(ClientError):
    """buffer_memory stayed used up for max_block_ms: the producer outpaces the cluster."""


class ProducerClosed(ClientError):
    """send() after close() began, or a record close() left unacknowledged (it was cancelled
    or timed out)."""


class ConsumerClosed(ClientError):
    """A call that would fetch or look up offsets after close() (Kafka's consumer refuses
    every call then)."""


class SenderFailed(ClientError):
    """The producer's sender task stopped on an uncaught error (a bug; its cause is chained
    and was logged): every record it had not settled fails with this, and every later send()
    raises it, as a Kafka producer in a fatal state fails its pending and later sends. Close
    the producer and make another."""


class NoOffsetForPartition(ClientError):
    """poll() on a partition with no position (never sought) and auto_offset_reset "none"."""


class DeliveryTimeout(TidewaterError):
    """A record was not acknowledged within delivery_timeout_ms (retries and a request in
    flight included). Once sent, its outcome is unknown: it may be in the log. `last_error`:
    the retriable error of its last attempt answered, if any (NOT_ENOUGH_REPLICAS, ...)."""

    code = ErrorCode.REQUEST_TIMED_OUT

    def __init__(self, message: str, last_error: TidewaterError | None = None) -> None:
        super().__init__(message)
        self.last_error = last_error


class LogTruncation(OffsetOutOfRange):
    """KIP-320: the partition's leader changed and its log ends, in the epoch of the records
    the consumer read last, before the consumer's position: records it read are not in the
    log (an unclean election, or tails lost unflushed). Raised by poll() when
    auto_offset_reset is "none" (with a policy the consumer goes on from divergent_offset,
    the first offset known to diverge); poll() raises it again until a seek()."""

    def __init__(self, tp: TopicPartition, position: int, divergent_offset: int) -> None:
        super().__init__(
            f"{tp[0]}-{tp[1]}: log truncation detected: fetch position {position}, but the "
            f"leader's log diverges from offset {divergent_offset}"
        )
        self.topic_partition = tp
        self.position = position
        self.divergent_offset = divergent_offset


# Raised by the client with its own arguments, never made from a response's error code.
_CLIENT_SIDE = (DeliveryTimeout, LogTruncation, ControllerUnavailable)


# Errors that mean the client's view of the leaders is stale.
REFRESH_METADATA = frozenset(
    {
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.NOT_LEADER_OR_FOLLOWER,
        ErrorCode.LEADER_NOT_AVAILABLE,
        ErrorCode.FENCED_LEADER_EPOCH,
        ErrorCode.UNKNOWN_LEADER_EPOCH,
        ErrorCode.STORAGE_ERROR,
        ErrorCode.UNKNOWN_TOPIC_ID,
    }
)


def error_for(code: int, message: str) -> TidewaterError:
    """The TidewaterError subclass whose code is `code` (the base class when none is)."""
    for cls in _subclasses(TidewaterError):
        if cls.code == code and cls not in _CLIENT_SIDE:
            return cls(message)
    return TidewaterError(message, code)


def _subclasses(cls: type[TidewaterError]) -> list[type[TidewaterError]]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_subclasses(sub))
    return found
