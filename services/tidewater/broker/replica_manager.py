"""The broker's partitions and the requests that touch them (Kafka's ReplicaManager).

Speaks the protocol's request and response messages; the gRPC layer only moves them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tidewater.broker.config import BrokerConfig
from tidewater.broker.controller_client import ControllerClient
from tidewater.broker.delayed import Appended, DelayedFetch, DelayedProduce, TopicPartition
from tidewater.broker.fetch_answer import FetchAnswer, PartitionAnswer
from tidewater.broker.fetch_session import FetchContext, FetchSessionCache
from tidewater.broker.fetcher import ReplicaFetcherManager, SourceBroker
from tidewater.broker.isr_channel import AlterIsrChannel
from tidewater.broker.log.checkpoints import OffsetCheckpoint, OffsetCheckpointWriter
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.manager import LogManager
from tidewater.broker.partition import HostedPartition, replication_config
from tidewater.broker.producer_ids import ProducerIdManager
from tidewater.broker.purgatory import Clock, DelayedOperation, Purgatory
from tidewater.broker.spans import FetchTrace, ProduceTrace, ReplicationWaits, fetch_link
from tidewater.broker.stray_logs import ClusterView, find_stray_logs, orphaned
from tidewater.broker.topic_config import TopicConfig
from tidewater.broker.topic_ids import topic_id_text, topic_ids_match
from tidewater.errors import (
    NO_ERROR,
    InconsistentTopicId,
    InvalidFetchSessionEpoch,
    InvalidRequest,
    InvalidRequiredAcks,
    InvalidTimestamp,
    OffsetNotAvailable,
    StaleBrokerEpoch,
    StaleControllerEpoch,
    TidewaterError,
    UnknownTopicId,
    UnknownTopicOrPartition,
)
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.records.compression import DecompressedTooLarge
from tidewater.records.header import BatchHeader, Compression, next_offset_after
from tidewater.records.validate import (
    MAX_RECORDS_SECTION_BYTES,
    TimestampBounds,
    check_compressed_records,
    validate_batch_short_of_compressed_records,
)
from tidewater.replication.partition import (
    ACKS_ALL,
    NO_EPOCH,
    NO_LEADER,
    AlterIsrProposal,
    FollowerFetch,
    LeaderAndIsr,
    Partition,
)
from tidewater.replication.replica import FetchClock
from tidewater.telemetry import tracing
from tidewater.topic_names import validate_topic_name
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import cluster_pb2, common_pb2
from tidewater.v1.errors_pb2 import ErrorCode

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

    from tidewater.broker.metrics import RequestMetrics

log = logging.getLogger(__name__)

HIGH_WATERMARK_CHECKPOINT = "replication-offset-checkpoint"
CONSUMER_REPLICA_ID = -1
T = TypeVar("T")
FetchPartitionResults = list[PartitionAnswer]


class ReplicaManager:
    def __init__(
        self,
        config: BrokerConfig,
        log_manager: LogManager,
        clock: Clock,
        time_ms: Callable[[], int],
    ) -> None:
        self.config = config
        self.broker_id = config.broker_id
        self.log_manager = log_manager
        log_manager.high_watermark = self._high_watermark
        log_manager.log_start_moved = self._log_start_moved
        self.time_ms = time_ms
        self.partitions: dict[TopicPartition, HostedPartition] = {}
        self.controller_epoch = 0
        self.produce_purgatory = Purgatory("Produce", clock)
        self.fetch_purgatory = Purgatory("Fetch", clock)
        self.fetch_sessions = FetchSessionCache(
            config.max_incremental_fetch_session_cache_slots,
            config.min_incremental_fetch_session_eviction_ms,
        )
        self.controller = ControllerClient(config.controllers)
        # Set by the broker's lifecycle once registered; 0 until then.
        self.broker_epoch: Callable[[], int] = lambda: 0
        self.fetcher_manager = ReplicaFetcherManager(
            config, self.partitions.get, lambda: self.broker_epoch()
        )
        self.isr_channel = AlterIsrChannel(
            config.broker_id,
            self.controller,
            self._on_alter_isr_result,
            lambda: self.broker_epoch(),
            config.isr_change_propagation_window_ms,
        )
        self.producer_ids = ProducerIdManager(
            self.controller, config.broker_id, lambda: self.broker_epoch()
        )
        self._control_lock = asyncio.Lock()
        # ISR changes committed for partitions led here (Kafka's IsrShrinks/IsrExpands).
        self.isr_shrinks = 0
        self.isr_expands = 0
        # Set by the broker when metrics are on.
        self.request_metrics: RequestMetrics | None = None
        # Usable (alive, unfenced) brokers per the controller's last UpdateMetadata, with
        # their broker epochs (0: not given); None until the first one. Only these may join
        # an ISR, and only as that incarnation (KIP-903); fetches from an older one are
        # refused.
        self.usable_brokers: dict[int, int] | None = None
        self._checkpointed_hws: dict[TopicPartition, int] = {}
        self._hw_writer = OffsetCheckpointWriter(
            HIGH_WATERMARK_CHECKPOINT, log_manager.dir_failures
        )
        self._replication_waits = ReplicationWaits()
        # Per topic, the raw configs every hosted partition of it was last given by an
        # UpdateMetadata: a FULL view (each unfence, each controller failover) names every
        # topic, and only those whose configs changed are parsed and applied again.
        self._applied_topic_configs: dict[str, dict[str, str]] = {}
        for log_dir in config.log_dirs:
            self._checkpointed_hws.update(
                OffsetCheckpoint(log_dir / HIGH_WATERMARK_CHECKPOINT).read()
            )

    # -- control plane -------------------------------------------------------------------

    async def become_leader_or_follower(
        self, request: pb.LeaderAndIsrRequest
    ) -> pb.LeaderAndIsrResponse:
        """Kafka's becomeLeaderOrFollower: epoch checks, then makeLeader / makeFollower.

        One request at a time, in arrival order; between partitions it yields to the event
        loop, so a request for thousands of partitions (each with a checkpoint fsync) does not
        stall heartbeats and fetches long enough to get this broker fenced."""
        async with self._control_lock:
            return await self._become_leader_or_follower(request)

    async def _become_leader_or_follower(
        self, request: pb.LeaderAndIsrRequest
    ) -> pb.LeaderAndIsrResponse:
        try:
            self._check_control_request(request.controller_epoch, request.broker_epoch)
        except TidewaterError as e:
            return pb.LeaderAndIsrResponse(error_code=e.code, error_message=e.message)
        self.controller_epoch = request.controller_epoch
        configs = {tc.topic: dict(tc.configs) for tc in request.topic_configs}
        leaders = {
            b.broker_id: SourceBroker(b.broker_id, f"{b.endpoint.host}:{b.endpoint.port}")
            for b in request.live_leaders
        }
        response = pb.LeaderAndIsrResponse()
        for ps in request.partition_states:
            await asyncio.sleep(0)
            error = self._apply_partition_state(ps, configs.get(ps.topic, {}), leaders)
            response.partition_errors.append(
                common_pb2.PartitionError(
                    topic=ps.topic,
                    partition=ps.partition,
                    error_code=error.code if error else NO_ERROR,
                    error_message=error.message if error else "",
                )
            )
        return response

    def _apply_partition_state(
        self,
        ps: pb.LeaderAndIsrPartitionState,
        topic_props: dict[str, str],
        leaders: dict[int, SourceBroker],
    ) -> TidewaterError | None:
        tp = (ps.topic, ps.partition)
        try:
            validate_topic_name(ps.topic)
            if self.broker_id not in ps.replicas:
                raise UnknownTopicOrPartition(
                    f"broker {self.broker_id} is not a replica of {ps.topic}-{ps.partition} "
                    f"(replicas {list(ps.replicas)})"
                )
            self._check_topic_id(ps)
            state = LeaderAndIsr(
                leader=ps.leader,
                leader_epoch=ps.leader_epoch,
                isr=tuple(ps.isr),
                replicas=tuple(ps.replicas),
                partition_epoch=ps.partition_epoch,
                controller_epoch=ps.controller_epoch,
                elr=tuple(ps.eligible_leader_replicas),
            )
            hosted = self.partitions.get(tp)
            if hosted is not None:
                hosted.state.check_newer(state)
            config = self._topic_config(topic_props)
            if ps.leader not in (self.broker_id, NO_LEADER) and ps.leader not in leaders:
                raise InvalidRequest(
                    f"{ps.topic}-{ps.partition}: live_leaders has no endpoint for leader "
                    f"{ps.leader}"
                )
            if hosted is None:
                hosted = self._create_partition(tp, config, ps.topic_id)
            else:
                # A HW this moves is announced below, with the rest of the partition's change.
                hosted.reconfigure(config, self.config.replica_lag_time_max_ms, self.time_ms())
            if self._applied_topic_configs.get(ps.topic) != topic_props:
                self._applied_topic_configs.pop(ps.topic, None)  # its partitions now differ
            if ps.topic_id and not hosted.log.topic_id:
                # A log written before topic ids adopts the first one it is told.
                self.log_manager.assign_topic_id(hosted.log, ps.topic_id)
            if ps.leader_epoch == hosted.state.leader_epoch:
                # A newer partition epoch alone (the ISR or ELR changed): the role, fetcher,
                # log and epoch cache stay as they are (Kafka's isNewLeaderEpoch false).
                self._apply_partition_epoch(hosted, state)
            else:
                self._apply_leader_epoch(hosted, state, leaders)
            self._partition_changed(tp)
        except TidewaterError as e:
            return e
        return None

    def _apply_leader_epoch(
        self, hosted: HostedPartition, state: LeaderAndIsr, leaders: dict[int, SourceBroker]
    ) -> None:
        tp = hosted.state.key
        # The new role starts at the LEO, which must include a batch still being written.
        hosted.log.take_in_pending_write()
        if state.leader == self.broker_id:
            self.fetcher_manager.remove_partitions([tp])
            hosted.state.make_leader(state, self.time_ms())
            log.info(
                "became leader of %s-%d at epoch %d, LEO %d, HW %d",
                *tp,
                state.leader_epoch,
                hosted.log.log_end_offset,
                hosted.state.high_watermark,
            )
            return
        if state.leader == NO_LEADER:
            # Offline: nothing to follow until the controller elects a leader.
            self.fetcher_manager.remove_partitions([tp])
            hosted.state.make_follower(state)
        elif hosted.state.make_follower(state):
            self.fetcher_manager.add_partition(tp, leaders[state.leader], state.leader_epoch)
        log.info(
            "became follower of %s-%d at epoch %d (leader %d)",
            *tp,
            state.leader_epoch,
            state.leader,
        )

    def _apply_partition_epoch(self, hosted: HostedPartition, state: LeaderAndIsr) -> None:
        if hosted.state.is_leader:
            hosted.state.make_leader(state, self.time_ms())
        else:
            hosted.state.make_follower(state)
        log.info(
            "%s-%d: partition epoch %d (ISR %s, ELR %s) in leader epoch %d (leader %d), kept",
            *hosted.state.key,
            state.partition_epoch,
            list(state.isr),
            list(state.elr),
            state.leader_epoch,
            state.leader,
        )

    def _check_topic_id(self, ps: pb.LeaderAndIsrPartitionState) -> None:
        """Kafka's hasConsistentTopicId in becomeLeaderOrFollower: a log holding another topic
        id is another topic's (deleted, its log still here); nothing changes for it."""
        if not ps.topic_id:
            return
        if len(ps.topic_id) != 16:
            raise InvalidRequest(
                f"{ps.topic}-{ps.partition}: topic id of {len(ps.topic_id)} bytes, not 16"
            )
        existing = self.log_manager.get_log(ps.topic, ps.partition)
        if existing is not None and not topic_ids_match(existing.topic_id, ps.topic_id):
            error = InconsistentTopicId(
                f"{ps.topic}-{ps.partition}: the log on broker {self.broker_id} holds topic id "
                f"{topic_id_text(existing.topic_id)}, the request names "
                f"{topic_id_text(ps.topic_id)}; not applied"
            )
            log.error("LeaderAndIsr refused: %s", error)
            raise error

    def _create_partition(
        self, tp: TopicPartition, config: TopicConfig, topic_id: bytes
    ) -> HostedPartition:
        log_ = self.log_manager.get_or_create_log(tp[0], tp[1], config.log, topic_id)
        state = Partition(
            topic=tp[0],
            partition=tp[1],
            local_broker_id=self.broker_id,
            log=log_,
            config=replication_config(config, self.config.replica_lag_time_max_ms),
            checkpointed_high_watermark=self._checkpointed_hws.get(tp, 0),
            usable_broker_epoch=self._usable_broker_epoch,
        )
        hosted = HostedPartition(state, log_, config, self.time_ms)
        self.partitions[tp] = hosted
        return hosted

    async def stop_replica(self, request: pb.StopReplicaRequest) -> pb.StopReplicaResponse:
        async with self._control_lock:
            return await self._stop_replica(request)

    def _stop_partitions(self, tps: list[TopicPartition]) -> None:
        """Stop replicating and serving these partitions (their logs stay)."""
        self.fetcher_manager.remove_partitions(tps)
        for tp in tps:
            partition = self.partitions.pop(tp, None)
            if partition is not None:
                partition.stopped = True
                # Leadership is gone: waiting produces and fetches answer now.
                self._partition_changed(tp)

    async def _stop_replica(self, request: pb.StopReplicaRequest) -> pb.StopReplicaResponse:
        try:
            self._check_control_request(request.controller_epoch, request.broker_epoch)
        except TidewaterError as e:
            return pb.StopReplicaResponse(error_code=e.code, error_message=e.message)
        self.controller_epoch = request.controller_epoch
        response = pb.StopReplicaResponse()
        deleting = []
        for sp in request.partitions:
            tp = (sp.topic, sp.partition)
            self._stop_partitions([tp])
            if sp.delete_partition and self.log_manager.get_log(*tp) is not None:
                deleting.append(tp)
                self._checkpointed_hws.pop(tp, None)
            response.partition_errors.append(
                common_pb2.PartitionError(topic=sp.topic, partition=sp.partition)
            )
        if deleting:
            await self.log_manager.delete_logs(deleting)
            # Likewise its HW: a new log of the partition starts at min(checkpoint, LEO).
            self.checkpoint_high_watermarks()
        return response

    async def update_metadata(
        self, request: cluster_pb2.UpdateMetadataRequest
    ) -> cluster_pb2.UpdateMetadataResponse:
        """The controller's view of live brokers, which decides who may join an ISR; a FULL
        view also finds the stray logs. After any LeaderAndIsr in progress: what it hosts
        must be known first."""
        async with self._control_lock:
            return await self._update_metadata(request)

    async def _update_metadata(
        self, request: cluster_pb2.UpdateMetadataRequest
    ) -> cluster_pb2.UpdateMetadataResponse:
        try:
            self._check_control_request(request.controller_epoch, request.broker_epoch)
        except TidewaterError as e:
            return cluster_pb2.UpdateMetadataResponse(error_code=e.code, error_message=e.message)
        view = ClusterView.of(request)
        strays = find_stray_logs(
            self.log_manager.local_logs(),
            view,
            {tp: hosted.state.leader_epoch for tp, hosted in self.partitions.items()},
            self.broker_id,
            self.broker_epoch(),
            self.controller_epoch,
        )
        self.controller_epoch = request.controller_epoch
        usable = {
            b.broker_id: b.broker_epoch
            for b in request.live_brokers
            if not b.in_controlled_shutdown
        }
        if usable != self.usable_brokers:
            self.usable_brokers = usable
            self._recheck_high_watermarks(self.time_ms())
        full = request.type == cluster_pb2.UPDATE_METADATA_TYPE_FULL
        self._apply_topic_configs(request.topic_configs, full)
        if strays:
            # Hosted ones first: their StopReplica was lost.
            self._stop_partitions([tp for tp in strays if tp in self.partitions])
            await self.log_manager.remove_stray_logs(strays, keep=orphaned(strays, view))
            for tp in strays:
                self._checkpointed_hws.pop(tp, None)
        return cluster_pb2.UpdateMetadataResponse()

    def _topic_config(self, topic_props: dict[str, str]) -> TopicConfig:
        """A topic's effective config: its overrides over this broker's defaults."""
        return TopicConfig.from_properties({**self.config.topic_defaults, **topic_props})

    def _apply_topic_configs(
        self, topic_configs: Iterable[common_pb2.TopicConfig], full: bool
    ) -> None:
        """A topic's changed configs (IncrementalAlterConfigs) to the partitions hosted here,
        from their next use on, as Kafka applies a topic config change to its live logs:
        segment.bytes, segment.ms and segment.index.bytes at the next append's roll check,
        retention at the next retention check, min.insync.replicas and max.message.bytes at
        the next produce. The controller validated them; a value this broker's defaults make
        invalid is logged and leaves the partitions as they were. Costs the changed topics'
        partitions, not every topic times every partition."""
        named = {tc.topic: dict(tc.configs) for tc in topic_configs}
        if full:  # the topics it does not name are gone
            for topic in self._applied_topic_configs.keys() - named.keys():
                del self._applied_topic_configs[topic]
        changed = [(t, c) for t, c in named.items() if self._applied_topic_configs.get(t) != c]
        if not changed:
            return
        by_topic: dict[str, list[HostedPartition]] = {}
        for (topic, _), partition in self.partitions.items():
            by_topic.setdefault(topic, []).append(partition)
        for topic, props in changed:
            hosted = by_topic.get(topic)
            self._applied_topic_configs.pop(topic, None)
            if not hosted:
                continue
            try:
                config = self._topic_config(props)
            except TidewaterError as e:
                log.error("topic %s: configs %s not applied: %s", topic, props, e)
                continue
            self._applied_topic_configs[topic] = props
            if all(p.config == config for p in hosted):
                continue
            for partition in hosted:
                if partition.reconfigure(
                    config, self.config.replica_lag_time_max_ms, self.time_ms()
                ):
                    # A lower min.insync.replicas its ISR meets now: acks=all produces
                    # waiting on the HW, and fetches waiting for readable records, complete.
                    self._partition_changed(partition.state.key)
            log.info("topic %s: %d partitions take its new configs", topic, len(hosted))

    def _usable_broker_epoch(self, broker_id: int) -> int | None:
        if self.usable_brokers is None:
            return 0
        return self.usable_brokers.get(broker_id)

    def _check_replica_broker_epoch(self, request: pb.FetchRequest) -> None:
        """KIP-903: a follower fetch from an older incarnation of its broker than the one the
        controller last told us of is refused whole (0 on either side skips the check)."""
        known = self._usable_broker_epoch(request.replica_id)
        if request.replica_broker_epoch and known and request.replica_broker_epoch < known:
            raise StaleBrokerEpoch(
                f"fetch from broker {request.replica_id} at broker epoch "
                f"{request.replica_broker_epoch}; its current registration is at {known}"
            )

    def _check_control_request(self, controller_epoch: int, broker_epoch: int) -> None:
        """Refuse requests from a deposed controller, or meant for an earlier incarnation of
        this broker: one that names a broker epoch before this one has registered is
        (review 20 H1: a restarted broker obeyed its previous life's retried LeaderAndIsr
        before it registered, and led with a shorter log). 0 skips the broker epoch check:
        tools and tests."""
        if controller_epoch < self.controller_epoch:
            raise StaleControllerEpoch(
                f"controller epoch {controller_epoch} is older than {self.controller_epoch}, "
                "the newest this broker has seen"
            )
        current = self.broker_epoch()
        if broker_epoch and (not current or broker_epoch < current):
            raise StaleBrokerEpoch(
                f"request for broker epoch {broker_epoch}; this broker is at epoch {current}"
                + (" (not registered yet)" if not current else "")
            )

    # -- produce -------------------------------------------------------------------------

    async def produce(
        self,
        request: pb.ProduceRequest,
        metadata: Any = None,
        batches: Sequence[memoryview | None] = (),
        in_order: asyncio.Lock | None = None,
        declared: SpanContext | None = None,
    ) -> pb.ProduceResponse:
        """`metadata`: the gRPC call's, where a unary caller's trace context may be.
        `batches[i]`: partition i's record_batch if gRPC's deserializer lifted it out of the
        request (tidewater.rpc.lifted), None if it is in the request. `in_order`: held
        through the appends, taken before the first await: the produces of one stream append
        in arrival order (an asyncio.Lock serves its waiters first come, first served).
        `declared`: the sampled-out parent the stream declared (tracing.stream_parent)."""
        if not tracing.ENABLED:
            return await self._produce(request, None, batches, in_order)
        traces = ProduceTrace.start_all(request, metadata, declared)
        if traces is None:
            return await self._produce(request, None, batches, in_order)
        try:
            response = await self._produce(request, traces, batches, in_order)
        except BaseException as e:
            for produce_trace in traces:
                if produce_trace is not None:
                    produce_trace.abandon(e)
            raise
        for produce_trace, result in zip(traces, response.partitions, strict=True):
            if produce_trace is not None:
                produce_trace.end(result)
        return response

    async def _produce(
        self,
        request: pb.ProduceRequest,
        traces: list[ProduceTrace | None] | None,
        batches: Sequence[memoryview | None],
        in_order: asyncio.Lock | None,
    ) -> pb.ProduceResponse:
        started = time.perf_counter_ns()
        if in_order is None:
            response, waiting, appended, completed = await self._append_all(
                request, traces, batches
            )
        else:
            async with in_order:
                response, waiting, appended, completed = await self._append_all(
                    request, traces, batches
                )
        local_done = time.perf_counter_ns()
        if waiting and completed:
            # The fetches the appends completed write the batches to the followers first,
            # then this produce parks: its ack waits for their copies.
            await asyncio.sleep(0)
        if waiting:
            waits = (
                self._replication_waits.start(
                    request.partitions,
                    traces,
                    {tp: batch.required_offset for tp, batch in waiting.items()},
                )
                if traces is not None
                else None
            )
            try:
                await self._await_replication(request, response, waiting)
            finally:
                if waits:
                    self._replication_waits.finish(waits, response, self._high_watermark)
        if self.request_metrics is not None:
            self.request_metrics.produced(started, local_done, time.perf_counter_ns(), appended)
        return response

    async def _append_all(
        self,
        request: pb.ProduceRequest,
        traces: list[ProduceTrace | None] | None,
        batches: Sequence[memoryview | None],
    ) -> tuple[pb.ProduceResponse, dict[TopicPartition, Appended], int, int]:
        """Append each partition's batch; returns the response so far, the batches acks=all
        waits for, the bytes appended, and how many waiting operations the appends completed."""
        response = pb.ProduceResponse(correlation_id=request.correlation_id)
        waiting: dict[TopicPartition, Appended] = {}
        appended = 0
        completed = 0
        if request.acks not in (0, 1, ACKS_ALL):
            error = InvalidRequiredAcks(f"acks must be 0, 1 or -1, got {request.acks}")
            for data in request.partitions:
                response.partitions.append(self._produce_error(data, error))
            return response, waiting, appended, completed
        for i, data in enumerate(request.partitions):
            tp = (data.topic, data.partition)
            try:
                partition = self._leader_partition(tp, data.topic_id)
                lifted = batches[i] if batches else None
                batch, header, bounds = self._batch_of(data, partition.config.log, lifted)
                start_ns = time.time_ns() if traces is not None else 0
                # No await before append_as_leader: it takes the partition's turn at the
                # call, so produces append in arrival order; the check waits in the turn.
                info, leader_epoch = await partition.append_as_leader(
                    batch,
                    request.acks,
                    self.time_ms(),
                    None
                    if header.compression == Compression.NONE
                    else partial(_check_compressed_records, batch, header, bounds),
                )
            except asyncio.CancelledError:
                # The client went (its deadline, a disconnect) while the batch was written
                # off the loop: it lands all the same, and what waits on the partition (long
                # polls, fetch sessions where it was quiet) must hear of it (review 19 #1).
                partition.log.when_written(partial(self._partition_changed, tp))
                raise
            except TidewaterError as e:
                response.partitions.append(self._produce_error(data, e))
                continue
            except Exception as e:
                # A bug, not an answer. As Kafka's appendToLocalLog, only this partition
                # answers UNKNOWN_SERVER_ERROR: the others' batches are appended, or not,
                # as their answers say (a retry of an appended one would duplicate it).
                log.exception("produce to %s-%d failed", *tp)
                response.partitions.append(_partition_produce_error(data, _unknown_server_error(e)))
                continue
            appended += info.size_bytes
            produce_trace = traces[i] if traces is not None else None
            if produce_trace is not None:
                produce_trace.appended(batch, info.first_offset, leader_epoch, start_ns)
            # add() builds the result in place; append() would copy a built one.
            response.partitions.add(
                topic=tp[0],
                partition=tp[1],
                base_offset=info.first_offset,
                log_append_time_ms=-1,
                log_start_offset=partition.log.log_start_offset,
            )
            completed += self._partition_changed(tp)
            if request.acks == ACKS_ALL:
                waiting[tp] = Appended(info.last_offset + 1, leader_epoch, partition)
        return response, waiting, appended, completed

    def _batch_of(
        self, data: pb.PartitionProduceData, config: LogConfig, lifted: memoryview | None
    ) -> tuple[bytearray, BatchHeader, TimestampBounds]:
        """The partition's batch, checked but for a compressed batch's records, its header,
        and the timestamps its records may have."""
        # Each read of a bytes field copies it: read the batch once.
        raw = data.record_batch if lifted is None else lifted
        if raw and data.records:
            raise InvalidRequest("set either record_batch or records, not both")
        if data.records:
            raw = _built_batch(
                [
                    Record(
                        key=r.key if r.HasField("key") else None,
                        value=r.value if r.HasField("value") else None,
                        headers=tuple(
                            (h.key, h.value if h.HasField("value") else None) for h in r.headers
                        ),
                        timestamp_ms=r.timestamp_ms or None,
                    )
                    for r in data.records
                ],
                self.time_ms(),
            )
        elif not raw:
            raise InvalidRequest("no records: set record_batch or records")
        bounds = TimestampBounds(
            self.time_ms(),
            config.message_timestamp_before_max_ms,
            config.message_timestamp_after_max_ms,
        )
        header = validate_batch_short_of_compressed_records(raw, config.max_message_bytes, bounds)
        return bytearray(raw), header, bounds

    async def _await_replication(
        self,
        request: pb.ProduceRequest,
        response: pb.ProduceResponse,
        waiting: dict[TopicPartition, Appended],
    ) -> None:
        timeout_ms = request.timeout_ms or self.config.request_timeout_ms
        op = DelayedProduce(timeout_ms, waiting, self.partitions.get)
        self.produce_purgatory.try_complete_else_watch(op, waiting)
        outcomes = await _waited(self.produce_purgatory, op, op.done)
        for result in response.partitions:
            # None: the partition did not wait (its append failed, its answer is set).
            outcome = outcomes.get((result.topic, result.partition))
            if outcome is not None and outcome[0] != NO_ERROR:
                result.error_code, result.error_message = outcome
                result.base_offset = -1

    def _produce_error(
        self, data: pb.PartitionProduceData, error: TidewaterError
    ) -> pb.PartitionProduceResponse:
        result = _partition_produce_error(data, error)
        self._fill_current_leader(result, (data.topic, data.partition))
        return result

    # -- fetch ---------------------------------------------------------------------------

    async def fetch(
        self, request: pb.FetchRequest, metadata: Any = None, declared: SpanContext | None = None
    ) -> FetchAnswer:
        """`metadata`: the gRPC call's, where a unary caller's trace context may be;
        `declared`: the sampled-out parent the stream declared (tracing.stream_parent). gRPC
        sends the answer's `serialize()`, a FetchResponse."""
        if not tracing.ENABLED:
            return await self._fetch(request, None, None)
        fetch_trace = FetchTrace.start(request, metadata, declared)
        if fetch_trace is None:
            return await self._fetch(request, None, declared)
        try:
            response = await self._fetch(request, fetch_trace, declared)
        except BaseException as e:
            fetch_trace.abandon(e)
            raise
        fetch_trace.end(response)
        return response

    async def _fetch(
        self,
        request: pb.FetchRequest,
        fetch_trace: FetchTrace | None,
        declared: SpanContext | None,
    ) -> FetchAnswer:
        started = time.perf_counter_ns()
        # A follower's progress is recorded once, on arrival; reads may repeat while it waits.
        follower = self._from_follower(request)
        try:
            if follower:
                # Before the session: a refused fetch must not move the session's epoch.
                self._check_replica_broker_epoch(request)
                if request.forgotten:
                    self._wake_followers(request.replica_id, request.forgotten)
            context = self.fetch_sessions.context(request, self.time_ms())
        except TidewaterError as e:
            return _refused(request, e)
        try:
            return await self._serve_fetch(
                request, context, follower, fetch_trace, declared, started
            )
        except BaseException:
            # A new session whose first answer never went (a cancel, a bug) is one the
            # client never learned of: it would hold a slot until evicted (review 30 #5).
            if context.created:
                self.fetch_sessions.discard(context.session)
            raise

    async def _serve_fetch(
        self,
        request: pb.FetchRequest,
        context: FetchContext,
        follower: bool,
        fetch_trace: FetchTrace | None,
        declared: SpanContext | None,
        started: int,
    ) -> FetchAnswer:
        answered: dict[TopicPartition, pb.FetchPartitionResponse] = {}
        if follower:
            answered, completed = self._record_follower_fetches(
                request.replica_id,
                request.replica_broker_epoch,
                context.partitions,
                # Asked only while a traced batch waits for its followers.
                fetch_link(request, fetch_trace, declared)
                if tracing.ENABLED and self._replication_waits
                else None,
                context.clock,
            )
            if completed:
                # The produces this fetch committed answer first; reading or parking the
                # fetch can wait a turn of the event loop.
                await asyncio.sleep(0)
        # The answer is always the last read's results: its size is what was served.
        size = 0

        def read() -> tuple[FetchPartitionResults, int, bool]:
            nonlocal size
            start_ns = time.time_ns() if fetch_trace is not None else 0
            results, size, answer_now = self._read_partitions(request, context, answered)
            if fetch_trace is not None:
                fetch_trace.read(start_ns, size)
            return results, size, answer_now

        def readable() -> bool:
            return bool(answered) or self._readable(context.partitions, follower)

        def failed(error: Exception) -> FetchPartitionResults:
            context.served.clear()
            unknown = TidewaterError(f"the broker failed serving the fetch: {error!r}")
            return [(self._fetch_error(fp, unknown), b"") for fp in context.partitions]

        # A long poll with nothing to read waits without reading (Kafka's DelayedFetch looks
        # at offsets, not bytes): only a change that makes records readable, or makes a
        # partition answer with an error, costs a read.
        results: FetchPartitionResults | None = None
        # min_bytes 0 is met by nothing at all: answered at once, as Kafka does (review 19 #5).
        if request.max_wait_ms <= 0 or request.min_bytes <= 0 or readable():
            results, _, answer_now = read()
            if request.max_wait_ms > 0 and size < request.min_bytes and not answer_now:
                results = None  # too few bytes yet
        local_done = time.perf_counter_ns()
        if results is None:
            starts: dict[TopicPartition, tuple[int, int] | None] = {}

            def may_answer() -> bool:
                # Review 30 #2: each append or HW move read every partition again while the
                # fetch was short of min_bytes (~N^2/2 batches read for N appended); as
                # Kafka's DelayedFetch, bytes are counted from positions, and read once
                # there may be enough.
                return readable() and (
                    bool(answered)
                    or request.min_bytes <= 1
                    or self._bytes_readable(context.partitions, starts) >= request.min_bytes
                )

            op: DelayedFetch[FetchPartitionResults] = DelayedFetch(
                request.max_wait_ms, request.min_bytes, read, may_answer, failed
            )
            start_ns = time.time_ns() if fetch_trace is not None else 0
            self.fetch_purgatory.watch(op, context.watch_keys)
            results = await _waited(self.fetch_purgatory, op, op.done)
            if fetch_trace is not None:
                fetch_trace.waited(start_ns)
        if fetch_trace is not None:
            fetch_trace.answered(size)
        if self.request_metrics is not None:
            self.request_metrics.fetched(
                follower, started, local_done, time.perf_counter_ns(), size
            )
        return self._fetch_response(request, context, results)

    def _fetch_response(
        self, request: pb.FetchRequest, context: FetchContext, results: FetchPartitionResults
    ) -> FetchAnswer:
        if context.superseded:
            return _refused(
                request,
                InvalidFetchSessionEpoch(
                    f"fetch session {context.session_id} took a later request in while this "
                    f"one (epoch {request.session.epoch}) waited"
                ),
            )
        context.respond([response for response, _ in results])
        header = pb.FetchResponse(
            correlation_id=request.correlation_id, session_id=context.session_id
        )
        return FetchAnswer(header, results)

    @staticmethod
    def _from_follower(request: pb.FetchRequest) -> bool:
        return request.replica_id != CONSUMER_REPLICA_ID

    def _wake_followers(
        self, replica_id: int, forgotten: Iterable[common_pb2.TopicPartition]
    ) -> None:
        """A follower's session forgets these partitions: its fetches no longer count there."""
        for fp in forgotten:
            hosted = self.partitions.get((fp.topic, fp.partition))
            if hosted is not None:
                hosted.state.wake_follower(replica_id)

    def _record_follower_fetches(
        self,
        replica_id: int,
        broker_epoch: int,
        partitions: list[pb.FetchPartition],
        link: Callable[[], SpanContext] | None,
        clock: FetchClock | None,
    ) -> tuple[dict[TopicPartition, pb.FetchPartitionResponse], int]:
        """The leader's side of a follower fetch: fencing, divergence, the follower's LEO,
        ISR expansion, HW. Returns the partitions answered without data (errors, diverging
        epochs), and how many waiting operations the HW moves completed. `link`: the fetch's
        span context for the replication.wait spans it completes, while tracing. `clock`:
        the fetch's session's; the fetch counts for the followers quiet in it at once."""
        answered: dict[TopicPartition, pb.FetchPartitionResponse] = {}
        moved: list[TopicPartition] = []
        now = self.time_ms()
        for fp in partitions:
            tp = (fp.topic, fp.partition)
            try:
                hosted = self._leader_partition(tp, fp.topic_id, fp.current_leader_epoch)
                outcome = hosted.state.on_follower_fetch(
                    FollowerFetch(
                        replica_id=replica_id,
                        fetch_offset=fp.fetch_offset,
                        log_start_offset=fp.log_start_offset,
                        last_fetched_epoch=fp.last_fetched_epoch,
                        current_leader_epoch=fp.current_leader_epoch,
                        broker_epoch=broker_epoch,
                    ),
                    now,
                    clock,
                )
            except TidewaterError as e:
                answered[tp] = self._fetch_error(fp, e)
                continue
            if link is not None:
                self._replication_waits.follower_fetched(
                    tp, replica_id, fp.fetch_offset, hosted.state.high_watermark, link
                )
            if outcome.isr_proposal is not None:
                self.isr_channel.propose(outcome.isr_proposal)
            if outcome.high_watermark_changed:
                moved.append(tp)
            if outcome.diverging_epoch is not None:
                result = pb.FetchPartitionResponse(
                    topic=fp.topic,
                    partition=fp.partition,
                    high_watermark=hosted.state.high_watermark,
                    log_start_offset=hosted.log.log_start_offset,
                    log_end_offset=hosted.log.log_end_offset,
                )
                result.diverging_epoch.epoch, result.diverging_epoch.end_offset = (
                    outcome.diverging_epoch
                )
                answered[tp] = result
        if clock is not None:
            # After the partitions, not before (FetchClock): one named behind the LEO woke
            # with the session's previous fetch's time. Nothing else in the session woke.
            clock.now_ms = now
        completed = 0
        for tp in moved:
            completed += self._partition_changed(tp)
        return answered, completed

    def _fetch_error(
        self, fp: pb.FetchPartition, error: TidewaterError
    ) -> pb.FetchPartitionResponse:
        result = _partition_fetch_error(fp, error)
        self._fill_current_leader(result, (fp.topic, fp.partition))
        return result

    def _read_partitions(
        self,
        request: pb.FetchRequest,
        context: FetchContext,
        answered: dict[TopicPartition, pb.FetchPartitionResponse],
    ) -> tuple[FetchPartitionResults, int, bool]:
        for_follower = self._from_follower(request)
        as_records = request.record_format == pb.RECORD_FORMAT_RECORDS
        # fetch.max.bytes bounds every answer (0 asks for that much): an answer past gRPC's
        # message limit failed on every retry (review 19 #2).
        cap = self.config.fetch_max_bytes
        budget = min(request.max_bytes, cap) if request.max_bytes > 0 else cap
        results: FetchPartitionResults = []
        total = 0
        # What counts towards min_bytes: as Kafka's DelayedFetch, a partition with more to
        # read than its limit let in counts as its limit (review 30 #1: whole batches fall
        # short of it, and a min_bytes of partition_max_bytes, the consumer's 1 MiB, waited
        # max_wait with megabytes to read).
        counted = 0
        # Errors and diverging epochs are answered at once, however few bytes were read.
        answer_now = bool(answered)
        context.served.clear()
        if context.superseded:
            return results, total, True  # refused whole (_fetch_response)
        for fp in context.partitions:
            tp = (fp.topic, fp.partition)
            if tp in answered:
                results.append((answered[tp], b""))
                continue
            try:
                partition = self._leader_partition(tp, fp.topic_id, fp.current_leader_epoch)
                must_read = _must_read(partition, fp.fetch_offset, for_follower)
                high_watermark = partition.state.high_watermark
                if context.unchanged(tp, must_read, high_watermark, partition.log.log_start_offset):
                    # An incremental answer leaves out partitions with no news; until one
                    # comes, it processes them no more, once their follower is quiet too.
                    clock = context.clock
                    if not for_follower or (
                        clock is not None and partition.state.quiet_in(request.replica_id, clock)
                    ):
                        context.settle(tp)
                    continue
                limit = budget - total
                if fp.partition_max_bytes > 0:
                    limit = min(limit, fp.partition_max_bytes)
                read = partition.read(
                    fp.fetch_offset, limit, for_follower=for_follower, min_one_batch=total == 0
                )
                # A batch that does not decode fails this partition (CORRUPT_MESSAGE) only.
                records, size = (
                    _to_proto_records(read.data, fp.fetch_offset, limit, total == 0)
                    if as_records
                    else (None, len(read.data))
                )
            except TidewaterError as e:
                results.append((self._fetch_error(fp, e), b""))
                answer_now = True
                continue
            result = pb.FetchPartitionResponse(
                topic=fp.topic,
                partition=fp.partition,
                high_watermark=read.high_watermark,
                log_start_offset=read.log_start_offset,
                log_end_offset=read.log_end_offset if for_follower else -1,
            )
            total += size
            counted += size
            if read.data:
                context.served.append(tp)
                # A read stops at its segment's end: with more readable after it, a min_bytes
                # it fell short of would wait max_wait for nothing (Kafka's DelayedFetch case
                # F; review 19 #4). Looked at only while short of min_bytes: a follower's
                # fetch with data (min_bytes 1) costs no segment lookups.
                visible_end = read.log_end_offset if for_follower else read.high_watermark
                if not answer_now and counted < request.min_bytes:
                    if partition.log.in_an_older_segment(fp.fetch_offset, visible_end):
                        answer_now = True
                    elif _answered_up_to(read.data, records, fp.fetch_offset) < visible_end:
                        counted += max(limit - size, 0)
            if records is not None:
                result.records.extend(records)
                results.append((result, b""))
            else:
                results.append((result, read.data))
        return results, total, answer_now or counted >= request.min_bytes

    def _bytes_readable(
        self,
        partitions: list[pb.FetchPartition],
        starts: dict[TopicPartition, tuple[int, int] | None],
    ) -> float:
        """At most the bytes a read of `partitions` could count towards min_bytes, from log
        positions (where each fetch offset starts, kept in `starts`): the bytes after it in
        the active segment. Infinite where only a read can tell: an error to answer, an
        offset out of range or in an older segment, a roll since."""
        total = 0
        for fp in partitions:
            tp = (fp.topic, fp.partition)
            try:
                log = self._leader_partition(tp, fp.topic_id, fp.current_leader_epoch).log
            except TidewaterError:
                return math.inf
            if fp.fetch_offset < log.log_start_offset:
                return math.inf
            if tp not in starts:
                starts[tp] = log.bytes_from(fp.fetch_offset)
            start = starts[tp]
            after = log.bytes_after(start) if start is not None else None
            if after is None:
                return math.inf
            total += after
        return total

    def _readable(self, partitions: list[pb.FetchPartition], for_follower: bool) -> bool:
        """Whether a read now would find records, or an error, in any of `partitions`."""
        for fp in partitions:
            try:
                partition = self._leader_partition(
                    (fp.topic, fp.partition), fp.topic_id, fp.current_leader_epoch
                )
            except TidewaterError:
                return True
            if _must_read(partition, fp.fetch_offset, for_follower):
                return True
        return False

    # -- offsets -------------------------------------------------------------------------

    def list_offsets(self, request: pb.ListOffsetsRequest) -> pb.ListOffsetsResponse:
        response = pb.ListOffsetsResponse()
        for lp in request.partitions:
            tp = (lp.topic, lp.partition)
            result = pb.ListOffsetsPartitionResponse(
                topic=lp.topic, partition=lp.partition, offset=-1, timestamp_ms=-1, leader_epoch=-1
            )
            try:
                partition = self._leader_partition(tp, lp.topic_id, lp.current_leader_epoch)
                self._find_offset(partition, lp, request.replica_id, result)
            except TidewaterError as e:
                result.error_code = e.code
                result.error_message = e.message
            response.partitions.append(result)
        return response

    def _find_offset(
        self,
        partition: HostedPartition,
        lp: pb.ListOffsetsPartition,
        replica_id: int,
        result: pb.ListOffsetsPartitionResponse,
    ) -> None:
        if replica_id != CONSUMER_REPLICA_ID and replica_id not in partition.state.replicas:
            # Review 32 #4: a client that left replica_id at proto3's 0 read the LEO, past
            # what is committed, as LATEST.
            raise InvalidRequest(
                f"replica_id {replica_id} is not a replica of {partition.state.name} "
                f"(replicas {list(partition.state.replicas)}): a consumer sends -1"
            )
        # A consumer never learns of offsets beyond the HW: they are not committed yet.
        visible_end = (
            partition.state.high_watermark
            if replica_id == CONSUMER_REPLICA_ID
            else partition.log.log_end_offset
        )
        # A new leader's HW may be behind the one its predecessor answered until it reaches
        # the leader epoch's start: a consumer's end offset could go backwards (review 26 L5;
        # Kafka's OFFSET_NOT_AVAILABLE).
        lagging = (
            replica_id == CONSUMER_REPLICA_ID
            and partition.state.leader_epoch_start_offset > partition.state.high_watermark
        )
        if lp.spec == pb.OFFSET_SPEC_EARLIEST:
            result.offset = partition.log.log_start_offset
        elif lp.spec == pb.OFFSET_SPEC_LATEST:
            if lagging:
                raise _offset_not_available(partition)
            result.offset = visible_end
        elif lp.spec == pb.OFFSET_SPEC_TIMESTAMP:
            found = partition.log.fetch_offset_by_timestamp(lp.timestamp_ms)
            if found is not None and found[0] < visible_end:
                result.offset, result.timestamp_ms = found
            elif lagging:
                raise _offset_not_available(partition)
        else:
            raise InvalidRequest(f"unknown offset spec {lp.spec}")
        if result.offset >= 0:
            result.leader_epoch = partition.log.leader_epoch_cache.epoch_for_offset(result.offset)

    def offset_for_leader_epoch(
        self, request: pb.OffsetForLeaderEpochRequest
    ) -> pb.OffsetForLeaderEpochResponse:
        response = pb.OffsetForLeaderEpochResponse()
        for ep in request.partitions:
            result = pb.OffsetForLeaderEpochPartitionResponse(
                topic=ep.topic, partition=ep.partition, leader_epoch=-1, end_offset=-1
            )
            try:
                partition = self._leader_partition(
                    (ep.topic, ep.partition), ep.topic_id, ep.current_leader_epoch
                )
                result.leader_epoch, result.end_offset = (
                    partition.log.leader_epoch_cache.end_offset_for(
                        ep.leader_epoch, partition.log.log_end_offset
                    )
                )
            except TidewaterError as e:
                result.error_code = e.code
                result.error_message = e.message
            response.partitions.append(result)
        return response

    # -- shared --------------------------------------------------------------------------

    def _leader_partition(
        self, tp: TopicPartition, topic_id: bytes = b"", current_leader_epoch: int = NO_EPOCH
    ) -> HostedPartition:
        """The partition, led here, of the topic `topic_id` names (empty: any), in the
        request's `current_leader_epoch` (KIP-320; NO_EPOCH: any). The epoch is checked
        first, as Kafka does: a client ahead of this replica gets UNKNOWN_LEADER_EPOCH (it
        waits for it to learn), one behind it FENCED_LEADER_EPOCH (it refreshes), even
        where this replica does not lead (review 19 #6)."""
        partition = self.partitions.get(tp)
        if partition is None:
            validate_topic_name(tp[0])  # hosted partitions have valid names
            raise UnknownTopicOrPartition(
                f"broker {self.broker_id} has no partition {tp[0]}-{tp[1]}"
            )
        # One bytes compare, and only for a request that names an id.
        if topic_id and not topic_ids_match(partition.log.topic_id, topic_id):
            raise UnknownTopicId(
                f"broker {self.broker_id} holds {tp[0]}-{tp[1]} of topic id "
                f"{topic_id_text(partition.log.topic_id)}, not {topic_id_text(topic_id)}"
            )
        partition.state.check_current_leader_epoch(current_leader_epoch)
        partition.state.require_leader()
        return partition

    def _fill_current_leader(
        self, result: pb.PartitionProduceResponse | pb.FetchPartitionResponse, tp: TopicPartition
    ) -> None:
        # UNKNOWN_TOPIC_ID: the partition held here is another topic's; its leader unknown.
        state = (
            self._partition_state(tp) if result.error_code != ErrorCode.UNKNOWN_TOPIC_ID else None
        )
        result.current_leader.leader_id = state.leader if state else -1
        result.current_leader.leader_epoch = state.leader_epoch if state else -1

    def _high_watermark(self, tp: TopicPartition) -> int:
        state = self._partition_state(tp)
        return state.high_watermark if state else -1

    def _partition_state(self, tp: TopicPartition) -> Partition | None:
        hosted = self.partitions.get(tp)
        return hosted.state if hosted else None

    def _partition_changed(self, tp: TopicPartition) -> int:
        """Data, HW, log start or role of a partition moved: let waiting operations re-check,
        and fetch sessions where it was quiet process it again. Returns how many completed."""
        sessions = self.fetch_sessions.holding(tp)
        for session in sessions:
            session.clock.unsettled.add(tp)
        completed = self.produce_purgatory.check_and_complete(tp) + (
            self.fetch_purgatory.check_and_complete(tp)
        )
        for session in sessions:
            completed += self.fetch_purgatory.check_and_complete(session.watch_key)
        return completed

    def _log_start_moved(self, tp: TopicPartition) -> None:
        """Retention moved the partition's log start: fetch answers (as leader) and fetches
        (as follower) carry it."""
        hosted = self.partitions.get(tp)
        if hosted is not None:
            hosted.snapshot_if_log_start_passed()
        self._partition_changed(tp)
        self.fetcher_manager.log_start_moved(tp)

    def checkpoint_high_watermarks(self) -> None:
        """Write every partition's HW to its log dir's replication-offset-checkpoint."""
        for log_dir, hws in self._hws_to_checkpoint():
            self._hw_writer.write(log_dir, hws)

    async def checkpoint_high_watermarks_off_loop(self) -> None:
        """checkpoint_high_watermarks with the writes on a worker thread."""
        for log_dir, hws in self._hws_to_checkpoint():
            await self._hw_writer.write_off_loop(log_dir, hws)

    def _hws_to_checkpoint(self) -> list[tuple[Path, dict[TopicPartition, int]]]:
        by_dir: dict[Path, dict[TopicPartition, int]] = {d: {} for d in self.config.log_dirs}
        for tp, partition in self.partitions.items():
            by_dir.setdefault(partition.log.dir.parent, {})[tp] = partition.state.high_watermark
        # The writer skips HWs its file already holds (idle partitions).
        return list(by_dir.items())

    # -- idempotent producers -----------------------------------------------------------------

    def expire_producers(self) -> None:
        """Kafka's PeriodicProducerExpirationCheck, run every
        producer.id.expiration.check.interval.ms: every hosted partition, led or followed,
        forgets its producers idle for producer.id.expiration.ms."""
        now = self.time_ms()
        for hosted in list(self.partitions.values()):
            expired = hosted.producer_state.expire(
                now, self.config.producer_id_expiration_ms, hosted.log.log_end_offset
            )
            if expired:
                log.info(
                    "%s: expired %d producer(s) idle for %d ms",
                    hosted.state.name,
                    expired,
                    self.config.producer_id_expiration_ms,
                )

    # -- ISR ---------------------------------------------------------------------------------

    def maybe_shrink_isrs(self) -> None:
        """Kafka's isr-expiration task, run every replica.lag.time.max.ms / 2. A partition
        whose check fails is logged and skipped: the others' ISRs must still shrink."""
        now = self.time_ms()
        self._recheck_high_watermarks(now)
        for hosted in list(self.partitions.values()):
            try:
                proposal = hosted.state.maybe_shrink_isr(now)
            except Exception:
                log.exception("%s: ISR check failed", hosted.state.name)
                continue
            if proposal is not None:
                log.info(
                    "%s: proposing ISR shrink %s -> %s",
                    hosted.state.name,
                    sorted(hosted.state.isr),
                    list(proposal.new_isr),
                )
                self.isr_channel.propose(proposal)

    def _recheck_high_watermarks(self, now: int) -> None:
        """Led partitions whose HW was held by a follower that no longer holds it (see
        Partition.maybe_increment_high_watermark) commit what the others have."""
        for tp, hosted in list(self.partitions.items()):
            if hosted.state.maybe_increment_high_watermark(now):
                self._partition_changed(tp)

    def _on_alter_isr_result(
        self,
        proposal: AlterIsrProposal,
        committed: LeaderAndIsr | None,
        error: TidewaterError | None,
    ) -> bool:
        """Returns whether the partition still awaits an answer to the proposal."""
        tp = (proposal.topic, proposal.partition)
        state = self._partition_state(tp)
        if state is None:
            return False
        before = len(state.isr)
        isr_state = state.isr_state
        if state.on_alter_isr_result(proposal, committed, error, self.time_ms()):
            self._partition_changed(tp)
        adopted = error is None and committed is not None and state.isr_state is not isr_state
        if adopted and state.partition_epoch == committed.partition_epoch:
            # Adopted: not an answer a newer LeaderAndIsr (or leader epoch) superseded.
            log.info("%s-%d: ISR is now %s, ELR %s", *tp, list(committed.isr), list(committed.elr))
        if len(state.isr) < before:
            self.isr_shrinks += 1
        elif len(state.isr) > before:
            self.isr_expands += 1
        return state.awaits_answer(proposal)

    async def shutdown(self) -> None:
        await self.fetcher_manager.shutdown()
        await self.controller.close()
        self.produce_purgatory.cancel_all()
        self.fetch_purgatory.cancel_all()
        self.checkpoint_high_watermarks()
        for partition in self.partitions.values():
            partition.take_producer_snapshot()


