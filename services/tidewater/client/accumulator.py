"""The producer's record accumulator: a queue of batches per partition, filled by send() and
drained by the sender. Appending is the hot path: it only collects records; the batch bytes are
built once, when the batch is first sent, and one asyncio future per batch, not per record,
signals the outcome."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from itertools import count
from typing import Any

from tidewater.client.spans import BatchTrace
from tidewater.records.batch import Record, build_batch
from tidewater.records.header import NO_PRODUCER_EPOCH, NO_PRODUCER_ID, NO_SEQUENCE, Compression

TopicPartition = tuple[str, int]
# Per-record bytes beyond key and value in the batch format (lengths, deltas, attributes).
RECORD_OVERHEAD = 21
UNKNOWN_OFFSET = -1


@dataclass(frozen=True, slots=True)
class RecordMetadata:
    """Where an acknowledged record landed. `offset` UNKNOWN_OFFSET: in the log, at an offset
    the producer could not learn (a retry of an idempotent batch its leader no longer
    remembered, which a later batch's acknowledgement proves written)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int


def estimate_size(key: bytes | None, value: bytes | None, headers: tuple) -> int:
    size = RECORD_OVERHEAD + (len(key) if key else 0) + (len(value) if value else 0)
    for name, header_value in headers:
        size += len(name) + (len(header_value) if header_value else 0) + 2
    return size


class RecordFuture:
    """The outcome of one send(): awaitable, with asyncio.Future's done(), cancelled(),
    result(), exception() and add_done_callback(). Resolved with its batch (Kafka's
    FutureRecordMetadata over the batch's result)."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: ProducerBatch, index: int) -> None:
        self._batch = batch
        self._index = index

    def done(self) -> bool:
        return self._batch.done.done()

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        if not self._batch.done.done():
            raise asyncio.InvalidStateError("the record is not acknowledged yet")
        batch, _ = self._batch.holding(self._index)
        return batch.error

    def result(self) -> RecordMetadata:
        error = self.exception()
        if error is not None:
            raise error
        batch, index = self._batch.holding(self._index)
        return batch.metadata(index)

    def add_done_callback(self, callback: Callable[[RecordFuture], object]) -> None:
        self._batch.done.add_done_callback(lambda _: callback(self))

    def __await__(self) -> Generator[Any, None, RecordMetadata]:
        # Shielded: a cancelled waiter must not cancel the batch every record shares.
        yield from asyncio.shield(self._batch.done).__await__()
        return self.result()


class ProducerBatch:
    """Records for one partition, sent as one record batch; retried with the same bytes unless
    renumbered (stamp) by an epoch bump."""

    __slots__ = (
        "attempts",
        "base_offset",
        "base_sequence",
        "closed",
        "created",
        "data",
        "done",
        "error",
        "last_error",
        "log_append_time_ms",
        "now_ms",
        "order",
        "parts",
        "producer_epoch",
        "producer_id",
        "records",
        "size",
        "tp",
        "trace",
    )

    def __init__(
        self,
        tp: TopicPartition,
        order: tuple[int, ...],
        created: float,
        done: asyncio.Future[None],
    ) -> None:
        self.tp = tp
        # Creation order: (n,) for the n-th batch; a split's parts extend their batch's with
        # 0 and 1, so they sort where it was, ahead of what came after it (its own other part
        # included: review 24 #1).
        self.order = order
        self.created = created
        self.done: asyncio.Future[None] = done
        self.records: list[Record] = []
        self.size = 0
        self.closed = False
        self.attempts = 0
        self.producer_id = NO_PRODUCER_ID
        self.producer_epoch = NO_PRODUCER_EPOCH
        self.base_sequence = NO_SEQUENCE
        self.data: bytes | None = None
        # Set by the first build (the records' CreateTime when they carry none).
        self.now_ms = -1
        # The outcome, once `done`: where the batch landed, or why it failed.
        self.base_offset = UNKNOWN_OFFSET
        self.log_append_time_ms = -1
        self.error: BaseException | None = None
        # The retriable error its last attempt was answered with (code, message), for its
        # DeliveryTimeout to name.
        self.last_error: tuple[int, str] | None = None
        # Spans of this batch when the producer traces (tidewater.client.spans).
        self.trace: BatchTrace | None = None
        # The batches its records went on in, once split (split()).
        self.parts: list[ProducerBatch] | None = None

    @property
    def record_count(self) -> int:
        return len(self.records)

    def split(self) -> list[ProducerBatch]:
        """Its records in two batches of half as many, in order, sent in its place (Kafka's
        splitAndReenqueue, for a batch a broker refused as larger than the topic's
        max.message.bytes). It is done once both are, each record's outcome its part's."""
        half = len(self.records) // 2
        loop = self.done.get_loop()
        parts = []
        for i, records in enumerate((self.records[:half], self.records[half:])):
            part = ProducerBatch(self.tp, (*self.order, i), self.created, loop.create_future())
            part.records = records
            part.size = self.size * len(records) // len(self.records)
            part.closed = True
            part.now_ms = self.now_ms  # the records' CreateTime when they carry none
            part.trace = self.trace.part() if self.trace is not None else None
            parts.append(part)
        self.parts = parts

        def part_done(_: object) -> None:
            if not self.done.done() and all(part.done.done() for part in parts):
                failed = next((part.error for part in parts if part.error is not None), None)
                if self.trace is not None:
                    first = self.holding(0)[0].base_offset
                    size = sum(len(part.data or b"") for part in parts)
                    offset = first if failed is None and first != UNKNOWN_OFFSET else None
                    self.trace.end(len(self.records), size, offset, failed)
                self.done.set_result(None)

        for part in parts:
            part.done.add_done_callback(part_done)
        return parts

    def holding(self, index: int) -> tuple[ProducerBatch, int]:
        """The batch that holds its record at `index` (itself, or a part of a split, or of a
        part's), and the record's index there."""
        batch = self
        while batch.parts is not None and batch.error is None:
            first = batch.parts[0]
            if index < first.record_count:
                batch = first
            else:
                index -= first.record_count
                batch = batch.parts[1]
        return batch, index

    def stamp(self, producer_id: int, producer_epoch: int, base_sequence: int) -> None:
        """The idempotent producer's numbering; the bytes are built (again) on the next send."""
        self.producer_id = producer_id
        self.producer_epoch = producer_epoch
        self.base_sequence = base_sequence
        self.data = None

    def build(self, compression: Compression, now_ms: int) -> bytes:
        """The batch's bytes; a rebuild keeps the first build's timestamps."""
        self.closed = True
        if self.now_ms < 0:
            self.now_ms = now_ms
        self.data = build_batch(
            self.records,
            compression=compression,
            producer_id=self.producer_id,
            producer_epoch=self.producer_epoch,
            base_sequence=self.base_sequence,
            now_ms=self.now_ms,
        )
        return self.data

    def complete(self, base_offset: int, log_append_time_ms: int) -> None:
        if self.done.done():
            return
        self.base_offset = base_offset
        self.log_append_time_ms = log_append_time_ms
        if self.trace is not None:
            self.trace.end(len(self.records), len(self.data or b""), base_offset, None)
        self.done.set_result(None)

    def fail(self, error: BaseException) -> None:
        if self.done.done():
            return
        self.error = error
        if self.trace is not None:
            self.trace.end(len(self.records), len(self.data or b""), None, error)
        self.done.set_result(None)

    def metadata(self, index: int) -> RecordMetadata:
        """Where the record at `index` landed (the batch completed)."""
        timestamp = self.log_append_time_ms
        if timestamp < 0:
            timestamp = self.records[index].timestamp_ms
            if timestamp is None:
                timestamp = self.now_ms
        offset = UNKNOWN_OFFSET if self.base_offset == UNKNOWN_OFFSET else self.base_offset + index
        return RecordMetadata(*self.tp, offset, timestamp)


class RecordAccumulator:
    """Open and closed batches per partition, oldest first."""

    def __init__(self, batch_size: int, loop: asyncio.AbstractEventLoop) -> None:
        self.batch_size = batch_size
        self.queues: dict[TopicPartition, deque[ProducerBatch]] = {}
        self.incomplete: set[ProducerBatch] = set()
        self._loop = loop
        self._order = count()

    def append(
        self, tp: TopicPartition, record: Record, size: int, now: float
    ) -> tuple[RecordFuture, ProducerBatch]:
        """Add a record to the partition's open batch (closed once full); returns the
        record's future and its batch."""
        queue = self.queues.get(tp)
        if queue is None:
            queue = self.queues[tp] = deque()
        batch = queue[-1] if queue else None
        if batch is None or not self._fits(batch, size):
            if batch is not None:
                batch.closed = True
            batch = ProducerBatch(tp, (next(self._order),), now, self._loop.create_future())
            queue.append(batch)
            self.incomplete.add(batch)
        future = RecordFuture(batch, len(batch.records))
        batch.records.append(record)
        batch.size += size
        if batch.size >= self.batch_size:
            batch.closed = True
        return future, batch

    def last_batch_full(self, tp: TopicPartition, size: int) -> bool:
        """Whether `tp` has a batch that a record of `size` would have to close and start a
        new one after (Kafka's abortOnNewBatch: the sticky partitioner moves on instead)."""
        queue = self.queues.get(tp)
        return bool(queue) and not self._fits(queue[-1], size)

    def _fits(self, batch: ProducerBatch, size: int) -> bool:
        """An open batch takes a record if it has room; an empty one takes any record."""
        return not batch.closed and (batch.size + size <= self.batch_size or not batch.size)

    def queue_length(self, tp: TopicPartition) -> int:
        queue = self.queues.get(tp)
        return len(queue) if queue else 0

    def requeue(self, batch: ProducerBatch) -> None:
        """Put a batch to retry back in creation order, ahead of newer batches."""
        queue = self.queues.setdefault(batch.tp, deque())
        index = next((i for i, q in enumerate(queue) if q.order > batch.order), len(queue))
        queue.insert(index, batch)
