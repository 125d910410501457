"""The asyncio consumer of assigned partitions: positions kept client-side, long-poll fetches
from each leader, committed records only (the broker stops at the high watermark).

As in Kafka's consumer, each leader has at most one fetch in flight, and a fetch outlives
the poll that sent it: a poll returns as soon as any leader answered with records, while the
others keep waiting for theirs, to be collected by a later poll.

Positions carry the leader epoch of the record before them (KIP-320, see positions.py): after
a leader change the new leader confirms a position with OffsetForLeaderEpoch before the
partition is fetched again, so a log truncated under the consumer is detected."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, NamedTuple, TypeVar

import grpc
from opentelemetry.trace import SpanKind, TracerProvider

from tidewater.client.errors import (
    REFRESH_METADATA,
    ConsumerClosed,
    NoOffsetForPartition,
    error_for,
)
from tidewater.client.metadata import ClusterMetadata, TopicPartition
from tidewater.client.positions import (
    RESET_POLICIES,
    FetchPosition,
    LeaderAndEpoch,
    for_current_leader,
    validated,
)
from tidewater.errors import (
    NO_ERROR,
    RETRIABLE,
    InvalidConfig,
    OffsetOutOfRange,
    TidewaterError,
)
from tidewater.records.batch import ConsumerRecord, decode_batches
from tidewater.telemetry import tracing
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

__all__ = ["Consumer", "ConsumerRecord"]

log = logging.getLogger(__name__)


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
        max_partition_fetch_bytes: int = 1024 * 1024,
        max_poll_records: int = 500,
        request_timeout_ms: int = 30000,
        retry_backoff_ms: int = 100,
        metadata_max_age_ms: int = 300_000,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        if auto_offset_reset not in RESET_POLICIES:
            raise InvalidConfig(
                "auto_offset_reset must be 'earliest', 'latest' or 'none', "
                f"got {auto_offset_reset!r}"
            )
        if fetch_min_bytes < 0 or fetch_max_wait_ms < 0 or fetch_max_bytes < 1:
            raise InvalidConfig("fetch sizes and waits must not be negative")
        if max_partition_fetch_bytes < 1:
            raise InvalidConfig(
                f"max_partition_fetch_bytes must be >= 1, got {max_partition_fetch_bytes}"
            )
        if max_poll_records < 1:
            raise InvalidConfig(f"max_poll_records must be >= 1, got {max_poll_records}")
        if metadata_max_age_ms < 0:
            raise InvalidConfig(f"metadata_max_age_ms must be >= 0, got {metadata_max_age_ms}")
        self.auto_offset_reset = auto_offset_reset
        self.fetch_min_bytes = fetch_min_bytes
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.fetch_max_bytes = fetch_max_bytes
        # Each partition's share of a fetch (Kafka's max.partition.fetch.bytes; at least one
        # batch whatever its size), so one with a backlog does not take a leader's whole
        # fetch_max_bytes from the others (review 26 M1).
        self.max_partition_fetch_bytes = max_partition_fetch_bytes
        self.max_poll_records = max_poll_records
        self.request_timeout_s = request_timeout_ms / 1000
        self.retry_backoff_s = retry_backoff_ms / 1000
        self.metadata = ClusterMetadata(
            bootstrap,
            request_timeout_s=min(self.request_timeout_s, 10.0),
            retry_backoff_s=self.retry_backoff_s,
            max_age_s=metadata_max_age_ms / 1000,
        )
        self._positions: dict[TopicPartition, FetchPosition | None] = {}
        self._closed = False
        # The generation of each position: a number of its own at every change, by the
        # application or the consumer. An answer to a request is applied to a partition only
        # while the generation it was sent under holds (Kafka's consumer checks that the
        # position is still the one asked about): a reset sent before a seek() and answered
        # after it is not, even once the sought position is lost again (out of range).
        self._generations: dict[TopicPartition, int] = {}
        self._changes = itertools.count()
        # The application's latest positioning call (seek() or seek_to_*()) per partition: a
        # seek_to_*()'s answer is applied only while its call is still the latest, as in
        # Kafka the last positioning call wins.
        self._sought: dict[TopicPartition, int] = {}
        # KIP-320: partitions whose leader changed under a position with an epoch, not
        # fetched until the new leader confirmed or corrected the position.
        self._awaiting_validation: set[TopicPartition] = set()
        # Positions found out of range, by partition, for the warning of their reset.
        self._out_of_range: dict[TopicPartition, int] = {}
        self._high_watermarks: dict[TopicPartition, int] = {}
        # Records fetched and not yet handed out, from each partition's position on (Kafka's
        # completed fetches): a poll returns at most max_poll_records, and the position moves
        # only past those it returns. A partition with some is not fetched again; any other
        # change of its position drops them (_move).
        self._buffered: dict[TopicPartition, list[ConsumerRecord]] = {}
        # The topic id each position was taken under: a topic deleted and created again
        # under its name (a new id) has another log, where the position means nothing.
        self._topic_ids: dict[TopicPartition, bytes] = {}
        # Requests sent one per leader, each outliving the poll that sent it, as Kafka's
        # consumer sends them: resets by auto_offset_reset (ListOffsets), KIP-320 validations
        # (OffsetForLeaderEpoch) and fetches. A leader that does not answer holds up its own
        # partitions, not poll() nor the records of other leaders.
        self._resetting = _PerLeader(self._send_reset, self._apply_reset, self._generation)
        self._validating = _PerLeader(
            self._send_validation, self._apply_validation, self._generation
        )
        self._fetching = _PerLeader(self._send_fetch, self._apply, self._generation)
        # Partitions whose reset or validation failed, not asked again before this loop time
        # (Kafka's SubscriptionState.requestFailed: retry_backoff_ms).
        self._retry_at: dict[TopicPartition, float] = {}
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
        # A partition assigned again has a new generation: no answer sent before counts.
        self._generations = {
            tp: self._generations[tp] if tp in self._positions else next(self._changes)
            for tp in wanted
        }
        self._positions = {tp: self._positions.get(tp) for tp in wanted}
        self._awaiting_validation &= set(wanted)
        self._out_of_range = {tp: o for tp, o in self._out_of_range.items() if tp in wanted}
        self._topic_ids = {tp: i for tp, i in self._topic_ids.items() if tp in wanted}
        self._retry_at = {tp: t for tp, t in self._retry_at.items() if tp in wanted}
        self._sought = {tp: call for tp, call in self._sought.items() if tp in wanted}
        self._buffered = {tp: b for tp, b in self._buffered.items() if tp in self._positions}
        # An unassigned partition's HW is no longer followed: lag() knows none until a fetch.
        self._high_watermarks = {
            tp: hw for tp, hw in self._high_watermarks.items() if tp in self._positions
        }
        self.metadata.add_topics(topic for topic, _ in wanted)

    def assignment(self) -> list[TopicPartition]:
        return list(self._positions)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read from `offset` next; with no epoch known, the position is not validated
        after a leader change (as Kafka's seek(offset))."""
        self._seek_started(tp)
        self._set_position(tp, FetchPosition(offset))

    def position(self, tp: TopicPartition) -> int | None:
        self._check_assigned(tp)
        position = self._positions[tp]
        return None if position is None else position.offset

    async def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        await self._seek_by_spec(partitions, pb.OFFSET_SPEC_EARLIEST)

    async def seek_to_end(self, *partitions: TopicPartition) -> None:
        await self._seek_by_spec(partitions, pb.OFFSET_SPEC_LATEST)

    async def seek_to_timestamp(self, tp: TopicPartition, timestamp_ms: int) -> None:
        """The first record at or after timestamp_ms; the end of the log when none is."""
        self._check_open()
        call = self._seek_started(tp)
        found = await self._list_offset(tp, pb.OFFSET_SPEC_TIMESTAMP, timestamp_ms)
        if found[0].offset < 0:
            found = await self._list_offset(tp, pb.OFFSET_SPEC_LATEST)
        self._seek_found(tp, call, *found)

    def lag(self, tp: TopicPartition) -> int | None:
        """HW - position, as of the last fetch (None before one)."""
        position = self.position(tp)
        high_watermark = self._high_watermarks.get(tp)
        if position is None or high_watermark is None:
            return None
        return max(high_watermark - position, 0)

    async def poll(self, timeout_ms: int = 1000) -> list[ConsumerRecord]:
        """Records of the assigned partitions, at most max_poll_records: those of every fetch
        answered by now, once one brought records or timeout_ms passed (each leader
        long-polls fetch_max_wait_ms for fetch_min_bytes). Records fetched beyond that are
        returned by the next polls, which do not wait for them."""
        fetched = await self.poll_partitions(timeout_ms)
        return [record for records in fetched.values() for record in records]

    async def poll_partitions(
        self, timeout_ms: int = 1000
    ) -> dict[TopicPartition, list[ConsumerRecord]]:
        """poll(), with the records of each partition under its (topic, partition)."""
        self._check_open()
        if self._tracer is None:
            return await self._poll(timeout_ms)
        # The `poll` span is current while fetching: each Fetch carries it in its metadata.
        with self._tracer.start_as_current_span(
            "poll",
            kind=SpanKind.CONSUMER,
            attributes=tracing.operation_attributes("poll"),
        ) as span:
            fetched = await self._poll(timeout_ms)
            count = sum(len(records) for records in fetched.values())
            span.set_attribute("messaging.batch.message_count", count)
            return fetched

    async def _poll(self, timeout_ms: int) -> dict[TopicPartition, list[ConsumerRecord]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        kinds = (self._resetting, self._validating, self._fetching)
        while True:
            # close() from another task ends a poll waiting on its requests, the metadata or
            # a backoff (review 26 M2: it sent new requests, on channels it opened again).
            self._check_open()
            # Records fetched before are returned at once; the fetches sent for the other
            # partitions bring theirs meanwhile (as Kafka's pipelined fetches).
            fetched = self._hand_out()
            if fetched:
                self._send_requests()
                return fetched
            # A partition's error, once the records fetched before it are handed out, and
            # before a request that would only meet it again (review 33 #8).
            self._raise_error()
            self._send_requests()
            pending = [call.answer for kind in kinds for call in kind.in_flight.values()]
            if not pending:
                # Nothing to wait for yet: leaders unknown (the metadata on its way) or every
                # request backing off. Wait for the refresh, or the backoff, and ask again;
                # only the deadline ends a poll without records (before, the first poll after
                # assign() returned nothing after retry_backoff_ms).
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return fetched
                await self.metadata.refreshed(min(remaining, self.retry_backoff_s))
                continue
            # A refresh under way wakes it too: a partition whose leader moved is asked of
            # the new one at once, not once the old one answers (review 26 L4).
            refreshing = self.metadata.refreshing
            await asyncio.wait(
                pending if refreshing is None else [*pending, refreshing],
                timeout=max(deadline - loop.time(), 0),
                return_when=asyncio.FIRST_COMPLETED,
            )
            failed = False
            for kind in kinds:
                for sent, answer in kind.answered():
                    kind.apply(sent, answer)
                    failed |= answer is None or any(r.error_code for r in answer.partitions)
            fetched = self._hand_out()
            if fetched:
                return fetched
            self._raise_error()
            if loop.time() >= deadline:
                return fetched
            if failed:  # before asking again
                await asyncio.sleep(min(deadline - loop.time(), self.retry_backoff_s))

    def _hand_out(self) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Up to max_poll_records of the buffered records, partition by partition, each
        partition's position moved past those it gives."""
        handed: dict[TopicPartition, list[ConsumerRecord]] = {}
        room = self.max_poll_records
        for tp in list(self._buffered):
            if room == 0:
                break
            if tp in self._awaiting_validation:  # its leader changed: fetched again
                del self._buffered[tp]
                continue
            records = self._buffered[tp]
            handed[tp], rest = records[:room], records[room:]
            room -= len(handed[tp])
            last = handed[tp][-1]
            position = self._positions[tp]
            assert position is not None  # any other change of it dropped the buffer (_move)
            self._move(
                tp, FetchPosition(last.offset + 1, last.leader_epoch, position.current_leader)
            )
            if rest:
                self._buffered[tp] = rest
            else:
                # Last in the next fetches (Kafka's movePartitionToEnd): the broker fills a
                # fetch in request order, and the first partitions would take it every time.
                self._positions[tp] = self._positions.pop(tp)
        return handed

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _send_requests(self) -> None:
        """To every leader of assigned partitions: a reset of those without a position, a
        validation of those awaiting one, and a fetch of the others, each kind one request
        per leader, sent only to leaders with none of its kind in flight."""
        leaders = self._follow_leaders()
        missing = [tp for tp, position in self._positions.items() if position is None]
        if missing and self.auto_offset_reset == "none":
            names = ", ".join(f"{topic}-{p}" for topic, p in missing)
            raise NoOffsetForPartition(f"no position and auto_offset_reset 'none' for {names}")
        now = asyncio.get_running_loop().time()
        due = [tp for tp in leaders if self._retry_at.get(tp, now) <= now]
        self._resetting.send(leaders, [tp for tp in due if self._positions[tp] is None])
        self._validating.send(leaders, [tp for tp in due if tp in self._awaiting_validation])
        self._fetching.send(
            leaders,
            [
                tp
                for tp in leaders
                if self._positions[tp] is not None
                and tp not in self._awaiting_validation
                and tp not in self._buffered
            ],
        )

    def _follow_leaders(self) -> dict[TopicPartition, str]:
        """The address of each assigned partition's leader, where it is known, positions
        moved to it (and due for validation if the leader changed under an epoch)."""
        leaders = {}
        for tp in self._positions:
            self._check_topic_id(tp)
            leader = self.metadata.leader(tp)
            if leader is None:
                self.metadata.request_refresh()
                continue
            position = self._positions[tp]
            if position is not None:
                moved, validate = for_current_leader(position, (leader[0], leader[2]))
                if moved != position:
                    self._move(tp, moved)
                if validate:
                    self._awaiting_validation.add(tp)
            leaders[tp] = leader[1]
        return leaders

    def _check_topic_id(self, tp: TopicPartition) -> None:
        """A position taken under another id of its topic is dropped, for the next poll to
        reset it by auto_offset_reset (or raise with 'none'), as Kafka's consumer does."""
        topic = self.metadata.topics.get(tp[0])
        topic_id = topic.topic_id if topic is not None else b""
        if not topic_id:
            return
        held = self._topic_ids.setdefault(tp, topic_id)
        if held == topic_id:
            return
        position = self._positions[tp]
        if position is not None:
            log.warning(
                "%s-%d: the topic was deleted and created again (new topic id): fetch "
                "position %d dropped, reset by auto_offset_reset (%s)",
                *tp,
                position.offset,
                self.auto_offset_reset,
            )
            self._set_position(tp, None)
        self._topic_ids[tp] = topic_id
        # The old topic's: lag() knows none for the new one until a fetch (review 26 L3).
        self._high_watermarks.pop(tp, None)

    async def __aiter__(self) -> AsyncIterator[ConsumerRecord]:
        while True:
            for record in await self.poll(self.fetch_max_wait_ms):
                yield record

    async def close(self) -> None:
        self._closed = True
        answers = []
        for kind in (self._resetting, self._validating, self._fetching):
            answers += [call.answer for call in kind.in_flight.values()]
            kind.in_flight.clear()
        for answer in answers:
            answer.cancel()
        await asyncio.gather(*answers, return_exceptions=True)
        await self.metadata.close()

    # -- internals ----------------------------------------------------------------------

    def _check_open(self) -> None:
        # Its channels are closed: a fetch would open new ones that nothing closes.
        if self._closed:
            raise ConsumerClosed("the consumer is closed")

    def _check_assigned(self, tp: TopicPartition) -> None:
        if tp not in self._positions:
            raise InvalidConfig(f"{tp[0]}-{tp[1]} is not assigned to this consumer")

    def _positions_of(
        self, partitions: list[TopicPartition]
    ) -> dict[TopicPartition, FetchPosition]:
        """The positions of partitions that have one (all those validated or fetched)."""
        return {tp: p for tp in partitions if (p := self._positions[tp]) is not None}

    def _generation(self, tp: TopicPartition) -> int | None:
        """That of the partition's position; None once it is no longer assigned."""
        return self._generations.get(tp)

    def _move(self, tp: TopicPartition, position: FetchPosition | None) -> None:
        """Every change of a position, under a new generation: answers to requests sent
        before it are stale, and records buffered from the old position are dropped."""
        self._positions[tp] = position
        self._generations[tp] = next(self._changes)
        self._buffered.pop(tp, None)

    def _set_position(
        self, tp: TopicPartition, position: FetchPosition | None, topic_id: bytes = b""
    ) -> None:
        """Taken under `topic_id`, the one its ListOffsets named, whatever the metadata says
        later; without one (seek(), a position dropped), under the id the metadata holds
        when it is first followed."""
        self._move(tp, position)
        self._awaiting_validation.discard(tp)
        self._out_of_range.pop(tp, None)
        if topic_id:
            self._topic_ids[tp] = topic_id
        else:
            self._topic_ids.pop(tp, None)
        self._retry_at.pop(tp, None)

    async def _seek_by_spec(self, partitions: Sequence[TopicPartition], spec: int) -> None:
        self._check_open()
        targets = list(partitions or self._positions)
        # Every partition is claimed at once, so a seek made while one is asked wins. Those
        # the call does not get to (it failed first) go back to the seek_to_*() in flight for
        # them before it, whose answer would otherwise be dropped.
        earlier = {tp: self._sought.get(tp) for tp in targets}
        calls: dict[TopicPartition, int] = {}
        try:
            for tp in targets:
                calls[tp] = self._seek_started(tp)
            for tp, call in calls.items():
                self._seek_found(tp, call, *await self._list_offset(tp, spec))
                del earlier[tp]
        finally:
            for tp, token in earlier.items():
                if tp in calls and self._sought.get(tp) == calls[tp]:
                    if token is None:
                        del self._sought[tp]
                    else:
                        self._sought[tp] = token

    def _seek_started(self, tp: TopicPartition) -> int:
        """A positioning call by the application: the latest of the partition from now."""
        self._check_assigned(tp)
        call = self._sought[tp] = next(self._changes)
        return call

    def _seek_found(
        self, tp: TopicPartition, call: int, position: FetchPosition, topic_id: bytes
    ) -> None:
        """The answer of a seek_to_*() call, dropped when a later seek*() (or assign()) came
        while it was asked."""
        if self._sought.get(tp) == call:
            self._set_position(tp, position, topic_id)

    def _send_reset(
        self, address: str, partitions: list[TopicPartition]
    ) -> _InFlight[_Reset, pb.ListOffsetsResponse]:
        """A ListOffsets by auto_offset_reset of partitions without a position, led from
        `address`; a later poll applies the answer (_apply_reset)."""
        spec = (
            pb.OFFSET_SPEC_EARLIEST
            if self.auto_offset_reset == "earliest"
            else pb.OFFSET_SPEC_LATEST
        )
        sent = {}
        for tp in partitions:
            leader = self.metadata.leader(tp)
            assert leader is not None  # _follow_leaders found it
            sent[tp] = _Reset((leader[0], leader[2]), self._topic_ids.get(tp, b""))
        request = _list_offsets_request(sent, spec)
        return self._ask(
            address, sent, lambda stub: stub.ListOffsets(request, timeout=self.request_timeout_s)
        )

    def _apply_reset(
        self, sent: dict[TopicPartition, _Reset], response: pb.ListOffsetsResponse | None
    ) -> None:
        """The positions found by a reset's answer (logged when one was out of range)."""
        if response is None:
            self._retry_later(sent)
        for result in response.partitions if response is not None else ():
            tp = (result.topic, result.partition)
            if tp not in sent:  # its position changed meanwhile (_PerLeader.answered)
                continue
            # The topic's id changed since (created again): that offset is the old topic's.
            if self.metadata.topic_id(tp[0]) != sent[tp].topic_id:
                continue
            if result.error_code != NO_ERROR:
                self._failed(tp, result.error_code, result.error_message)
                continue
            out_of_range = self._out_of_range.get(tp)
            self._set_position(
                tp,
                FetchPosition(result.offset, result.leader_epoch, sent[tp].leader),
                sent[tp].topic_id,
            )
            if out_of_range is not None:
                log.warning(
                    "%s-%d: fetch position %d out of range, reset (%s) to offset %d",
                    *tp,
                    out_of_range,
                    self.auto_offset_reset,
                    result.offset,
                )

    def _send_validation(
        self, address: str, partitions: list[TopicPartition]
    ) -> _InFlight[FetchPosition, pb.OffsetForLeaderEpochResponse]:
        """KIP-320: an OffsetForLeaderEpoch of partitions awaiting validation, led from
        `address`; a later poll applies the answer (_apply_validation)."""
        sent = self._positions_of(partitions)
        request = pb.OffsetForLeaderEpochRequest(
            replica_id=-1,
            partitions=[
                pb.OffsetForLeaderEpochPartition(
                    topic=topic,
                    partition=partition,
                    current_leader_epoch=position.current_leader_epoch,
                    leader_epoch=position.offset_epoch,
                    topic_id=self._topic_ids.get((topic, partition), b""),
                )
                for (topic, partition), position in sent.items()
            ],
        )
        return self._ask(
            address,
            sent,
            lambda stub: stub.OffsetForLeaderEpoch(request, timeout=self.request_timeout_s),
        )

    def _ask(
        self,
        address: str,
        sent: dict[TopicPartition, _Sent],
        call: Callable[[broker_pb2_grpc.BrokerServiceStub], Awaitable[_Answer]],
    ) -> _InFlight[_Sent, _Answer]:
        """`call` to the leader at `address` about `sent`, under way in a task."""
        return _InFlight(sent, asyncio.create_task(self._answer(address, call)))

    async def _answer(
        self,
        address: str,
        call: Callable[[broker_pb2_grpc.BrokerServiceStub], Awaitable[_Answer]],
    ) -> _Answer | None:
        """The leader's answer; None when the call failed."""
        try:
            return await call(self._stub(address))
        except grpc.aio.AioRpcError:
            # The leader may be gone: the next poll asks the one the metadata names then.
            self.metadata.request_refresh()
            return None

    def _retry_later(self, partitions: Iterable[TopicPartition]) -> None:
        """Their reset or validation failed: asked again after retry_backoff_ms."""
        retry_at = asyncio.get_running_loop().time() + self.retry_backoff_s
        for tp in partitions:
            self._retry_at[tp] = retry_at

    def _failed(self, tp: TopicPartition, code: int, reason: str) -> None:
        """A partition's reset or validation answered with an error: retried after
        retry_backoff_ms, with new metadata when it says the leader moved; an error that is
        not retriable is raised by the next poll too (as Kafka's cached reset and validation
        exceptions)."""
        self._retry_later([tp])
        if code in REFRESH_METADATA:
            self.metadata.request_refresh()
        elif code not in RETRIABLE:  # OFFSET_NOT_AVAILABLE from a new leader: asked again
            self._keep_error(tp, code, reason)

    def _apply_validation(
        self,
        sent: dict[TopicPartition, FetchPosition],
        response: pb.OffsetForLeaderEpochResponse | None,
    ) -> None:
        """The positions `sent` confirmed or corrected by the leader's answer."""
        if response is None:
            self._retry_later(sent)
        for result in response.partitions if response is not None else ():
            tp = (result.topic, result.partition)
            position = sent.get(tp)
            if position is None:  # its position changed meanwhile (_PerLeader.answered)
                continue
            if result.error_code != NO_ERROR:
                self._failed(tp, result.error_code, result.error_message)
                continue
            try:
                found = validated(
                    tp, position, result.leader_epoch, result.end_offset, self.auto_offset_reset
                )
            except TidewaterError as e:
                # Still awaiting validation: every poll raises it until a seek().
                self._error = self._error or e
                continue
            if found is None:
                self._out_of_range[tp] = position.offset
            elif found.offset != position.offset:
                log.warning(
                    "%s-%d: log truncation detected at fetch position %d (epoch %d): the "
                    "leader's log diverges from offset %d, reading on from there",
                    *tp,
                    position.offset,
                    position.offset_epoch,
                    found.offset,
                )
            self._awaiting_validation.discard(tp)
            self._move(tp, found)

    def _keep_error(self, tp: TopicPartition, code: int, reason: str) -> None:
        """A partition's error, for the next poll to raise (the first one kept wins)."""
        self._error = self._error or error_for(code, f"{tp[0]}-{tp[1]}: {reason}")

    def _stub(self, address: str) -> broker_pb2_grpc.BrokerServiceStub:
        return broker_pb2_grpc.BrokerServiceStub(self.metadata.channel_for(address))

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

    async def _list_offset(
        self, tp: TopicPartition, spec: int, timestamp_ms: int = -1
    ) -> tuple[FetchPosition, bytes]:
        """The offset found, with the leader epoch of its batch (validated after a leader
        change, as Kafka's reset positions are), and the topic id it was asked under. A
        retriable error is asked again after retry_backoff_ms, within request_timeout_ms."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        while True:
            leader_id, address, epoch = await self._leader(tp)
            topic_id = self.metadata.topic_id(tp[0])
            request = _list_offsets_request(
                {tp: _Reset((leader_id, epoch), topic_id)}, spec, timestamp_ms
            )
            response = await self._stub(address).ListOffsets(
                request, timeout=self.request_timeout_s
            )
            result = response.partitions[0]
            if result.error_code == NO_ERROR:
                found = FetchPosition(result.offset, result.leader_epoch, (leader_id, epoch))
                return found, topic_id
            if result.error_code in REFRESH_METADATA:
                self.metadata.request_refresh()
            if result.error_code not in RETRIABLE or loop.time() + self.retry_backoff_s > deadline:
                raise error_for(result.error_code, f"{tp[0]}-{tp[1]}: {result.error_message}")
            await asyncio.sleep(self.retry_backoff_s)

    def _send_fetch(
        self, address: str, partitions: list[TopicPartition]
    ) -> _InFlight[FetchPosition, pb.FetchResponse]:
        """A fetch of `partitions`, whose positions have moved to their leader at `address`."""
        positions = self._positions_of(partitions)
        request = pb.FetchRequest(
            replica_id=-1,
            max_wait_ms=self.fetch_max_wait_ms,
            min_bytes=self.fetch_min_bytes,
            max_bytes=self.fetch_max_bytes,
            partitions=[
                pb.FetchPartition(
                    topic=tp[0],
                    partition=tp[1],
                    fetch_offset=position.offset,
                    current_leader_epoch=position.current_leader_epoch,
                    # The broker checks it for followers only (the consumer validates
                    # positions with OffsetForLeaderEpoch instead).
                    last_fetched_epoch=-1,
                    log_start_offset=-1,
                    partition_max_bytes=self.max_partition_fetch_bytes,
                    # The id the position was taken under: a broker holding another topic of
                    # this name answers UNKNOWN_TOPIC_ID, never the other topic's records.
                    topic_id=self._topic_ids.get(tp, b""),
                )
                for tp, position in positions.items()
            ],
        )
        # The poll span is current here: the fetch carries it in its metadata.
        metadata = tracing.current_context_metadata() if self._tracer else None
        return self._ask(
            address,
            positions,
            lambda stub: stub.Fetch(
                request,
                timeout=self.request_timeout_s + request.max_wait_ms / 1000,
                metadata=metadata,
            ),
        )

    def _apply(
        self, sent: dict[TopicPartition, FetchPosition], response: pb.FetchResponse | None
    ) -> None:
        """The records of an answer to a fetch from the positions `sent`, buffered for
        polls to hand out. A partition sought elsewhere, unassigned, or moved to another
        leader since the fetch was sent gets nothing; a partition's error, or a batch of it
        that cannot be decoded, is kept in `_error`, so records of the others are not lost."""
        for result in response.partitions if response is not None else ():
            tp = (result.topic, result.partition)
            position = sent.get(tp)
            if position is None:  # its position changed meanwhile (_PerLeader.answered)
                continue
            if result.error_code == ErrorCode.OFFSET_OUT_OF_RANGE:
                self._fetch_out_of_range(tp, position.offset, result.error_message)
                continue
            if result.error_code != NO_ERROR:
                if result.error_code not in REFRESH_METADATA:
                    self._keep_error(tp, result.error_code, result.error_message)
                    continue
                if result.HasField("current_leader"):
                    leader = result.current_leader
                    self.metadata.update_leader(tp, leader.leader_id, leader.leader_epoch)
                self.metadata.request_refresh()
                continue
            self._high_watermarks[tp] = result.high_watermark
            records: list[ConsumerRecord] = []
            offset = position.offset
            try:
                for record in decode_batches(result.record_batches):
                    # A batch may start before the position asked for.
                    if record.offset >= offset:
                        records.append(record)
                        offset = record.offset + 1
            except TidewaterError as e:
                # This partition stops before the batch that cannot be read (as Kafka's
                # consumer: the next poll raises, and again until the application seeks
                # past it); the other partitions' records are still handed over.
                message = f"{tp[0]}-{tp[1]} at offset {offset}: {e.message}"
                self._error = self._error or type(e)(message, e.code)
            if records:
                self._buffered[tp] = records

    def _fetch_out_of_range(self, tp: TopicPartition, offset: int, reason: str) -> None:
        """Reset by auto_offset_reset at the next poll (which logs it), or raised with 'none'
        (the position stays: every poll raises it until a seek())."""
        if self.auto_offset_reset == "none":
            message = f"{tp[0]}-{tp[1]}: fetch position {offset} is out of range: {reason}"
            self._error = self._error or OffsetOutOfRange(message)
            return
        self._move(tp, None)
        self._out_of_range[tp] = offset


_Sent = TypeVar("_Sent")
_Answer = TypeVar(
    "_Answer", pb.ListOffsetsResponse, pb.OffsetForLeaderEpochResponse, pb.FetchResponse
)


@dataclass(frozen=True)
class _InFlight(Generic[_Sent, _Answer]):
    """A request sent to a leader about the partitions of `sent` (what it said of each): its
    answer is None when the call failed. `generations`: those of the partitions' positions
    when it was sent (recorded by _PerLeader.send)."""

    sent: dict[TopicPartition, _Sent]
    answer: asyncio.Task[_Answer | None]
    generations: dict[TopicPartition, int | None] = field(default_factory=dict)


@dataclass
class _PerLeader(Generic[_Sent, _Answer]):
    """One kind of request: at most one in flight per leader, a partition in one at a time."""

    make: Callable[[str, list[TopicPartition]], _InFlight[_Sent, _Answer]]
    # What a poll does with an answer (a fetch's records are buffered for it to hand out).
    apply: Callable[[dict[TopicPartition, _Sent], _Answer | None], None]
    # The generation of a partition's position now (Consumer._generation).
    generation: Callable[[TopicPartition], int | None]
    in_flight: dict[str, _InFlight[_Sent, _Answer]] = field(default_factory=dict)  # by leader

    def send(self, leaders: dict[TopicPartition, str], partitions: list[TopicPartition]) -> None:
        """One request to each leader of `partitions` (`leaders`: their addresses) that has
        none in flight, of those not in one already. A request whose answer is stale for a
        partition (its position moved since: to a new leader, say) does not hold it: its new
        leader gets it at once, where before it waited for the old one's answer, up to
        request_timeout_ms when that host went silent (review 26 L4); the stale answer is
        left out for it (answered())."""
        busy = {
            tp
            for call in self.in_flight.values()
            for tp in call.sent
            if call.generations.get(tp) == self.generation(tp)
        }
        by_leader: dict[str, list[TopicPartition]] = {}
        for tp in partitions:
            address = leaders[tp]
            if address not in self.in_flight and tp not in busy:
                by_leader.setdefault(address, []).append(tp)
        for address, sending in by_leader.items():
            call = self.make(address, sending)
            generations = {tp: self.generation(tp) for tp in call.sent}
            self.in_flight[address] = replace(call, generations=generations)

    def answered(
        self,
    ) -> Iterator[tuple[dict[TopicPartition, _Sent], _Answer | None]]:
        """The answers come in, taken out of flight one at a time, each with what was sent
        of the partitions whose position is still of the generation it was sent under: any
        other (sought, reset, moved, or unassigned meanwhile) is left out of `sent`, and the
        answer about it is stale."""
        for address, call in list(self.in_flight.items()):
            if call.answer.done():
                del self.in_flight[address]
                current = {
                    tp: sent
                    for tp, sent in call.sent.items()
                    if self.generation(tp) == call.generations[tp]
                }
                yield current, call.answer.result()


class _Reset(NamedTuple):
    """A partition's ListOffsets: the leader asked, and the topic id it was asked under."""

    leader: LeaderAndEpoch
    topic_id: bytes


def _list_offsets_request(
    resets: dict[TopicPartition, _Reset], spec: int, timestamp_ms: int = -1
) -> pb.ListOffsetsRequest:
    """ListOffsets by `spec` of partitions, each fenced at its leader's epoch."""
    return pb.ListOffsetsRequest(
        replica_id=-1,
        partitions=[
            pb.ListOffsetsPartition(
                topic=tp[0],
                partition=tp[1],
                current_leader_epoch=reset.leader[1],
                spec=spec,  # type: ignore[arg-type]
                timestamp_ms=timestamp_ms,
                topic_id=reset.topic_id,
            )
            for tp, reset in resets.items()
        ],
    )