# A compressed batch's records are checked on the event loop when the batch is small (at
# most 16 KiB and 1,024 records, and its records at most 256 KiB: about 2 ms here), else in a
# worker thread, where the codecs release the GIL and the walk over the records gives it up
# every few ms. On the loop, a 2 KiB zstd bomb took 140 ms to reach 64 MiB, a 0.7 MiB batch
# of a million empty records 2.5 s, every other request of the broker waiting (the longest
# gap between the loop's turns fell from 2.5 s to 16 ms in a worker), and a gzip batch of
# 1,000 1 KiB records 10 ms (6 ms).
_INLINE_BATCH_BYTES = 16 * 1024
_INLINE_RECORDS = 1024
_INLINE_SECTION_BYTES = 256 * 1024
# The workers' checks have a thread of their own, one check at a time: the walk holds the
# GIL, so more threads would only contend with each other and the loop, and on the default
# executor 8 large batches at once starved the HW, recovery-point and log-start checkpoints
# and the removal of deleted logs (20 s behind them). A check waits its turn here instead.
_CHECKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-check")


async def _check_compressed_records(
    batch: bytearray, header: BatchHeader, bounds: TimestampBounds
) -> None:
    if len(batch) <= _INLINE_BATCH_BYTES and header.record_count <= _INLINE_RECORDS:
        try:
            check_compressed_records(batch, header, _INLINE_SECTION_BYTES, bounds)
            return
        except DecompressedTooLarge:
            pass  # started again in the worker, with the readers' bound
    try:
        await asyncio.get_running_loop().run_in_executor(
            _CHECKER, check_compressed_records, batch, header, MAX_RECORDS_SECTION_BYTES, bounds
        )
    except DecompressedTooLarge as e:
        # Not corrupt, maybe, but more than the broker reads: Kafka would take it if
        # max.message.bytes allowed its compressed size.
        raise DecompressedTooLarge(
            f"the {len(batch)}-byte batch's records decompress to more than "
            f"{MAX_RECORDS_SECTION_BYTES >> 20} MiB, the most the broker decompresses of one "
            "batch (a bound on zip bombs): send smaller batches"
        ) from e


