"""The two delayed operations of the data path: DelayedProduce (acks=all) and DelayedFetch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from tidewater.broker.purgatory import DelayedOperation
from tidewater.errors import NO_ERROR
from tidewater.replication.partition import Partition
from tidewater.v1.errors_pb2 import ErrorCode

TopicPartition = tuple[str, int]
# error code and message per partition, NONE/"" when committed
PartitionOutcome = tuple[int, str]


class DelayedProduce(DelayedOperation):
    """Waits until the HW of every appended partition covers its batch (Kafka's DelayedProduce)."""

    def __init__(
        self,
        timeout_ms: int,
        required_offsets: dict[TopicPartition, int],
        lookup: Callable[[TopicPartition], Partition | None],
    ) -> None:
        super().__init__(timeout_ms)
        self._required = required_offsets
        self._lookup = lookup
        self.outcomes: dict[TopicPartition, PartitionOutcome] = {}
        self.done: asyncio.Future[dict[TopicPartition, PartitionOutcome]] = (
            asyncio.get_running_loop().create_future()
        )

    def try_complete(self) -> bool:
        for tp, required in self._required.items():
            if tp in self.outcomes:
                continue
            partition = self._lookup(tp)
            if partition is None or not partition.is_leader:
                self.outcomes[tp] = (
                    ErrorCode.NOT_LEADER_OR_FOLLOWER,
                    f"leadership of {tp[0]}-{tp[1]} moved before the batch was committed",
                )
                continue
            enough = partition.enough_replicas_for(required)
            if enough is True:
                self.outcomes[tp] = (NO_ERROR, "")
            elif enough is False:
                self.outcomes[tp] = (
                    ErrorCode.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
                    f"{tp[0]}-{tp[1]}: ISR {sorted(partition.isr)} shrank below "
                    f"min.insync.replicas={partition.config.min_insync_replicas} after the append",
                )
        if len(self.outcomes) == len(self._required):
            return self.force_complete()
        return False

    def on_expiration(self) -> None:
        for tp in self._required:
            self.outcomes.setdefault(
                tp,
                (
                    ErrorCode.REQUEST_TIMED_OUT,
                    f"{tp[0]}-{tp[1]}: the ISR did not replicate the batch within "
                    f"{self.timeout_ms} ms",
                ),
            )

    def on_complete(self) -> None:
        if not self.done.done():
            self.done.set_result(self.outcomes)


R = TypeVar("R")


class DelayedFetch(DelayedOperation, Generic[R]):
    """Waits until a fetch can return min_bytes (Kafka's DelayedFetch).

    `readable` tells, without reading, whether a read could answer now (records past a fetch
    offset, or a partition that would answer with an error); only then does `read` run. It
    performs the fetch's reads and returns (result, bytes read, whether to answer whatever the
    size); the read that satisfies the condition is the one answered, so no second read. A
    poll that expires, or is cancelled, answers with a read at that moment.
    """

    def __init__(
        self,
        timeout_ms: int,
        min_bytes: int,
        read: Callable[[], tuple[R, int, bool]],
        readable: Callable[[], bool],
    ) -> None:
        super().__init__(timeout_ms)
        self._min_bytes = min_bytes
        self._read = read
        self._readable = readable
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
        except Exception as e:  # the waiting fetch fails with it, rather than never answering
            self.done.set_exception(e)
            return
        self.done.set_result(answer)
