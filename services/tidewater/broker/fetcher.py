"""Followers fetching from their leaders (Kafka's ReplicaFetcherManager / ReplicaFetcherThread).

One fetcher task per (source broker, fetcher id) replicates many partitions with one
long-polling fetch at a time on a long-lived FetchStream; partitions are spread over
`num.replica.fetchers` fetchers per source broker by Kafka's hash. The rules of what to do
with a response are in tidewater.replication.follower; this module moves bytes and handles
errors: per-partition backoff, a fenced partition waits for the next LeaderAndIsr.

A fetcher keeps each partition's fetch position between rounds and works out again only
those of partitions that changed: answered, added, removed, backed off or back from a
backoff, or whose log start retention moved. An idle round costs O(1), not O(partitions).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from tidewater.broker.config import BrokerConfig
from tidewater.broker.fetch_session import FetchPlan, FetchSessionHandler
from tidewater.broker.partition import HostedPartition
from tidewater.broker.spans import ReplicaFetchTrace
from tidewater.errors import NO_ERROR, TidewaterError
from tidewater.replication.follower import (
    FetchedPartition,
    StopReplicating,
    TruncateTo,
    apply_out_of_range,
    follow_leader_log_start,
    next_fetch,
    on_offset_out_of_range,
    truncate_if_diverged,
    truncation_offset,
)
from tidewater.replication.partition import FollowerFetch
from tidewater.rpc.lifted import Lifted, Lifter
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.telemetry import tracing
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

log = logging.getLogger(__name__)

TopicPartition = tuple[str, int]
# How long past its max wait an answer may take before the fetch counts as failed.
RPC_GRACE_S = 10.0
# Refusals of a session's fetch that a full fetch (at once) mends.
SESSION_ERRORS = (ErrorCode.FETCH_SESSION_ID_NOT_FOUND, ErrorCode.INVALID_FETCH_SESSION_EPOCH)
FETCH_STREAM = "/tidewater.v1.BrokerService/FetchStream"
FETCH_LIFTER = Lifter(pb.FetchResponse, "partitions", "record_batches")
BuiltFetch = tuple[pb.FetchRequest, FetchPlan[TopicPartition], dict[TopicPartition, FollowerFetch]]
# What an untraced fetch runs in: one for all, not one made per fetch.
_UNTRACED = contextlib.nullcontext()


def java_string_hash(text: str) -> int:
    """Java's String#hashCode, so partitions land on the fetchers Kafka would pick."""
    data = text.encode("utf-16-be")
    h = 0
    for i in range(0, len(data), 2):
        h = (31 * h + int.from_bytes(data[i : i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def fetcher_id(topic: str, partition: int, num_fetchers: int) -> int:
    """Kafka's AbstractFetcherManager#getFetcherId: abs(31 * topic.hashCode + partition) % n."""
    value = (31 * java_string_hash(topic) + partition) & 0xFFFFFFFF
    return (value & 0x7FFFFFFF) % num_fetchers


@dataclass(frozen=True)
class SourceBroker:
    broker_id: int
    address: str


@dataclass
class PartitionFetchState:
    leader_epoch: int
    delayed_until: float = 0.0
    failed: bool = False
    # The leader's LEO in its last answer, -1 before one: the fetcher's lag (metrics).
    leader_end_offset: int = -1


class ReadDeadline:
    """Cancels a stream whose answer is overdue, with one timer for many reads: a read notes
    its deadline, and the timer, when it fires, checks the read then in progress and waits on
    for its deadline. An asyncio.timeout per read would arm and cancel a timer on every
    answer."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._call: grpc.aio.StreamStreamCall | None = None
        self._deadline = 0.0
        self._expired = False
        self._timer: asyncio.TimerHandle | None = None

    async def read(self, call: grpc.aio.StreamStreamCall) -> Any:
        """The call's next message; TimeoutError if none came within timeout_s."""
        self._call = call
        self._deadline = self._loop.time() + self.timeout_s
        self._expired = False
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._check)
        try:
            return await call.read()
        except asyncio.CancelledError:
            # grpc.aio ends the read of a call cancelled here with CancelledError: a timeout,
            # unless this task is being cancelled too.
            task = asyncio.current_task()
            if not self._expired or (task is not None and task.cancelling()):
                raise
            raise TimeoutError(f"no answer within {self.timeout_s:g} s") from None
        finally:
            self._call = None

    def close(self) -> None:
        self._call = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if self._call is None:
            return
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._check)
            return
        self._expired = True
        self._call.cancel()
        self._call = None


@dataclass
class ReplicaFetcher:
    source: SourceBroker
    fetcher_id: int
    config: BrokerConfig
    lookup: Callable[[TopicPartition], HostedPartition | None]
    # This broker's epoch, read for every fetch (KIP-903): registering again changes it.
    broker_epoch: Callable[[], int]
    partitions: dict[TopicPartition, PartitionFetchState] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    session: FetchSessionHandler[TopicPartition, FollowerFetch] = field(
        default_factory=FetchSessionHandler
    )
    # The position of every partition that can be fetched now, as last worked out; the
    # partitions whose position or state may have changed since; those backing off.
    _wanted: dict[TopicPartition, FollowerFetch] = field(default_factory=dict)
    _changed: set[TopicPartition] = field(default_factory=set)
    _backing_off: set[TopicPartition] = field(default_factory=set)
    # Its fetches' traces; sampled out, their stream declared its constant context.
    new_traces: tracing.NewTraces = field(default_factory=tracing.NewTraces)

    def start(self) -> None:
        name = f"fetcher-{self.source.broker_id}-{self.fetcher_id}"
        self.task = tracing.detached_task(self._run(), name=name)

    def mark_changed(self, tp: TopicPartition) -> None:
        """The partition's position, or whether it can be fetched, may have changed."""
        self._changed.add(tp)
        self.changed.set()

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            # Not `await self.task`: a fetcher that died would raise its error here again.
            await asyncio.wait([self.task])

    async def _run(self) -> None:
        deadline = ReadDeadline(self.config.replica_fetch_wait_max_ms / 1000 + RPC_GRACE_S)
        try:
            await self._fetch_until_stopped(deadline)
        finally:
            deadline.close()

    async def _fetch_until_stopped(self, deadline: ReadDeadline) -> None:
        backoff_s = self.config.replica_fetch_backoff_ms / 1000
        async with tracing.insecure_channel(self.source.address, CHANNEL_OPTIONS) as ch:
            stub = broker_pb2_grpc.BrokerServiceStub(ch)
            # FetchStream as the stub has it, but answers with their records lifted out.
            fetch_stream = ch.stream_stream(
                FETCH_STREAM,
                request_serializer=pb.FetchRequest.SerializeToString,
                response_deserializer=FETCH_LIFTER.parse,
                _registered_method=True,
            )
            stream: grpc.aio.StreamStreamCall | None = None
            correlation_id = 0
            while True:
                built = self._build_request()
                if built is None:
                    await self._wait_for_work()
                    continue
                request, plan, wanted = built
                correlation_id += 1
                request.correlation_id = correlation_id
                fetch_trace = (
                    ReplicaFetchTrace.start(request, self.source.broker_id, self.new_traces)
                    if tracing.ENABLED
                    else None
                )
                # The span ends however the fetch does, a cancelled one included.
                with fetch_trace or _UNTRACED:
                    try:
                        if stream is None:
                            # Tracing (set up before any fetcher starts), it declares the
                            # fetcher's constant as the parent of every fetch sampled out,
                            # which then carries no context.
                            stream = fetch_stream(
                                metadata=self.new_traces.metadata if tracing.ENABLED else None
                            )
                        await stream.write(request)
                        answer = await deadline.read(stream)
                        if answer is grpc.aio.EOF:
                            raise ConnectionError("fetch stream closed by the leader")
                    except (grpc.aio.AioRpcError, ConnectionError, TimeoutError) as e:
                        log.info("fetch from broker %d failed: %s", self.source.broker_id, e)
                        if fetch_trace is not None:
                            fetch_trace.failed(e)
                        if stream is not None:
                            stream.cancel()
                        stream = None
                        self.session.reset()  # the answer is lost: the epochs no longer match
                        self._delay(list(self.partitions), backoff_s)
                        continue
                    response = answer.message
                    self.session.on_response(plan, response.error_code, response.session_id)
                    if response.error_code != NO_ERROR:
                        # STALE_BROKER_EPOCH: the leader knows a newer registration of this
                        # broker id. This process backs off like any refused fetch; its
                        # heartbeats get the same answer and register it again, and the next
                        # fetch carries the epoch it has then.
                        log.log(
                            logging.WARNING
                            if response.error_code == ErrorCode.STALE_BROKER_EPOCH
                            else logging.INFO,
                            "fetch from broker %d refused: %s",
                            self.source.broker_id,
                            response.error_message,
                        )
                        if response.error_code not in SESSION_ERRORS:
                            self._delay(list(wanted), backoff_s)
                        continue  # a session error: a full fetch next, at once
                    await self._process(stub, wanted, answer, fetch_trace)

    async def _wait_for_work(self) -> None:
        self.changed.clear()
        now = time.monotonic()
        delays = [
            state.delayed_until - now
            for tp in self._backing_off
            if (state := self.partitions.get(tp)) is not None and not state.failed
        ]
        timeout = max(min(delays), 0.0) if delays else None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.changed.wait()

    def _build_request(self) -> BuiltFetch | None:
        """The next fetch of the session, or None when every partition waits; with the plan
        and every partition's position (named in the request or not)."""
        now = time.monotonic()
        changed, wanted = self._changed, self._wanted
        if self._backing_off:
            for tp in list(self._backing_off):
                state = self.partitions.get(tp)
                if state is None or state.failed or state.delayed_until <= now:
                    self._backing_off.discard(tp)
                    changed.add(tp)
        for tp in changed:
            state = self.partitions.get(tp)
            hosted = self.lookup(tp)
            if state is None or state.failed or state.delayed_until > now or hosted is None:
                wanted.pop(tp, None)
                if state is not None and not state.failed and state.delayed_until > now:
                    self._backing_off.add(tp)
                continue
            wanted[tp] = next_fetch(hosted.state, hosted.log.topic_id)
        if not wanted:
            # Kept for the next fetch built: a partition removed now must be forgotten then.
            return None
        self._changed = set()
        plan = self.session.build(wanted, changed)
        request = pb.FetchRequest(
            replica_id=self.config.broker_id,
            replica_broker_epoch=self.broker_epoch(),
            max_wait_ms=self.config.replica_fetch_wait_max_ms,
            min_bytes=self.config.replica_fetch_min_bytes,
            max_bytes=self.config.replica_fetch_response_max_bytes,
        )
        # Set in place: a FetchSession built apart would be copied in.
        request.session.id = plan.session_id
        request.session.epoch = plan.epoch
        for tp in plan.send:
            fetch = wanted[tp]
            request.partitions.add(
                topic=tp[0],
                partition=tp[1],
                fetch_offset=fetch.fetch_offset,
                current_leader_epoch=fetch.current_leader_epoch,
                last_fetched_epoch=fetch.last_fetched_epoch,
                log_start_offset=fetch.log_start_offset,
                partition_max_bytes=self.config.replica_fetch_max_bytes,
                topic_id=fetch.topic_id,
            )
        for tp in plan.forgotten:
            request.forgotten.add(topic=tp[0], partition=tp[1])
        return request, plan, wanted

    async def _process(
        self,
        stub: broker_pb2_grpc.BrokerServiceStub,
        wanted: dict[TopicPartition, FollowerFetch],
        answer: Lifted[pb.FetchResponse],
        fetch_trace: ReplicaFetchTrace | None = None,
    ) -> None:
        backoff_s = self.config.replica_fetch_backoff_ms / 1000
        for result, lifted in zip(answer.message.partitions, answer.views, strict=True):
            tp = (result.topic, result.partition)
            # Whatever the answer does to the partition, its next position is worked out anew.
            self._changed.add(tp)
            state = self.partitions.get(tp)
            hosted = self.lookup(tp)
            sent = wanted.get(tp)
            if (
                state is None
                or hosted is None
                or sent is None
                or hosted.state.leader_epoch != state.leader_epoch
                or sent.current_leader_epoch != state.leader_epoch
            ):
                continue  # removed, or a newer epoch arrived while the fetch was in flight
            code = result.error_code
            try:
                if code == NO_ERROR:
                    diverging = None
                    if result.HasField("diverging_epoch"):
                        diverging = (
                            result.diverging_epoch.epoch,
                            result.diverging_epoch.end_offset,
                        )
                    records = result.record_batches if lifted is None else lifted
                    fetched = FetchedPartition(result.high_watermark, diverging, records)
                    if diverging is not None:
                        await hosted.log.write_out()
                        await hosted.prepare_truncation(
                            truncation_offset(
                                hosted.leader_epoch_cache, hosted.log_end_offset, diverging
                            )
                        )
                        if not self._still_follows(tp, state, hosted):
                            continue  # a LeaderAndIsr came meanwhile: the answer is stale
                    if not truncate_if_diverged(hosted.state, hosted, fetched):
                        if records:
                            start_ns = time.time_ns() if fetch_trace is not None else 0
                            await hosted.append_as_follower(records)
                            if fetch_trace is not None:
                                fetch_trace.appended(tp, len(records), start_ns)
                            if not self._still_follows(tp, state, hosted):
                                continue  # a LeaderAndIsr came while the data was written
                        hosted.state.update_follower_high_watermark(fetched.high_watermark)
                        follow_leader_log_start(hosted.state, hosted, result.log_start_offset)
                    state.leader_end_offset = result.log_end_offset
                elif code == ErrorCode.OFFSET_OUT_OF_RANGE:
                    await self._handle_out_of_range(stub, hosted, state)
                elif code == ErrorCode.FENCED_LEADER_EPOCH:
                    # Routine in a leader change or a rolling restart (review 37 #5: a WARNING
                    # per partition), as Kafka's fetcher logs it.
                    log.info("%s-%d: fenced by the leader; waiting for LeaderAndIsr", *tp)
                    state.failed = True
                else:
                    name = ErrorCode.Name(code)
                    log.info("%s-%d: fetch error %s: %s", *tp, name, result.error_message)
                    state.delayed_until = time.monotonic() + backoff_s
            except TidewaterError as e:
                log.warning("%s-%d: cannot apply fetched data: %s", *tp, e)
                state.delayed_until = time.monotonic() + backoff_s
            except Exception:
                # One partition's failure must not end the fetcher and stall the others
                # (Kafka's processFetchRequest backs the partition off on any Throwable).
                log.exception("%s-%d: unexpected error handling fetched data; backing off", *tp)
                state.delayed_until = time.monotonic() + backoff_s

    def _still_follows(
        self, tp: TopicPartition, state: PartitionFetchState, hosted: HostedPartition
    ) -> bool:
        """Whether this fetcher still replicates `hosted` in the epoch it fetched for."""
        return (
            self.partitions.get(tp) is state
            and self.lookup(tp) is hosted
            and hosted.state.leader_epoch == state.leader_epoch
        )

    async def _handle_out_of_range(
        self,
        stub: broker_pb2_grpc.BrokerServiceStub,
        hosted: HostedPartition,
        state: PartitionFetchState,
    ) -> None:
        topic, partition = hosted.key
        request = pb.ListOffsetsRequest(
            replica_id=self.config.broker_id,
            partitions=[
                pb.ListOffsetsPartition(
                    topic=topic,
                    partition=partition,
                    current_leader_epoch=state.leader_epoch,
                    spec=spec,
                    topic_id=hosted.log.topic_id,
                )
                for spec in (pb.OFFSET_SPEC_LATEST, pb.OFFSET_SPEC_EARLIEST)
            ],
        )
        backoff_s = self.config.replica_fetch_backoff_ms / 1000
        try:
            response = await stub.ListOffsets(request, timeout=RPC_GRACE_S)
        except grpc.aio.AioRpcError as e:
            log.info("%s: ListOffsets failed: %s %s", hosted.state.name, e.code(), e.details())
            state.delayed_until = time.monotonic() + backoff_s
            return
        if not self._still_follows(hosted.key, state, hosted):
            return  # a LeaderAndIsr came during the call: the leader's offsets are stale
        latest, earliest = response.partitions
        if latest.error_code or earliest.error_code:
            state.delayed_until = time.monotonic() + backoff_s
            return
        action = on_offset_out_of_range(
            hosted.state.name,
            hosted.log.log_end_offset,
            latest.offset,
            earliest.offset,
            hosted.config.unclean_leader_election_enable,
        )
        if isinstance(action, StopReplicating):
            log.error("STOPPED REPLICATING %s", action.reason)
            state.failed = True
        elif action is not None:
            log.warning("%s: fetch offset out of range; %s", hosted.state.name, action)
            if isinstance(action, TruncateTo):  # not for a log deleted whole
                await hosted.log.write_out()
                await hosted.prepare_truncation(action.offset)
                if not self._still_follows(hosted.key, state, hosted):
                    return
            apply_out_of_range(hosted.state, hosted, action)

    def _delay(self, tps: list[TopicPartition], seconds: float) -> None:
        until = time.monotonic() + seconds
        for tp in tps:
            state = self.partitions.get(tp)
            if state is not None:  # else removed while the fetch was in flight
                state.delayed_until = until
                self._changed.add(tp)


class ReplicaFetcherManager:
    """Kafka's ReplicaFetcherManager: hands each followed partition to its fetcher, and keeps
    every fetcher it hands partitions to running. A fetcher's task that ends by itself (a bug
    outside the per-partition error handling) is logged and replaced after
    replica.fetch.backoff.ms, with its partitions; adding a partition replaces it at once."""

    def __init__(
        self,
        config: BrokerConfig,
        lookup: Callable[[TopicPartition], HostedPartition | None],
        broker_epoch: Callable[[], int],
    ) -> None:
        self.config = config
        self.lookup = lookup
        self.broker_epoch = broker_epoch
        self.fetchers: dict[tuple[int, int], ReplicaFetcher] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def add_partition(self, tp: TopicPartition, source: SourceBroker, leader_epoch: int) -> None:
        key = (source.broker_id, fetcher_id(tp[0], tp[1], self.config.num_replica_fetchers))
        self.remove_partitions([tp], keep=key)
        fetcher = self.fetchers.get(key)
        if fetcher is None or fetcher.source != source or not fetcher.alive:
            # A restarted leader may listen elsewhere: a new fetcher takes over the old one's
            # partitions.
            fetcher = self._replace(key, fetcher, source)
        fetcher.partitions[tp] = PartitionFetchState(leader_epoch)
        fetcher.mark_changed(tp)

    def _replace(
        self, key: tuple[int, int], old: ReplicaFetcher | None, source: SourceBroker
    ) -> ReplicaFetcher:
        fetcher = ReplicaFetcher(source, key[1], self.config, self.lookup, self.broker_epoch)
        if old is not None:
            fetcher.partitions.update(old.partitions)
            for tp in old.partitions:
                fetcher.mark_changed(tp)
            if old.source == source:  # the same leader: close the old fetcher's session
                fetcher.session = old.session.successor()
            self._stop_later(old)
        self.fetchers[key] = fetcher
        fetcher.start()
        assert fetcher.task is not None
        fetcher.task.add_done_callback(lambda task: self._ended(key, fetcher, task))
        return fetcher

    def _ended(
        self, key: tuple[int, int], fetcher: ReplicaFetcher, task: asyncio.Task[None]
    ) -> None:
        if task.cancelled():
            return  # stopped
        log.error(
            "fetcher %s ENDED (it must run until stopped); replacing it in %d ms",
            task.get_name(),
            self.config.replica_fetch_backoff_ms,
            exc_info=task.exception(),
        )
        loop = asyncio.get_running_loop()
        loop.call_later(self.config.replica_fetch_backoff_ms / 1000, self._restart, key, fetcher)

    def _restart(self, key: tuple[int, int], dead: ReplicaFetcher) -> None:
        if self.fetchers.get(key) is dead:  # else replaced or removed meanwhile
            self._replace(key, dead, dead.source)

    def remove_partitions(
        self, tps: list[TopicPartition], keep: tuple[int, int] | None = None
    ) -> None:
        """Stop the fetchers left without partitions, but `keep`'s, about to get one."""
        for key, fetcher in list(self.fetchers.items()):
            for tp in tps:
                if fetcher.partitions.pop(tp, None) is not None:
                    fetcher.mark_changed(tp)  # forgotten in its session
            if not fetcher.partitions and key != keep:
                del self.fetchers[key]
                self._stop_later(fetcher)

    def log_start_moved(self, tp: TopicPartition) -> None:
        """Retention moved a followed partition's log start: its fetches say so."""
        for fetcher in self.fetchers.values():
            if tp in fetcher.partitions:
                fetcher.mark_changed(tp)

    def _stop_later(self, fetcher: ReplicaFetcher) -> None:
        task = asyncio.ensure_future(fetcher.stop())
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def shutdown(self) -> None:
        fetchers, self.fetchers = list(self.fetchers.values()), {}
        await asyncio.gather(*(f.stop() for f in fetchers), *self._stopping)