async def _waited(purgatory: Purgatory, op: DelayedOperation, done: asyncio.Future[T]) -> T:
    """The result of `op`, watched in `purgatory`. When the client has gone (a deadline, a
    disconnect, its stream ended) the waiting task is cancelled, and `op` waits no more: it
    leaves the purgatory at once, without a read (`done` is cancelled with the task)."""
    try:
        return await done
    except asyncio.CancelledError:
        purgatory.cancel(op)
        raise


def produce_failed(request: pb.ProduceRequest, error: Exception) -> pb.ProduceResponse:
    """The answer to a produce whose handling raised (a bug, not an answer):
    UNKNOWN_SERVER_ERROR for each partition, as Kafka answers an unexpected exception with the
    request's error response. Built from the request alone, since the broker's state may be
    what failed (the current leader unknown). A partition's failed append answers alone
    (_append_all): this is for a raise outside the appends, after which batches may be in
    the log, as the message says."""
    unknown = TidewaterError(
        f"the broker failed handling the request: {error!r}; its batches may be in the log"
    )
    return pb.ProduceResponse(
        correlation_id=request.correlation_id,
        partitions=[_partition_produce_error(data, unknown) for data in request.partitions],
    )


def fetch_failed(request: pb.FetchRequest, error: Exception) -> FetchAnswer:
    """The answer to a fetch whose handling raised (a bug): UNKNOWN_SERVER_ERROR for the whole
    fetch and for each partition it names, outside any session (id 0), as Kafka's
    FetchRequest.getErrorResponse; a session's client starts over with a full fetch, since
    the session may have moved on without it. Built from the request alone."""
    unknown = _unknown_server_error(error)
    return _refused(
        request, unknown, [(_partition_fetch_error(fp, unknown), b"") for fp in request.partitions]
    )


