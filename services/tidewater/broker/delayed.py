"""The two delayed operations of the data path: DelayedProduce (acks=all) and DelayedFetch."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

from tidewater.broker.partition import HostedPartition
from tidewater.broker.purgatory import DelayedOperation
from tidewater.errors import NO_ERROR
from tidewater.v1.errors_pb2 import ErrorCode

log = logging.getLogger(__name__)

TopicPartition = tuple[str, int]
# error code and message per partition, NONE/"" when committed
PartitionOutcome = tuple[int, str]


class Appended(NamedTuple):
    """An acks=all batch in a leader's log, waiting to be committed."""

    # The high watermark that commits it: its last offset + 1.
    required_offset: int
    # The leader epoch and the hosted partition it was appended under: a leader that lost
    # the partition in between may have truncated the batch and copied another leader's
    # records to its offsets, even if it leads again (Partition.holds_append).
    leader_epoch: int
    partition: HostedPartition


class DelayedProduce(DelayedOperation):
    """Waits until the HW of every appended partition covers its batch (Kafka's DelayedProduce),
    while the batch is still in this leader's log where it was appended."""

    def __init__(
        self,
        timeout_ms: int,
        waiting: dict[TopicPartition, Appended],
        lookup: Callable[[TopicPartition], HostedPartition | None],
    ) -> None:
        super().__init__(timeout_ms)
        self._waiting = waiting
        self._lookup = lookup
        self.outcomes: dict[TopicPartition, PartitionOutcome] = {}
        self.done: asyncio.Future[dict[TopicPartition, PartitionOutcome]] = (
            asyncio.get_running_loop().create_future()
        )

    def try_complete(self) -> bool:
        for tp, appended in self._waiting.items():
            if tp in self.outcomes:
                continue
            state = appended.partition.state
            if not self._in_log(tp, appended):
                self.outcomes[tp] = (
                    ErrorCode.NOT_LEADER_OR_FOLLOWER,
                    f"leadership of {tp[0]}-{tp[1]} moved before the batch was committed "
                    f"(appended at leader epoch {appended.leader_epoch})",
                )
                continue
            enough = state.enough_replicas_for(appended.required_offset)
            if enough is True:
                self.outcomes[tp] = (NO_ERROR, "")
            elif enough is False:
                self.outcomes[tp] = (
                    ErrorCode.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
                    f"{tp[0]}-{tp[1]}: after the append, {state.min_isr_shortfall}",
                )
        if len(self.outcomes) == len(self._waiting):
            return self.force_complete()
        return False

    def _in_log(self, tp: TopicPartition, appended: Appended) -> bool:
        """Whether the batch is still in this leader's log where it was appended."""
        state = appended.partition.state
        return (
            self._lookup(tp) is appended.partition
            and state.is_leader
            and state.holds_append(appended.leader_epoch, appended.required_offset)
        )

    def on_expiration(self) -> None:
        for tp, appended in self._waiting.items():
            if tp in self.outcomes:
                continue
            state = appended.partition.state
            if self._in_log(tp, appended) and state.under_min_isr:
                # The ISR shrank below min ISR after the append, so the HW waits for it to
                # grow back (KIP-966), and it did not: Kafka's meaning of this error.
                self.outcomes[tp] = (
                    ErrorCode.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
                    f"{tp[0]}-{tp[1]}: the batch is in the leader's log, but the ISR shrank "
                    f"after the append and did not grow back within {self.timeout_ms} ms: "
                    f"{state.min_isr_shortfall}",
                )
            else:
                self.outcomes[tp] = (
                    ErrorCode.REQUEST_TIMED_OUT,
                    f"{tp[0]}-{tp[1]}: the ISR did not replicate the batch within "
                    f"{self.timeout_ms} ms",
                )

    def on_complete(self) -> None:
        # Completed with no outcome for a batch (the purgatory cancelled at shutdown): its
        # fate is unknown, as after a timeout; never success, and leadership may not have moved.
        self._answer(
            ErrorCode.REQUEST_TIMED_OUT,
            "the broker stopped waiting for the ISR to replicate the batch (shutting down)",
        )

    def on_failure(self, error: Exception) -> None:
        # A check raised (a bug): each batch still waiting answers an error, as Kafka answers
        # an unexpected exception; raised into the request, it would fail a whole stream.
        self._answer(
            ErrorCode.UNKNOWN_SERVER_ERROR,
            f"checking whether the ISR replicated the batch failed ({error!r}); the batch is "
            "in the log and may yet be committed",
        )

    def _answer(self, code: int, reason: str) -> None:
        """Answer the outcomes, `code` and `reason` for each batch without one."""
        for tp in self._waiting:
            if tp not in self.outcomes:
                self.outcomes[tp] = (code, f"{tp[0]}-{tp[1]}: {reason}")
        if not self.done.done():
            self.done.set_result(self.outcomes)


R = TypeVar("R")


class DelayedFetch(DelayedOperation, Generic[R]):
    """Waits until a fetch can return min_bytes (Kafka's DelayedFetch).

    `readable` tells, without reading, whether a read could answer now (records past a fetch
    offset, or a partition that would answer with an error); only then does `read` run. It
    performs the fetch's reads and returns (result, bytes read, whether to answer whatever the
    size); the read that satisfies the condition is the one answered, so no second read. A
    poll that expires, or is cancelled, answers with a read at that moment. A check or read
    that raises (a bug) answers `failed(error)`: an error per partition, not an exception
    that would fail a whole FetchStream.
    """

    def __init__(
        self,
        timeout_ms: int,
        min_bytes: int,
        read: Callable[[], tuple[R, int, bool]],
        readable: Callable[[], bool],
        failed: Callable[[Exception], R],
    ) -> None:
        super().__init__(timeout_ms)
        self._min_bytes = min_bytes
        self._read = read
        self._readable = readable
        self._failed = failed
        self._answer: R | None = None
        self.done: asyncio.Future[R] = asyncio.get_running_loop().create_future()

    def try_complete(self) -> bool:
        if not self._readable():
            return False
        result, size, answer_now = self._read()
        if size >= self._min_bytes or answer_now:
            self._answer = result
            return self.force_complete()
        return False

    def on_complete(self) -> None:
        if self.done.done():
            return
        try:
            answer = self._answer if self._answer is not None else self._read()[0]
        except Exception as e:  # answered as failed, rather than never answering
            log.exception("reading a waiting fetch failed")
            self.on_failure(e)
            return
        self.done.set_result(answer)

    def on_failure(self, error: Exception) -> None:
        if not self.done.done():
            self.done.set_result(self._failed(error))
