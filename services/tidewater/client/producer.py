"""The asyncio producer: send() partitions and accumulates records; one sender task drains
ready batches to each partition's leader over a ProduceStream per broker, retrying retriable
errors until delivery_timeout_ms with per-partition order kept."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc
from opentelemetry.trace import TracerProvider

from tidewater.client.accumulator import (
    UNKNOWN_OFFSET,
    ProducerBatch,
    RecordAccumulator,
    RecordFuture,
    RecordMetadata,
    TopicPartition,
    estimate_size,
)
from tidewater.client.errors import (
    REFRESH_METADATA,
    BufferExhausted,
    ClientError,
    DeliveryTimeout,
    MetadataUnavailable,
    ProducerClosed,
    SenderFailed,
    error_for,
)
from tidewater.client.metadata import ClusterMetadata
from tidewater.client.partitioner import StickyPartitioner, partition_for_key
from tidewater.client.sequences import REFUSED_BEFORE_APPEND, SEQUENCE_REFUSALS, ProducerSequences
from tidewater.client.spans import BatchTrace
from tidewater.errors import (
    NO_ERROR,
    RETRIABLE,
    InvalidConfig,
    MessageTooLarge,
    TidewaterError,
    UnknownTopicOrPartition,
)
from tidewater.records.batch import Headers, Record
from tidewater.records.header import NO_PRODUCER_EPOCH, NO_PRODUCER_ID, Compression
from tidewater.rpc.streams import MAX_IN_FLIGHT_PER_STREAM
from tidewater.telemetry import tracing
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

__all__ = ["Producer", "RecordFuture", "RecordMetadata"]

log = logging.getLogger(__name__)

# The broker answers a produce within request_timeout_ms (REQUEST_TIMED_OUT at the latest):
# a link gives up on an answer this much later.
ANSWER_GRACE_S = 5.0
COMPRESSIONS = {
    None: Compression.NONE,
    "none": Compression.NONE,
    "gzip": Compression.GZIP,
    "lz4": Compression.LZ4,
    "zstd": Compression.ZSTD,
}
DEFAULTS: dict[str, Any] = {
    "acks": -1,
    "batch_size": 16384,
    "linger_ms": 5,
    "buffer_memory": 32 * 1024 * 1024,
    "max_block_ms": 60000,
    "max_request_size": 1048576,
    "compression": None,
    "retries": 2**31 - 1,
    "retry_backoff_ms": 100,
    "delivery_timeout_ms": 120000,
    "request_timeout_ms": 30000,
    "max_in_flight_requests_per_connection": 5,
    "enable_idempotence": True,
    "metadata_max_age_ms": 300000,
}


class ProducerConfig:
    """The producer's settings under Kafka's names, validated up front."""

    def __init__(self, **config: Any) -> None:
        unknown = set(config) - set(DEFAULTS)
        if unknown:
            raise InvalidConfig(f"unknown producer setting(s): {', '.join(sorted(unknown))}")
        values = {**DEFAULTS, **config}
        self.acks: int = values["acks"]
        if self.acks not in (-1, 0, 1):
            raise InvalidConfig(f"acks must be -1 (all), 0 or 1, got {self.acks!r}")
        if values["compression"] not in COMPRESSIONS:
            raise InvalidConfig(
                "compression must be None, 'none', 'gzip', 'lz4' or 'zstd', "
                f"got {values['compression']!r}"
            )
        self.compression = COMPRESSIONS[values["compression"]]
        for name in ("batch_size", "buffer_memory", "max_request_size", "request_timeout_ms"):
            _check_int(name, values[name], minimum=1)
        for name in (
            "linger_ms",
            "max_block_ms",
            "retries",
            "retry_backoff_ms",
            "metadata_max_age_ms",
        ):
            _check_int(name, values[name], minimum=0)
        _check_int(
            "max_in_flight_requests_per_connection",
            values["max_in_flight_requests_per_connection"],
            minimum=1,
        )
        self.batch_size: int = values["batch_size"]
        self.buffer_memory: int = values["buffer_memory"]
        self.max_request_size: int = values["max_request_size"]
        self.linger_s: float = values["linger_ms"] / 1000
        self.max_block_s: float = values["max_block_ms"] / 1000
        self.retries: int = values["retries"]
        self.retry_backoff_s: float = values["retry_backoff_ms"] / 1000
        self.request_timeout_s: float = values["request_timeout_ms"] / 1000
        self.delivery_timeout_s: float = values["delivery_timeout_ms"] / 1000
        self.max_in_flight: int = values["max_in_flight_requests_per_connection"]
        self.idempotent: bool = bool(values["enable_idempotence"])
        self.metadata_max_age_s: float = values["metadata_max_age_ms"] / 1000
        if self.delivery_timeout_s < self.linger_s + self.request_timeout_s:
            raise InvalidConfig(
                "delivery_timeout_ms must be at least linger_ms + request_timeout_ms"
            )
        if self.idempotent:
            if self.acks != -1:
                raise InvalidConfig("enable_idempotence requires acks=-1")
            if self.retries < 1:
                # A batch whose predecessor has not landed yet is refused until it has.
                raise InvalidConfig("enable_idempotence requires retries of at least 1")
            if self.max_in_flight > 5:
                raise InvalidConfig(
                    "enable_idempotence allows at most 5 max_in_flight_requests_per_connection"
                )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidConfig(f"{name} must be an integer >= {minimum}, got {value!r}")


_BYTES_OR_NONE = (bytes, bytearray, memoryview, type(None))


def _check_bytes(key: object, value: object, headers: Headers) -> None:
    if not isinstance(value, _BYTES_OR_NONE) or not isinstance(key, _BYTES_OR_NONE):
        raise TypeError(
            f"a record's key and value are bytes or None, not {type(key).__name__} and "
            f"{type(value).__name__}: encode them first"
        )
    for name, header_value in headers:
        if not isinstance(name, str) or not isinstance(header_value, _BYTES_OR_NONE):
            raise TypeError(
                f"a header is (str, bytes | None), not ({type(name).__name__}, "
                f"{type(header_value).__name__})"
            )


class Producer:
    """`await producer.send(...)` queues a record and returns a future of its RecordMetadata.

    Use as `async with Producer([...]) as producer:` or call close()."""

    def __init__(
        self,
        bootstrap: Sequence[str],
        *,
        tracer_provider: TracerProvider | None = None,
        **config: Any,
    ) -> None:
        """`config`: Kafka's producer settings (DEFAULTS). `tracer_provider`: where this
        producer's spans go; default the global one, when the application installed one."""
        self.config = ProducerConfig(**config)
        self.metadata = ClusterMetadata(
            bootstrap,
            request_timeout_s=min(self.config.request_timeout_s, 10.0),
            retry_backoff_s=self.config.retry_backoff_s,
            max_age_s=self.config.metadata_max_age_s,
        )
        self._accumulator: RecordAccumulator | None = None
        self._partitioner: StickyPartitioner | None = None
        self._used_memory = 0
        self._memory_freed = asyncio.Event()
        self._wake = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        # The start() under way, which concurrent send()s share (one InitProducerId).
        self._starting: asyncio.Task[None] | None = None
        self._links: dict[str, _BrokerLink] = {}
        # Sent batches not answered yet, oldest first (Kafka's inFlightBatches).
        self._in_flight: dict[TopicPartition, list[ProducerBatch]] = {}
        self._muted_until: dict[TopicPartition, float] = {}
        self._sequences = ProducerSequences()
        self._flushing = 0
        self._closed = False
        # Set once the sender died: the cause of the SenderFailed every later send() raises.
        self._sender_error: Exception | None = None
        self._link_error: Exception | None = None
        self._tracer = tracing.client_tracer(tracer_provider)
        # Its batches' traces; sampled out, their streams declared its constant context.
        self._new_traces = tracing.NewTraces()

    async def __aenter__(self) -> Producer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Reach the cluster (and get a producer id when idempotent); send() does it too.
        Concurrent calls share one attempt; a failed one leaves the producer unstarted, and
        the next call tries again."""
        if self._accumulator is not None:
            return
        starting = self._starting
        if starting is None:
            # Detached: the sender it starts outlives the first send()'s span.
            starting = self._starting = tracing.detached_task(self._start())
            # Its error is raised to every caller; retrieved here for when all were cancelled.
            starting.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            # Shielded: one cancelled send() must not fail the start the others wait on.
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            self._check_open_unless_cancelled()
            raise

    async def _start(self) -> None:
        try:
            if self.config.idempotent:
                await self._first_producer_id()
        finally:
            self._starting = None
        # close() may have run meanwhile: a sender started now would never be stopped.
        self._check_open()
        loop = asyncio.get_running_loop()
        # The accumulator comes with the sender, never before: send() starts the producer
        # while there is none, and a record appended with no sender would never be sent.
        self._accumulator = RecordAccumulator(self.config.batch_size, loop)
        self._partitioner = StickyPartitioner(
            lambda topic, p: self._accumulator.queue_length((topic, p)),  # type: ignore[union-attr]
            lambda topic, p: self.metadata.leader((topic, p)) is not None,
        )
        self._sender = loop.create_task(self._run())

    def _sticky_partition(self, topic: str, num_partitions: int, size: int) -> int:
        """The sticky partition, moved on when its open batch is full (KIP-480's onNewBatch):
        otherwise records sent without a pause for the sender would all go to one partition."""
        assert self._partitioner is not None and self._accumulator is not None
        partition = self._partitioner.partition(topic, num_partitions)
        if self._accumulator.last_batch_full((topic, partition), size):
            self._partitioner.batch_closed(topic, partition)
            partition = self._partitioner.partition(topic, num_partitions)
        return partition

    async def send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None = None,
        headers: Headers = (),
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> RecordFuture:
        """Queue a record; waits up to max_block_ms for the topic's metadata and for buffer
        memory. The returned future resolves once the record is acknowledged. A key, value
        or header value that is not bytes raises TypeError here (as Kafka's serializers fail
        in send()): the sender, which encodes the batch later, must never meet one.
        ProducerClosed once close() has begun, also when it begins while send() waits;
        SenderFailed once the sender died."""
        self._check_open()
        _check_bytes(key, value, headers)
        if self._accumulator is None:
            await self.start()
        accumulator = self._accumulator
        assert accumulator is not None and self._partitioner is not None
        deadline = time.monotonic() + self.config.max_block_s
        num_partitions = await self._partition_count(topic, deadline)
        size = estimate_size(key, value, headers)
        if partition is None:
            if key is None:
                partition = self._sticky_partition(topic, num_partitions, size)
            else:
                partition = partition_for_key(key, num_partitions)
        elif not 0 <= partition < num_partitions:
            raise UnknownTopicOrPartition(
                f"topic {topic!r} has {num_partitions} partitions, not partition {partition}"
            )
        if size > self.config.max_request_size or size > self.config.buffer_memory:
            raise MessageTooLarge(
                f"record of about {size} bytes exceeds max_request_size "
                f"({self.config.max_request_size}) or buffer_memory ({self.config.buffer_memory})"
            )
        if self._used_memory + size > self.config.buffer_memory:
            await self._wait_for_memory(size, deadline)
        # Checked again after the waits (as Kafka's accumulator does): a record appended after
        # close() stopped the sender would never be sent, and its future never resolved.
        self._check_open()
        self._used_memory += size
        future, batch = accumulator.append(
            (topic, partition), Record(key, value, headers, timestamp_ms), size, time.monotonic()
        )
        if batch.closed:
            self._partitioner.batch_closed(topic, partition)
            self._wake.set()
        elif len(batch.records) == 1:
            # A new batch: the sender must learn when its linger ends.
            self._wake.set()
        if self._tracer is not None and len(batch.records) == 1:
            batch.trace = BatchTrace(
                self._tracer, self._new_traces, topic, partition, self.config.acks
            )
        return future

    async def send_and_wait(self, topic: str, value: bytes | None, **kwargs: Any) -> RecordMetadata:
        return await (await self.send(topic, value, **kwargs))

    async def flush(self) -> None:
        """Send every queued record now and wait until each is acknowledged or failed."""
        if self._accumulator is None or not self._accumulator.incomplete:
            return
        waiting = [batch.done for batch in self._accumulator.incomplete]
        self._flushing += 1
        self._wake.set()
        try:
            # wait(), not gather(): a cancelled flush() must not cancel the batches' futures.
            await asyncio.wait(waiting)
        finally:
            self._flushing -= 1

    async def close(self) -> None:
        """Deliver what is queued (up to delivery_timeout_ms), then release connections. What
        is still unacknowledged after that (close() was cancelled or timed out) fails with
        ProducerClosed: no future is left pending."""
        if self._closed:
            return
        self._closed = True
        try:
            # A sender that died (a bug) failed what it held and would never send more.
            if self._sender is None or not self._sender.done():
                await self.flush()
        finally:
            # Shielded: a close() cancelled again still stops everything and fails the rest.
            await asyncio.shield(self._shut_down())

    async def _shut_down(self) -> None:
        starting = self._starting
        if starting is not None:
            # Waiting for a producer id: its send()s raise ProducerClosed.
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
        await self._abort(ProducerClosed, "the producer closed before an acknowledgement")
        await self.metadata.close()

    async def _abort(self, error: type[ClientError], reason: str) -> None:
        """Stop the links, then fail every batch left with `error` (Kafka's
        abortIncompleteBatches): nothing else would resolve their futures."""
        for link in self._links.values():
            await link.close()
        if self._accumulator is None:
            return
        # Batches still in flight lost their answers (their link stopped first); those that
        # expired in flight are no longer incomplete, but their sequences are still open.
        left = self._accumulator.incomplete.union(*self._in_flight.values())
        for batch in sorted(left, key=lambda b: b.order):
            message = f"{batch.tp[0]}-{batch.tp[1]}: {reason}"
            if batch.attempts:
                message += "; it was sent, so it may be in the log"
            self._fail(batch, error(message))
        self._accumulator.queues.clear()
        self._in_flight.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise ProducerClosed("send() on a closed producer")
        if self._sender_error is not None:
            error = self._sender_error
            raise SenderFailed(f"the producer's sender stopped: {error!r}") from error

    async def _refresh(self, topics: Sequence[str] = ()) -> None:
        """metadata.refresh(), where close() cancelling the refresh this task shares (not this
        task) raises ProducerClosed rather than a CancelledError no one asked for."""
        try:
            await self.metadata.refresh(topics)
        except asyncio.CancelledError:
            self._check_open_unless_cancelled()
            raise

    def _check_open_unless_cancelled(self) -> None:
        """In a CancelledError from a wait this task shares with others (a start, a refresh):
        when close() cancelled what it waited for, not this task, ProducerClosed rather than
        a CancelledError no one asked for."""
        task = asyncio.current_task()
        if task is not None and not task.cancelling():
            self._check_open()

    # -- metadata and memory ----------------------------------------------------------

    async def _partition_count(self, topic: str, deadline: float) -> int:
        info = self.metadata.topics.get(topic)
        while info is None or info.error_code != NO_ERROR or not info.num_partitions:
            self._check_open()  # after close(), a refresh opens channels nothing closes
            await self._refresh([topic])
            info = self.metadata.topics.get(topic)
            if info is not None and info.error_code == NO_ERROR and info.num_partitions:
                break
            if info is not None and info.error_code not in RETRIABLE | {NO_ERROR}:
                # INVALID_TOPIC: no wait makes it exist (review 29 #7: the send waited
                # max_block_ms, and the name stayed in every refresh for good).
                self.metadata.forget_topic(topic)
                raise error_for(info.error_code, info.error_message or f"topic {topic!r}")
            if time.monotonic() + self.config.retry_backoff_s > deadline:
                reason = info.error_message if info is not None else "not in metadata"
                code = info.error_code if info is not None else ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
                raise error_for(
                    code,
                    f"topic {topic!r} not available after {self.config.max_block_s:g}s: {reason}",
                )
            await asyncio.sleep(self.config.retry_backoff_s)
        return info.num_partitions

    async def _wait_for_memory(self, size: int, deadline: float) -> None:
        while self._used_memory + size > self.config.buffer_memory:
            self._memory_freed.clear()
            remaining = deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(remaining, 0)):
                    await self._memory_freed.wait()
            except TimeoutError:
                raise BufferExhausted(
                    f"buffer_memory ({self.config.buffer_memory} bytes) stayed full for "
                    f"max_block_ms ({self.config.max_block_s * 1000:g} ms)"
                ) from None

    def _release(self, batch: ProducerBatch) -> None:
        assert self._accumulator is not None
        if batch not in self._accumulator.incomplete:
            return  # released when it expired in flight
        self._accumulator.incomplete.discard(batch)
        self._used_memory -= batch.size
        self._memory_freed.set()

    async def _first_producer_id(self) -> None:
        """InitProducerId, retried on retriable errors (a controller election right after
        the cluster starts) for up to max_block_ms, as Kafka's producer waits for its id."""
        deadline = time.monotonic() + self.config.max_block_s
        while True:
            self._check_open()
            try:
                return await self._init_producer_id()
            except TidewaterError as e:
                if e.code not in RETRIABLE or time.monotonic() >= deadline:
                    raise
                log.info("no producer id yet, retrying: %s", e)
            await asyncio.sleep(self.config.retry_backoff_s)

    async def _init_producer_id(self) -> None:
        await self._refresh()
        errors = []
        for address in list(self.metadata.brokers.values()):
            stub = broker_pb2_grpc.BrokerServiceStub(self.metadata.channel_for(address))
            try:
                response = await stub.InitProducerId(
                    pb.InitProducerIdRequest(
                        producer_id=NO_PRODUCER_ID, producer_epoch=NO_PRODUCER_EPOCH
                    ),
                    timeout=self.config.request_timeout_s,
                )
            except grpc.aio.AioRpcError as e:
                errors.append(f"{address}: {e.code().name}")
                continue
            if response.error_code != NO_ERROR:
                raise error_for(response.error_code, f"InitProducerId: {response.error_message}")
            self._sequences.set_producer_id(response.producer_id, response.producer_epoch)
            return
        raise error_for(
            ErrorCode.PRODUCER_ID_ALLOCATION_FAILED,
            "no broker gave a producer id (set enable_idempotence=False for brokers "
            f"without InitProducerId): {', '.join(errors) or 'no live broker'}",
        )

    # -- the sender -------------------------------------------------------------------

    async def _run(self) -> None:
        """The sender; an uncaught error (a bug, its own or a link's) stops it and fails the
        producer: its state
        (sequences, batches in flight) may be off, and records queued behind it would wait
        forever. As Kafka's fatal states: every pending and later send() fails, naming it."""
        try:
            await self._send_forever()
        except Exception as e:
            log.exception("uncaught error in the producer's sender: the producer has failed")
            self._sender_error = e
            await self._abort(SenderFailed, f"the producer's sender stopped ({e!r})")

    def _link_failed(self, error: Exception) -> None:
        """A link's uncaught error: the sender raises it, and fails the producer (_run)."""
        self._link_error = error
        self._wake.set()

    async def _send_forever(self) -> None:
        while True:
            if self._link_error is not None:
                raise self._link_error
            self._wake.clear()
            if self.config.idempotent:
                renumbered = self._sequences.settle()
                if renumbered:
                    log.info(
                        "producer %d epoch %d: renumbered %d unacknowledged batch(es) of %s",
                        self._sequences.producer_id,
                        self._sequences.epoch,
                        len(renumbered),
                        sorted({f"{b.tp[0]}-{b.tp[1]}" for b in renumbered}),
                    )
                if self._sequences.needs_producer_id:
                    # Batches still expire while no producer id comes.
                    self._expire(time.monotonic())
                    await self._reinit_producer_id()
                    continue
            wait_s = self._drain(time.monotonic())
            # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancel that
            # races the wake-up, and close() would wait on the sender forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._wake.wait()

    async def _reinit_producer_id(self) -> None:
        """The epoch ran out: a new producer id, retried until one comes (or close())."""
        try:
            await self._init_producer_id()
        except (TidewaterError, MetadataUnavailable) as e:
            log.warning("no new producer id yet: %s", e)
            await asyncio.sleep(self.config.retry_backoff_s)

    def _drain(self, now: float) -> float:
        """Send every ready batch (one per partition per request); returns how long to
        sleep before something may become ready."""
        assert self._accumulator is not None
        config = self.config
        flushing = self._flushing > 0 or self._closed
        wait_s = min(config.request_timeout_s, self._expire(now))
        by_leader: dict[str, list[ProducerBatch]] = {}
        for tp, queue in self._accumulator.queues.items():
            if not queue:
                continue
            head = queue[0]
            if head.attempts:
                ready_at = self._muted_until.get(tp, 0.0)
            elif head.closed or flushing:
                ready_at = now
            else:
                ready_at = head.created + config.linger_s
            if ready_at > now:
                wait_s = min(wait_s, ready_at - now)
                continue
            in_flight = len(self._in_flight.get(tp, ()))
            # A retry goes alone so the batches behind it cannot overtake it.
            if in_flight >= config.max_in_flight or (head.attempts and in_flight):
                continue
            if config.idempotent and not self._sequences.may_send(head):
                continue
            leader = self.metadata.leader(tp)
            if leader is None:
                self.metadata.request_refresh()
                wait_s = min(wait_s, config.retry_backoff_s)
                continue
            link = self._links.get(leader[1])
            if link is not None and link.full and leader[1] not in by_leader:
                continue  # an answer wakes the sender
            batch = queue.popleft()
            if not batch.attempts:
                self._partitioner.batch_closed(*tp)  # type: ignore[union-attr]
                if batch.trace is not None:
                    batch.trace.drained()
            if config.idempotent:
                self._sequences.sending(batch)
            if batch.data is None:
                batch.build(config.compression, time.time_ns() // 1_000_000)
            batch.attempts += 1
            self._in_flight.setdefault(tp, []).append(batch)
            by_leader.setdefault(leader[1], []).append(batch)
        for address, batches in by_leader.items():
            link = self._links.get(address)
            if link is None:
                link = self._links[address] = _BrokerLink(self, address)
            link.send(batches)
        return wait_s

    def _expire(self, now: float) -> float:
        """Fail the batches past delivery_timeout_ms, queued or in flight; returns how long
        until the next one in flight expires."""
        assert self._accumulator is not None
        for queue in self._accumulator.queues.values():
            while queue and now - queue[0].created > self.config.delivery_timeout_s:
                batch = queue.popleft()
                self._fail(batch, _delivery_timeout(self.config, batch))
        return self._expire_in_flight(now)

    def _expire_in_flight(self, now: float) -> float:
        """Fail the in-flight batches past delivery_timeout_ms now, as Kafka's sender does
        (getExpiredInflightBatches). Their requests may still append them: they stay in flight,
        their sequences unresolved, and their answers settle them (_completed, _retry_or_fail).
        Returns how long until the next one expires."""
        timeout_s = self.config.delivery_timeout_s
        wait_s = timeout_s
        for sending in self._in_flight.values():
            for batch in sending:
                if batch.done.done():
                    continue
                left = batch.created + timeout_s - now
                if left > 0:
                    wait_s = min(wait_s, left)
                    continue
                if self.config.idempotent:
                    self._sequences.expired(batch)
                batch.fail(_delivery_timeout(self.config, batch, "in flight: it may be in the log"))
                self._release(batch)
        return wait_s

    def _completed(self, batch: ProducerBatch, result: pb.PartitionProduceResponse) -> None:
        """Handle a partition's answer for one in-flight batch."""
        tp = batch.tp
        self._in_flight[tp].remove(batch)
        code = result.error_code
        if code == NO_ERROR:
            if self.config.idempotent:
                self._sequences.acknowledged(batch)
            batch.complete(result.base_offset, result.log_append_time_ms)
            self._release(batch)
        elif code == ErrorCode.MESSAGE_TOO_LARGE and batch.record_count > 1:
            self._split(batch)
        elif (
            code in SEQUENCE_REFUSALS
            and self.config.idempotent
            and self._sequences.in_the_log(batch)
        ):
            # A retry its new leader no longer remembers, of a batch a later acknowledged one
            # proves in the log: done, at an offset unknown, as Kafka completes a batch
            # answered DUPLICATE_SEQUENCE_NUMBER. Renumbered, it was written twice.
            self._sequences.acknowledged(batch)
            batch.complete(UNKNOWN_OFFSET, UNKNOWN_OFFSET)
            self._release(batch)
        else:
            if code in REFRESH_METADATA:
                if result.HasField("current_leader"):
                    leader = result.current_leader
                    self.metadata.update_leader(tp, leader.leader_id, leader.leader_epoch)
                self.metadata.request_refresh()
            self._retry_or_fail(batch, code, result.error_message)
        self._wake.set()

    def _split(self, batch: ProducerBatch) -> None:
        """The broker refused `batch` as larger than the topic's max.message.bytes, which the
        producer does not know (a lower value than its batch_size, or records that compressed
        worse than they looked): its records go again in two halves, each split again while
        still too large, down to one record, which fails (Kafka's splitAndReenqueue). The
        halves count from its creation for delivery_timeout_ms, not from a retry, and go
        ahead of every batch after it. They are new batches, not retries: with more than one
        request in flight both may be, and without idempotence the second may land first, as
        with Kafka's producer."""
        assert self._accumulator is not None
        if batch.done.done():  # it expired in flight: its answer only settles its sequence
            if self.config.idempotent:
                self._sequences.failed(batch)
            return
        parts = batch.split()
        if self.config.idempotent:
            self._sequences.split(batch, parts)
        self._release(batch)
        for part in parts:
            self._accumulator.incomplete.add(part)
            self._used_memory += part.size
            self._accumulator.requeue(part)

    def _transport_failed(self, batches: list[ProducerBatch], reason: str) -> None:
        """The request's outcome is unknown: retry (idempotence keeps it exactly-once)."""
        self.metadata.request_refresh()
        for batch in batches:
            self._in_flight[batch.tp].remove(batch)
            self._retry_or_fail(batch, ErrorCode.REQUEST_TIMED_OUT, reason)
        self._wake.set()

    def _retry_or_fail(self, batch: ProducerBatch, code: int, message: str) -> None:
        config = self.config
        now = time.monotonic()
        if config.idempotent:
            retriable = self._sequences.retriable(batch, code, RETRIABLE)
        else:
            retriable = code in RETRIABLE
        if batch.done.done():
            # It expired in flight (_expire_in_flight): its answer only settles its sequence.
            if config.idempotent:
                self._sequences.failed(batch)
        elif not retriable or batch.attempts > config.retries:
            message = _about(batch.tp, message)
            if retriable and code not in REFUSED_BEFORE_APPEND:
                # Retries ran out on an answer that may follow an append: outcome unknown.
                message += "; retries exhausted, the batch may be in the log"
            self._fail(batch, error_for(code, message))
        elif now - batch.created + config.retry_backoff_s > config.delivery_timeout_s:
            batch.last_error = (code, message)
            self._fail(batch, _delivery_timeout(config, batch))
        else:
            batch.last_error = (code, message)
            self._muted_until[batch.tp] = now + config.retry_backoff_s
            self._accumulator.requeue(batch)  # type: ignore[union-attr]

    def _fail(self, batch: ProducerBatch, error: BaseException) -> None:
        if self.config.idempotent:
            self._sequences.failed(batch)
        batch.fail(error)
        self._release(batch)


def _delivery_timeout(
    config: ProducerConfig, batch: ProducerBatch, note: str = ""
) -> DeliveryTimeout:
    """The batch's DeliveryTimeout, with the retriable error it was last answered with."""
    message = _about(
        batch.tp,
        f"not acknowledged within delivery_timeout_ms ({config.delivery_timeout_s * 1000:g} ms)",
    )
    last_error = None
    if batch.last_error is not None:
        code, reason = batch.last_error
        last_error = error_for(code, _about(batch.tp, reason))
        message += f"; last error {last_error.code_name}: {_unnamed(batch.tp, reason)}"
    if note:
        message += f"; {note}"
    return DeliveryTimeout(message, last_error)


def _about(tp: TopicPartition, reason: str) -> str:
    """`reason`, naming the partition once (a broker's message may name it already)."""
    return f"{tp[0]}-{tp[1]}: {_unnamed(tp, reason)}"


def _unnamed(tp: TopicPartition, reason: str) -> str:
    return reason.removeprefix(f"{tp[0]}-{tp[1]}: ")


class _Outbox:
    """A link's requests as the stream reads them. Not an async generator: gRPC closes what
    it reads when the call ends, and closing a generator suspended in its queue's get() raised
    "aclose(): asynchronous generator is already running" (review 37 #5: printed, with a task
    destroyed pending, when a broker was killed under a producer)."""

    def __init__(self, queue: asyncio.Queue[pb.ProduceRequest]) -> None:
        self._queue = queue

    def __aiter__(self) -> _Outbox:
        return self

    async def __anext__(self) -> pb.ProduceRequest:
        return await self._queue.get()


class _BrokerLink:
    """One ProduceStream to one broker: requests go in send order; responses are matched by
    correlation id. A broken or silent stream fails its in-flight requests as retriable."""

    def __init__(self, producer: Producer, address: str) -> None:
        self.producer = producer
        self.address = address
        self._stub = broker_pb2_grpc.BrokerServiceStub(producer.metadata.channel_for(address))
        self._correlation = itertools.count(1)
        self._in_flight: dict[int, tuple[list[ProducerBatch], float]] = {}
        self._outbox: asyncio.Queue[pb.ProduceRequest] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def full(self) -> bool:
        """Whether its stream holds as many requests as a broker reads at once: one more
        would wait unread there, its deadline running (review 24 #7; the per-partition
        max_in_flight_requests_per_connection allows more over many partitions)."""
        return len(self._in_flight) >= MAX_IN_FLIGHT_PER_STREAM

    def send(self, batches: list[ProducerBatch]) -> None:
        config = self.producer.config
        correlation_id = next(self._correlation)
        request = pb.ProduceRequest(
            acks=config.acks,
            timeout_ms=int(config.request_timeout_s * 1000),
            correlation_id=correlation_id,
        )
        for batch in batches:
            # add() and field assignment: passing built messages to a constructor makes upb
            # copy the batch bytes again, slowly for MiB batches.
            data = request.partitions.add(
                topic=batch.tp[0],
                partition=batch.tp[1],
                record_batch=batch.data,
                # A topic created again under its name answers UNKNOWN_TOPIC_ID: retried
                # with new metadata, to the new topic.
                topic_id=self.producer.metadata.topic_id(batch.tp[0]),
            )
            if batch.trace is not None:
                batch.trace.carry(data.trace_context)
        self._in_flight[correlation_id] = (batches, time.monotonic())
        if self._task is None or self._task.done():
            self._outbox = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._stream(self._outbox))
        assert self._outbox is not None
        self._outbox.put_nowait(request)

    async def _stream(self, outbox: asyncio.Queue[pb.ProduceRequest]) -> None:
        # Tracing, it declares the producer's constant as the parent of every batch sampled
        # out, which then carries no context.
        producer = self.producer
        call = self._stub.ProduceStream(
            _Outbox(outbox),
            metadata=producer._new_traces.metadata if producer._tracer is not None else None,
        )
        # A deadline per request: the stream is abandoned when the oldest one is overdue.
        timeout_s = self.producer.config.request_timeout_s + ANSWER_GRACE_S
        reason = "stream closed"
        try:
            while True:
                waiting = [started for _, started in self._in_flight.values()]
                budget = min(waiting) + timeout_s - time.monotonic() if waiting else timeout_s
                try:
                    async with asyncio.timeout(max(budget, 0.001)):
                        response = await call.read()
                except TimeoutError:
                    # The budget may be an idle wait's, and a request sent since not overdue.
                    waiting = [started for _, started in self._in_flight.values()]
                    if waiting and min(waiting) + timeout_s <= time.monotonic():
                        reason = f"no answer from {self.address} within {timeout_s:g}s"
                        break
                    continue
                if response is grpc.aio.EOF:
                    break
                entry = self._in_flight.pop(response.correlation_id, None)
                if entry is None:
                    continue
                results = {(p.topic, p.partition): p for p in response.partitions}
                for batch in entry[0]:
                    self.producer._completed(batch, results[batch.tp])
        except grpc.aio.AioRpcError as e:
            reason = f"{self.address}: {e.code().name} {e.details()}"
        except Exception as e:
            # A bug (or an answer that breaks the protocol): the producer's state may be off,
            # and the batches of the answer at hand would never settle. It fails the producer.
            log.exception("uncaught error in the producer's link to %s", self.address)
            reason = f"the link to {self.address} failed ({e!r})"
            self.producer._link_failed(e)
        finally:
            call.cancel()
            failed = [b for batches, _ in self._in_flight.values() for b in batches]
            self._in_flight.clear()
            if failed:
                self.producer._transport_failed(failed, reason)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