def _unknown_server_error(error: Exception) -> TidewaterError:
    return TidewaterError(f"the broker failed handling the request: {error!r}")


# A partition's error answer: these fields unknown (-1), as is the current leader until
# _fill_current_leader sets it.
_PRODUCE_UNKNOWN = ("base_offset", "log_append_time_ms", "log_start_offset")
_FETCH_UNKNOWN = ("high_watermark", "log_start_offset", "log_end_offset")
_LEADER_UNKNOWN = common_pb2.LeaderIdAndEpoch(leader_id=-1, leader_epoch=-1)
PartitionResponse = TypeVar(
    "PartitionResponse", pb.PartitionProduceResponse, pb.FetchPartitionResponse
)


def _partition_error(
    response: type[PartitionResponse],
    unknown: tuple[str, ...],
    request: pb.PartitionProduceData | pb.FetchPartition,
    error: TidewaterError,
) -> PartitionResponse:
    return response(
        topic=request.topic,
        partition=request.partition,
        error_code=error.code,
        error_message=error.message,
        current_leader=_LEADER_UNKNOWN,
        **dict.fromkeys(unknown, -1),
    )


def _partition_produce_error(
    data: pb.PartitionProduceData, error: TidewaterError
) -> pb.PartitionProduceResponse:
    return _partition_error(pb.PartitionProduceResponse, _PRODUCE_UNKNOWN, data, error)


