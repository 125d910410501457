"""The broker's partitions and the requests that touch them (Kafka's ReplicaManager).

Speaks the protocol's request and response messages; the gRPC layer only moves them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from tidewater.broker.config import BrokerConfig
from tidewater.broker.delayed import DelayedFetch, DelayedProduce, TopicPartition
from tidewater.broker.log.checkpoints import OffsetCheckpoint
from tidewater.broker.log.manager import LogManager
from tidewater.broker.partition import ACKS_ALL, LeaderAndIsrState, Partition
from tidewater.broker.purgatory import Purgatory, Scheduler
from tidewater.broker.topic_config import TopicConfig
from tidewater.errors import (
    InvalidRequest,
    InvalidRequiredAcks,
    StaleControllerEpoch,
    TidewaterError,
    UnknownTopicOrPartition,
)
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.records.validate import validate_batch
from tidewater.topic_names import validate_topic_name
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import common_pb2
from tidewater.v1.errors_pb2 import ErrorCode

log = logging.getLogger(__name__)

HIGH_WATERMARK_CHECKPOINT = "replication-offset-checkpoint"
CONSUMER_REPLICA_ID = -1
FetchPartitionResults = list[pb.FetchPartitionResponse]


class ReplicaManager:
    def __init__(
        self,
        config: BrokerConfig,
        log_manager: LogManager,
        schedule: Scheduler,
        time_ms: Callable[[], int],
    ) -> None:
        self.config = config
        self.broker_id = config.broker_id
        self.log_manager = log_manager
        self.time_ms = time_ms
        self.partitions: dict[TopicPartition, Partition] = {}
        self.controller_epoch = 0
        self.produce_purgatory = Purgatory("Produce", schedule)
        self.fetch_purgatory = Purgatory("Fetch", schedule)
        self._checkpointed_hws: dict[TopicPartition, int] = {}
        for log_dir in config.log_dirs:
            self._checkpointed_hws.update(self._hw_checkpoint(log_dir).read())

    # -- control plane -------------------------------------------------------------------

    def become_leader_or_follower(self, request: pb.LeaderAndIsrRequest) -> pb.LeaderAndIsrResponse:
        """Kafka's becomeLeaderOrFollower: epoch checks, then makeLeader / makeFollower."""
        try:
            self._check_controller_epoch(request.controller_epoch)
        except StaleControllerEpoch as e:
            return pb.LeaderAndIsrResponse(error_code=e.code, error_message=str(e))
        self.controller_epoch = request.controller_epoch
        configs = {tc.topic: dict(tc.configs) for tc in request.topic_configs}
        response = pb.LeaderAndIsrResponse()
        for ps in request.partition_states:
            error = self._apply_partition_state(ps, configs.get(ps.topic, {}))
            response.partition_errors.append(
                common_pb2.PartitionError(
                    topic=ps.topic,
                    partition=ps.partition,
                    error_code=error.code if error else ErrorCode.NONE,
                    error_message=str(error) if error else "",
                )
            )
        return response

    def _apply_partition_state(
        self, ps: pb.LeaderAndIsrPartitionState, topic_props: dict[str, str]
    ) -> TidewaterError | None:
        tp = (ps.topic, ps.partition)
        try:
            validate_topic_name(ps.topic)
            if self.broker_id not in ps.replicas:
                raise UnknownTopicOrPartition(
                    f"broker {self.broker_id} is not a replica of {ps.topic}-{ps.partition} "
                    f"(replicas {list(ps.replicas)})"
                )
            partition = self.partitions.get(tp)
            if partition is not None and ps.leader_epoch <= partition.leader_epoch:
                return TidewaterError(
                    f"{ps.topic}-{ps.partition}: leader epoch {ps.leader_epoch} is not newer "
                    f"than the current {partition.leader_epoch}; ignored",
                    ErrorCode.FENCED_LEADER_EPOCH,
                )
            config = TopicConfig.from_properties({**self.config.topic_defaults, **topic_props})
            if partition is None:
                partition = self._create_partition(tp, config)
            else:
                partition.config = config
            state = LeaderAndIsrState(
                leader=ps.leader,
                leader_epoch=ps.leader_epoch,
                isr=tuple(ps.isr),
                replicas=tuple(ps.replicas),
                partition_epoch=ps.partition_epoch,
                controller_epoch=ps.controller_epoch,
            )
            if ps.leader == self.broker_id:
                partition.make_leader(state)
                log.info(
                    "became leader of %s-%d at epoch %d, LEO %d, HW %d",
                    *tp,
                    ps.leader_epoch,
                    partition.log.log_end_offset,
                    partition.high_watermark,
                )
            else:
                partition.make_follower(state)
                log.info("became follower of %s-%d at epoch %d", *tp, ps.leader_epoch)
            self._partition_changed(tp)
        except TidewaterError as e:
            return e
        return None

    def _create_partition(self, tp: TopicPartition, config: TopicConfig) -> Partition:
        log_ = self.log_manager.get_or_create_log(tp[0], tp[1], config.log)
        partition = Partition(
            topic=tp[0],
            partition=tp[1],
            local_broker_id=self.broker_id,
            log=log_,
            config=config,
            checkpointed_high_watermark=self._checkpointed_hws.get(tp, 0),
        )
        self.partitions[tp] = partition
        return partition

    def stop_replica(self, request: pb.StopReplicaRequest) -> pb.StopReplicaResponse:
        try:
            self._check_controller_epoch(request.controller_epoch)
        except StaleControllerEpoch as e:
            return pb.StopReplicaResponse(error_code=e.code, error_message=str(e))
        self.controller_epoch = request.controller_epoch
        response = pb.StopReplicaResponse()
        for sp in request.partitions:
            tp = (sp.topic, sp.partition)
            partition = self.partitions.pop(tp, None)
            if partition is not None:
                # Leadership is gone: waiting produces and fetches answer now.
                self._partition_changed(tp)
            if sp.delete_partition and self.log_manager.get_log(*tp) is not None:
                self.log_manager.delete_log(*tp)
                self._checkpointed_hws.pop(tp, None)
            response.partition_errors.append(
                common_pb2.PartitionError(topic=sp.topic, partition=sp.partition)
            )
        return response

    def _check_controller_epoch(self, controller_epoch: int) -> None:
        if controller_epoch < self.controller_epoch:
            raise StaleControllerEpoch(
                f"controller epoch {controller_epoch} is older than {self.controller_epoch}, "
                "the newest this broker has seen"
            )

    # -- produce -------------------------------------------------------------------------

    async def produce(self, request: pb.ProduceRequest) -> pb.ProduceResponse:
        response = pb.ProduceResponse(correlation_id=request.correlation_id)
        if request.acks not in (0, 1, ACKS_ALL):
            error = InvalidRequiredAcks(f"acks must be 0, 1 or -1, got {request.acks}")
            for data in request.partitions:
                response.partitions.append(self._produce_error(data, error))
            return response
        waiting: dict[TopicPartition, int] = {}
        for data in request.partitions:
            tp = (data.topic, data.partition)
            try:
                partition = self._leader_partition(tp)
                batch = self._batch_of(data, partition.config.log.max_message_bytes)
                info = partition.append_as_leader(batch, request.acks)
            except TidewaterError as e:
                response.partitions.append(self._produce_error(data, e))
                continue
            response.partitions.append(
                pb.PartitionProduceResponse(
                    topic=data.topic,
                    partition=data.partition,
                    base_offset=info.first_offset,
                    log_append_time_ms=-1,
                    log_start_offset=partition.log.log_start_offset,
                )
            )
            self._partition_changed(tp)
            if request.acks == ACKS_ALL:
                waiting[tp] = info.last_offset + 1
        if waiting:
            await self._await_replication(request, response, waiting)
        return response

    def _batch_of(self, data: pb.PartitionProduceData, max_message_bytes: int) -> bytearray:
        if data.record_batch and data.records:
            raise InvalidRequest("set either record_batch or records, not both")
        if data.records:
            raw = build_batch(
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
                now_ms=self.time_ms(),
            )
        elif data.record_batch:
            raw = data.record_batch
        else:
            raise InvalidRequest("no records: set record_batch or records")
        validate_batch(raw, max_message_bytes)
        return bytearray(raw)

    async def _await_replication(
        self,
        request: pb.ProduceRequest,
        response: pb.ProduceResponse,
        waiting: dict[TopicPartition, int],
    ) -> None:
        timeout_ms = request.timeout_ms or self.config.request_timeout_ms
        op = DelayedProduce(timeout_ms, waiting, self.partitions.get)
        self.produce_purgatory.try_complete_else_watch(op, waiting)
        outcomes = await op.done
        for result in response.partitions:
            code, message = outcomes.get((result.topic, result.partition), (ErrorCode.NONE, ""))
            if code != ErrorCode.NONE:
                result.error_code = code
                result.error_message = message
                result.base_offset = -1

    def _produce_error(
        self, data: pb.PartitionProduceData, error: TidewaterError
    ) -> pb.PartitionProduceResponse:
        result = pb.PartitionProduceResponse(
            topic=data.topic,
            partition=data.partition,
            error_code=error.code,
            error_message=str(error),
            base_offset=-1,
            log_append_time_ms=-1,
            log_start_offset=-1,
        )
        self._fill_current_leader(result, (data.topic, data.partition))
        return result

    # -- fetch ---------------------------------------------------------------------------

    async def fetch(self, request: pb.FetchRequest) -> pb.FetchResponse:
        def read() -> tuple[FetchPartitionResults, int, bool]:
            return self._read_partitions(request)

        results, size, failed = read()
        if request.max_wait_ms <= 0 or size >= max(request.min_bytes, 1) or failed:
            return self._fetch_response(request, results)
        op: DelayedFetch[FetchPartitionResults] = DelayedFetch(
            request.max_wait_ms, request.min_bytes, read
        )
        keys = [(fp.topic, fp.partition) for fp in request.partitions]
        self.fetch_purgatory.try_complete_else_watch(op, keys)
        return self._fetch_response(request, await op.done)

    def _fetch_response(
        self, request: pb.FetchRequest, results: FetchPartitionResults
    ) -> pb.FetchResponse:
        response = pb.FetchResponse(correlation_id=request.correlation_id)
        response.partitions.extend(results)
        return response

    def _read_partitions(self, request: pb.FetchRequest) -> tuple[FetchPartitionResults, int, bool]:
        for_follower = request.replica_id != CONSUMER_REPLICA_ID
        as_records = request.record_format == pb.RECORD_FORMAT_RECORDS
        budget = request.max_bytes if request.max_bytes > 0 else 1 << 62
        results: FetchPartitionResults = []
        total = 0
        failed = False
        for fp in request.partitions:
            tp = (fp.topic, fp.partition)
            result = pb.FetchPartitionResponse(topic=fp.topic, partition=fp.partition)
            try:
                partition = self._leader_partition(tp)
                partition.check_current_leader_epoch(fp.current_leader_epoch)
                limit = budget - total
                if fp.partition_max_bytes > 0:
                    limit = min(limit, fp.partition_max_bytes)
                read = partition.read(
                    fp.fetch_offset, limit, for_follower=for_follower, min_one_batch=total == 0
                )
            except TidewaterError as e:
                result.error_code = e.code
                result.error_message = str(e)
                result.high_watermark = result.log_start_offset = result.log_end_offset = -1
                self._fill_current_leader(result, tp)
                failed = True
                results.append(result)
                continue
            total += len(read.data)
            result.high_watermark = read.high_watermark
            result.log_start_offset = read.log_start_offset
            result.log_end_offset = read.log_end_offset if for_follower else -1
            if as_records:
                result.records.extend(_to_proto_records(read.data, fp.fetch_offset))
            else:
                result.record_batches = read.data
            results.append(result)
        return results, total, failed

    # -- offsets -------------------------------------------------------------------------

    def list_offsets(self, request: pb.ListOffsetsRequest) -> pb.ListOffsetsResponse:
        response = pb.ListOffsetsResponse()
        for lp in request.partitions:
            tp = (lp.topic, lp.partition)
            result = pb.ListOffsetsPartitionResponse(
                topic=lp.topic, partition=lp.partition, offset=-1, timestamp_ms=-1, leader_epoch=-1
            )
            try:
                partition = self._leader_partition(tp)
                partition.check_current_leader_epoch(lp.current_leader_epoch)
                self._find_offset(partition, lp, request.replica_id, result)
            except TidewaterError as e:
                result.error_code = e.code
                result.error_message = str(e)
            response.partitions.append(result)
        return response

    def _find_offset(
        self,
        partition: Partition,
        lp: pb.ListOffsetsPartition,
        replica_id: int,
        result: pb.ListOffsetsPartitionResponse,
    ) -> None:
        # A consumer never learns of offsets beyond the HW: they are not committed yet.
        visible_end = (
            partition.high_watermark
            if replica_id == CONSUMER_REPLICA_ID
            else partition.log.log_end_offset
        )
        if lp.spec == pb.OFFSET_SPEC_EARLIEST:
            result.offset = partition.log.log_start_offset
        elif lp.spec == pb.OFFSET_SPEC_LATEST:
            result.offset = visible_end
        elif lp.spec == pb.OFFSET_SPEC_TIMESTAMP:
            found = partition.log.fetch_offset_by_timestamp(lp.timestamp_ms)
            if found is not None and found[0] < visible_end:
                result.offset, result.timestamp_ms = found
        else:
            raise InvalidRequest(f"unknown offset spec {lp.spec}")
        if result.offset >= 0:
            result.leader_epoch = partition.epoch_cache.epoch_for_offset(result.offset)

    def offset_for_leader_epoch(
        self, request: pb.OffsetForLeaderEpochRequest
    ) -> pb.OffsetForLeaderEpochResponse:
        response = pb.OffsetForLeaderEpochResponse()
        for ep in request.partitions:
            result = pb.OffsetForLeaderEpochPartitionResponse(
                topic=ep.topic, partition=ep.partition, leader_epoch=-1, end_offset=-1
            )
            try:
                partition = self._leader_partition((ep.topic, ep.partition))
                partition.check_current_leader_epoch(ep.current_leader_epoch)
                result.leader_epoch, result.end_offset = partition.epoch_cache.end_offset_for(
                    ep.leader_epoch, partition.log.log_end_offset
                )
            except TidewaterError as e:
                result.error_code = e.code
                result.error_message = str(e)
            response.partitions.append(result)
        return response

    # -- shared --------------------------------------------------------------------------

    def _leader_partition(self, tp: TopicPartition) -> Partition:
        validate_topic_name(tp[0])
        partition = self.partitions.get(tp)
        if partition is None:
            raise UnknownTopicOrPartition(
                f"broker {self.broker_id} has no partition {tp[0]}-{tp[1]}"
            )
        partition.require_leader()
        return partition

    def _fill_current_leader(
        self, result: pb.PartitionProduceResponse | pb.FetchPartitionResponse, tp: TopicPartition
    ) -> None:
        partition = self.partitions.get(tp)
        result.current_leader.leader_id = partition.leader if partition else -1
        result.current_leader.leader_epoch = partition.leader_epoch if partition else -1

    def _partition_changed(self, tp: TopicPartition) -> None:
        """Data, HW or role of a partition moved: let waiting operations re-check."""
        self.produce_purgatory.check_and_complete(tp)
        self.fetch_purgatory.check_and_complete(tp)

    def _hw_checkpoint(self, log_dir: Path) -> OffsetCheckpoint:
        return OffsetCheckpoint(log_dir / HIGH_WATERMARK_CHECKPOINT)

    def checkpoint_high_watermarks(self) -> None:
        """Write every partition's HW to its log dir's replication-offset-checkpoint."""
        by_dir: dict[Path, dict[TopicPartition, int]] = {d: {} for d in self.config.log_dirs}
        for tp, partition in self.partitions.items():
            by_dir.setdefault(partition.log.dir.parent, {})[tp] = partition.high_watermark
        for log_dir, hws in by_dir.items():
            self._hw_checkpoint(log_dir).write(hws)

    def shutdown(self) -> None:
        self.produce_purgatory.cancel_all()
        self.fetch_purgatory.cancel_all()
        self.checkpoint_high_watermarks()


def _to_proto_records(data: bytes, fetch_offset: int) -> list[common_pb2.Record]:
    """Decode batches for plain-record fetches, skipping records before the fetch offset."""
    records = []
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
        records.append(proto)
    return records
