"""The asyncio consumer of assigned partitions: positions kept client-side, long-poll fetches
from each leader, committed records only (the broker stops at the high watermark).

As in Kafka's consumer, each leader has at most one fetch in flight, and a fetch outlives
the poll that sent it: a poll returns as soon as any leader answered with records, while the
others keep waiting for theirs, to be collected by a later poll."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

import grpc
from opentelemetry.trace import SpanKind, TracerProvider

from tidewater.client.errors import REFRESH_METADATA, error_for
from tidewater.client.metadata import ClusterMetadata, TopicPartition
from tidewater.errors import InvalidConfig, TidewaterError
from tidewater.records.batch import ConsumerRecord, decode_batches
from tidewater.telemetry import tracing
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

__all__ = ["Consumer", "ConsumerRecord"]


class Consumer:
    """`assign()` partitions, optionally `seek*()`, then `poll()` or `async for`."""

    def __init__(
        self,
        bootstrap: Sequence[str],
        *,
        auto_offset_reset: str = "latest",
        fetch_min_bytes: int = 1,
        fetch_max_wait_ms: int = 500,
        fetch_max_bytes: int = 50 * 1024 * 1024,
        request_timeout_ms: int = 30000,
        retry_backoff_ms: int = 100,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        if auto_offset_reset not in ("earliest", "latest"):
            raise InvalidConfig(
                f"auto_offset_reset must be 'earliest' or 'latest', got {auto_offset_reset!r}"
            )
        if fetch_min_bytes < 0 or fetch_max_wait_ms < 0 or fetch_max_bytes < 1:
            raise InvalidConfig("fetch sizes and waits must not be negative")
        self.auto_offset_reset = auto_offset_reset
        self.fetch_min_bytes = fetch_min_bytes
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.fetch_max_bytes = fetch_max_bytes
        self.request_timeout_s = request_timeout_ms / 1000
        self.retry_backoff_s = retry_backoff_ms / 1000
        self.metadata = ClusterMetadata(
            bootstrap,
            request_timeout_s=min(self.request_timeout_s, 10.0),
            retry_backoff_s=self.retry_backoff_s,
        )
        self._positions: dict[TopicPartition, int | None] = {}
        self._high_watermarks: dict[TopicPartition, int] = {}
        self._in_flight: dict[str, _InFlightFetch] = {}  # by leader address
        # A partition's error, raised by the next poll when this one has records to return.
        self._error: TidewaterError | None = None
        self._tracer = tracing.client_tracer(tracer_provider)

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions (replacing any earlier assignment)."""
        wanted = [(topic, int(p)) for topic, p in partitions]
        self._positions = {tp: self._positions.get(tp) for tp in wanted}

    def assignment(self) -> list[TopicPartition]:
        return list(self._positions)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._check_assigned(tp)
        self._positions[tp] = offset

    def position(self, tp: TopicPartition) -> int | None:
        self._check_assigned(tp)
        return self._positions[tp]

    async def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        await self._seek_by_spec(partitions, pb.OFFSET_SPEC_EARLIEST)

    async def seek_to_end(self, *partitions: TopicPartition) -> None:
        await self._seek_by_spec(partitions, pb.OFFSET_SPEC_LATEST)

    async def seek_to_timestamp(self, tp: TopicPartition, timestamp_ms: int) -> None:
        """The first record at or after timestamp_ms; the end of the log when none is."""
        offset = await self._list_offset(tp, pb.OFFSET_SPEC_TIMESTAMP, timestamp_ms)
        if offset < 0:
            offset = await self._list_offset(tp, pb.OFFSET_SPEC_LATEST)
        self._positions[tp] = offset

    def lag(self, tp: TopicPartition) -> int | None:
        """HW - position, as of the last fetch (None before one)."""
        position = self.position(tp)
        high_watermark = self._high_watermarks.get(tp)
        if position is None or high_watermark is None:
            return None
        return max(high_watermark - position, 0)

    async def poll(self, timeout_ms: int = 1000) -> list[ConsumerRecord]:
        """Records of the assigned partitions: those of every fetch answered by now, once one
        brought records or timeout_ms passed (each leader long-polls fetch_max_wait_ms for
        fetch_min_bytes)."""
        fetched = await self.poll_partitions(timeout_ms)
        return [record for records in fetched.values() for record in records]

    async def poll_partitions(
        self, timeout_ms: int = 1000
    ) -> dict[TopicPartition, list[ConsumerRecord]]:
        """poll(), with the records of each partition under its (topic, partition)."""
        if self._tracer is None:
            return await self._poll(timeout_ms)
        # The `poll` span is current while fetching: each Fetch carries it in its metadata.
        with self._tracer.start_as_current_span(
            "poll",
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": tracing.MESSAGING_SYSTEM,
                "messaging.operation.type": "receive",
            },
        ) as span:
            fetched = await self._poll(timeout_ms)
            count = sum(len(records) for records in fetched.values())
            span.set_attribute("messaging.batch.message_count", count)
            return fetched

    async def _poll(self, timeout_ms: int) -> dict[TopicPartition, list[ConsumerRecord]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        fetched: dict[TopicPartition, list[ConsumerRecord]] = {}
        self._raise_error()
        while True:
            await self._reset_missing_positions()
            self._send_fetches()
            if not self._in_flight:
                await asyncio.sleep(min(timeout_ms / 1000, self.retry_backoff_s))
                return fetched
            await asyncio.wait(
                [fetch.answer for fetch in self._in_flight.values()],
                timeout=max(deadline - loop.time(), 0),
                return_when=asyncio.FIRST_COMPLETED,
            )
            failed = False
            for address, fetch in list(self._in_flight.items()):
                if fetch.answer.done():
                    del self._in_flight[address]
                    answer = fetch.answer.result()
                    fetched.update(self._apply(fetch.offsets, answer))
                    failed |= answer is None or any(r.error_code for r in answer.partitions)
            if any(fetched.values()):
                return fetched
            self._raise_error()
            if loop.time() >= deadline:
                return fetched
            if failed:  # before asking again
                await asyncio.sleep(min(deadline - loop.time(), self.retry_backoff_s))

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _send_fetches(self) -> None:
        """A fetch to every leader of assigned partitions that has none in flight."""
        fetching = {tp for fetch in self._in_flight.values() for tp in fetch.offsets}
        by_leader: dict[str, list[tuple[TopicPartition, int]]] = {}
        for tp, position in self._positions.items():
            leader = self.metadata.leader(tp)
            if leader is None or position is None:
                self.metadata.request_refresh()
                continue
            if leader[1] not in self._in_flight and tp not in fetching:
                by_leader.setdefault(leader[1], []).append((tp, leader[2]))
        for address, partitions in by_leader.items():
            self._in_flight[address] = self._send_fetch(address, partitions)

    async def __aiter__(self) -> AsyncIterator[ConsumerRecord]:
        while True:
            for record in await self.poll(self.fetch_max_wait_ms):
                yield record

    async def close(self) -> None:
        answers = [fetch.answer for fetch in self._in_flight.values()]
        self._in_flight.clear()
        for answer in answers:
            answer.cancel()
        await asyncio.gather(*answers, return_exceptions=True)
        await self.metadata.close()

    # -- internals ----------------------------------------------------------------------

    def _check_assigned(self, tp: TopicPartition) -> None:
        if tp not in self._positions:
            raise InvalidConfig(f"{tp[0]}-{tp[1]} is not assigned to this consumer")

    async def _reset_missing_positions(self) -> None:
        missing = [tp for tp, position in self._positions.items() if position is None]
        if missing:
            spec = (
                pb.OFFSET_SPEC_EARLIEST
                if self.auto_offset_reset == "earliest"
                else pb.OFFSET_SPEC_LATEST
            )
            await self._seek_by_spec(missing, spec)

    async def _seek_by_spec(self, partitions: Sequence[TopicPartition], spec: int) -> None:
        for tp in partitions or list(self._positions):
            self._check_assigned(tp)
            self._positions[tp] = await self._list_offset(tp, spec)

    async def _leader(self, tp: TopicPartition) -> tuple[int, str, int]:
        leader = self.metadata.leader(tp)
        if leader is None:
            await self.metadata.refresh([tp[0]])
            leader = self.metadata.leader(tp)
        if leader is None:
            topic = self.metadata.topics.get(tp[0])
            code = (
                topic.error_code if topic and topic.error_code else ErrorCode.LEADER_NOT_AVAILABLE
            )
            raise error_for(code, f"{tp[0]}-{tp[1]}: no leader known")
        return leader

    async def _list_offset(self, tp: TopicPartition, spec: int, timestamp_ms: int = -1) -> int:
        _, address, epoch = await self._leader(tp)
        stub = broker_pb2_grpc.BrokerServiceStub(self.metadata.channel_for(address))
        response = await stub.ListOffsets(
            pb.ListOffsetsRequest(
                replica_id=-1,
                partitions=[
                    pb.ListOffsetsPartition(
                        topic=tp[0],
                        partition=tp[1],
                        current_leader_epoch=epoch,
                        spec=spec,  # type: ignore[arg-type]
                        timestamp_ms=timestamp_ms,
                    )
                ],
            ),
            timeout=self.request_timeout_s,
        )
        result = response.partitions[0]
        if result.error_code != ErrorCode.NONE:
            if result.error_code in REFRESH_METADATA:
                self.metadata.request_refresh()
            raise error_for(result.error_code, f"{tp[0]}-{tp[1]}: {result.error_message}")
        return result.offset

    def _send_fetch(
        self, address: str, partitions: list[tuple[TopicPartition, int]]
    ) -> _InFlightFetch:
        """partitions: (partition, current leader epoch) pairs led by `address`."""
        offsets = {tp: self._positions[tp] or 0 for tp, _ in partitions}
        request = pb.FetchRequest(
            replica_id=-1,
            max_wait_ms=self.fetch_max_wait_ms,
            min_bytes=self.fetch_min_bytes,
            max_bytes=self.fetch_max_bytes,
            partitions=[
                pb.FetchPartition(
                    topic=tp[0],
                    partition=tp[1],
                    fetch_offset=offsets[tp],
                    current_leader_epoch=epoch,
                    last_fetched_epoch=-1,
                    log_start_offset=-1,
                )
                for tp, epoch in partitions
            ],
        )
        return _InFlightFetch(offsets, asyncio.create_task(self._fetch(address, request)))

    async def _fetch(self, address: str, request: pb.FetchRequest) -> pb.FetchResponse | None:
        """The leader's answer; None when the call failed."""
        stub = broker_pb2_grpc.BrokerServiceStub(self.metadata.channel_for(address))
        try:
            return await stub.Fetch(
                request,
                timeout=self.request_timeout_s + request.max_wait_ms / 1000,
                metadata=tracing.current_context_metadata() if self._tracer else None,
            )
        except grpc.aio.AioRpcError:
            # The leader may be gone: look it up again and let the next poll retry.
            self.metadata.request_refresh()
            return None

    def _apply(
        self, offsets: dict[TopicPartition, int], response: pb.FetchResponse | None
    ) -> dict[TopicPartition, list[ConsumerRecord]]:
        """The records of an answer to a fetch from `offsets`, positions moved past them. A
        partition sought elsewhere or unassigned since the fetch was sent gets nothing; a
        partition's error, or a batch of it that cannot be decoded, is kept in `_error`, so
        records of the others are not lost."""
        fetched: dict[TopicPartition, list[ConsumerRecord]] = {}
        for result in response.partitions if response is not None else ():
            tp = (result.topic, result.partition)
            position = self._positions.get(tp)
            if position is None or position != offsets.get(tp):
                continue
            if result.error_code == ErrorCode.OFFSET_OUT_OF_RANGE:
                self._positions[tp] = None
                continue
            if result.error_code != ErrorCode.NONE:
                if result.error_code not in REFRESH_METADATA:
                    message = f"{tp[0]}-{tp[1]}: {result.error_message}"
                    self._error = self._error or error_for(result.error_code, message)
                    continue
                if result.HasField("current_leader"):
                    leader = result.current_leader
                    self.metadata.update_leader(tp, leader.leader_id, leader.leader_epoch)
                self.metadata.request_refresh()
                continue
            self._high_watermarks[tp] = result.high_watermark
            records = fetched[tp] = []
            try:
                for record in decode_batches(result.record_batches):
                    # A batch may start before the position asked for.
                    if record.offset >= position:
                        records.append(record)
                        position = record.offset + 1
            except TidewaterError as e:
                # This partition stops before the batch that cannot be read (as Kafka's
                # consumer: the next poll raises, and again until the application seeks
                # past it); the other partitions' records are still handed over.
                message = f"{tp[0]}-{tp[1]} at offset {position}: {e.message}"
                self._error = self._error or type(e)(message, e.code)
            self._positions[tp] = position
        return fetched


@dataclass(frozen=True)
class _InFlightFetch:
    offsets: dict[TopicPartition, int]  # the fetch offset asked for, per partition
    answer: asyncio.Task[pb.FetchResponse | None]