def _partition_fetch_error(
    fp: pb.FetchPartition, error: TidewaterError
) -> pb.FetchPartitionResponse:
    return _partition_error(pb.FetchPartitionResponse, _FETCH_UNKNOWN, fp, error)


def _refused(
    request: pb.FetchRequest, error: TidewaterError, partitions: Sequence[PartitionAnswer] = ()
) -> FetchAnswer:
    """The answer to a fetch refused as a whole: no partitions, unless given."""
    return FetchAnswer(
        pb.FetchResponse(
            correlation_id=request.correlation_id,
            error_code=error.code,
            error_message=error.message,
        ),
        partitions,
    )


def _must_read(partition: HostedPartition, fetch_offset: int, for_follower: bool) -> bool:
    """Whether a read at `fetch_offset` returns records or OFFSET_OUT_OF_RANGE: it does outside
    [end, LEO], the end being the LEO for a follower and the HW for a consumer."""
    log_end_offset = partition.log.log_end_offset
    end = log_end_offset if for_follower else partition.state.high_watermark
    return not end <= fetch_offset <= log_end_offset


def _answered_up_to(
    data: bytes | memoryview, records: list[common_pb2.Record] | None, fetch_offset: int
) -> int:
    """The offset after what a partition's answer carries: its batches', or of plain
    records (which may stop inside the batches read: review 33 #7), the last one's."""
    if records is None:
        return next_offset_after(data)
    return records[-1].offset + 1 if records else fetch_offset


def _to_proto_records(
    data: bytes | memoryview, fetch_offset: int, max_bytes: int, min_one: bool
) -> tuple[list[common_pb2.Record], int]:
    """Decode batches for plain-record fetches, skipping records before the fetch offset, up to
    `max_bytes` of records (at least one when `min_one`: the answer's first data, as for
    batches): decoded, a compressed batch can be many times its stored size (review 19 #3).
    Returns the records and their size."""
    records: list[common_pb2.Record] = []
    size = 0
    for r in decode_batches(data):
        if r.offset < fetch_offset:
            continue
        proto = common_pb2.Record(
            timestamp_ms=r.timestamp_ms, offset=r.offset, leader_epoch=r.leader_epoch
        )
        if r.key is not None:
            proto.key = r.key
        if r.value is not None:
            proto.value = r.value
        for key, value in r.headers:
            header = proto.headers.add(key=key)
            if value is not None:
                header.value = value
        record_size = proto.ByteSize()
        # Review 30 #4: the size counted the record left out, and a partition after the
        # answer's first got one record whatever its size.
        if size + record_size > max_bytes and (records or not min_one):
            break
        size += record_size
        records.append(proto)
    return records, size


def _built_batch(records: list[Record], now_ms: int) -> bytes:
    """A batch of a produce's plain records. Timestamps so far apart that their deltas leave
    int64 are refused (review 32 #5: the encoder's ValueError answered UNKNOWN_SERVER_ERROR)."""
    try:
        return build_batch(records, now_ms=now_ms)
    except ValueError as e:
        raise InvalidTimestamp(f"record timestamps too far apart for one batch: {e}") from None


def _offset_not_available(partition: HostedPartition) -> OffsetNotAvailable:
    state = partition.state
    return OffsetNotAvailable(
        f"{state.name}: the leader's high watermark {state.high_watermark} has not reached "
        f"the start of its leader epoch {state.leader_epoch} ({state.leader_epoch_start_offset})"
        " yet; retry"
    )
