from tidewater.v1 import cluster_pb2 as _cluster_pb2
from tidewater.v1 import common_pb2 as _common_pb2
from tidewater.v1 import errors_pb2 as _errors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECORD_FORMAT_BATCHES: _ClassVar[RecordFormat]
    RECORD_FORMAT_RECORDS: _ClassVar[RecordFormat]

class OffsetSpec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OFFSET_SPEC_LATEST: _ClassVar[OffsetSpec]
    OFFSET_SPEC_EARLIEST: _ClassVar[OffsetSpec]
    OFFSET_SPEC_TIMESTAMP: _ClassVar[OffsetSpec]
RECORD_FORMAT_BATCHES: RecordFormat
RECORD_FORMAT_RECORDS: RecordFormat
OFFSET_SPEC_LATEST: OffsetSpec
OFFSET_SPEC_EARLIEST: OffsetSpec
OFFSET_SPEC_TIMESTAMP: OffsetSpec

class ProduceRequest(_message.Message):
    __slots__ = ("acks", "timeout_ms", "partitions", "correlation_id")
    ACKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    acks: int
    timeout_ms: int
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionProduceData]
    correlation_id: int
    def __init__(self, acks: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[PartitionProduceData, _Mapping]]] = ..., correlation_id: _Optional[int] = ...) -> None: ...

class PartitionProduceData(_message.Message):
    __slots__ = ("topic", "partition", "record_batch", "records", "trace_context", "topic_id")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    RECORD_BATCH_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_ID_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    record_batch: bytes
    records: _containers.RepeatedCompositeFieldContainer[_common_pb2.Record]
    trace_context: _containers.ScalarMap[str, str]
    topic_id: bytes
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., record_batch: _Optional[bytes] = ..., records: _Optional[_Iterable[_Union[_common_pb2.Record, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., topic_id: _Optional[bytes] = ...) -> None: ...

class ProduceResponse(_message.Message):
    __slots__ = ("partitions", "correlation_id")
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionProduceResponse]
    correlation_id: int
    def __init__(self, partitions: _Optional[_Iterable[_Union[PartitionProduceResponse, _Mapping]]] = ..., correlation_id: _Optional[int] = ...) -> None: ...

class PartitionProduceResponse(_message.Message):
    __slots__ = ("topic", "partition", "error_code", "error_message", "base_offset", "log_append_time_ms", "log_start_offset", "current_leader")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOG_APPEND_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CURRENT_LEADER_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    error_code: _errors_pb2.ErrorCode
    error_message: str
    base_offset: int
    log_append_time_ms: int
    log_start_offset: int
    current_leader: _common_pb2.LeaderIdAndEpoch
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., base_offset: _Optional[int] = ..., log_append_time_ms: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., current_leader: _Optional[_Union[_common_pb2.LeaderIdAndEpoch, _Mapping]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("replica_id", "replica_broker_epoch", "max_wait_ms", "min_bytes", "max_bytes", "partitions", "record_format", "correlation_id", "trace_context", "session", "forgotten")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    RECORD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    replica_broker_epoch: int
    max_wait_ms: int
    min_bytes: int
    max_bytes: int
    partitions: _containers.RepeatedCompositeFieldContainer[FetchPartition]
    record_format: RecordFormat
    correlation_id: int
    trace_context: _containers.ScalarMap[str, str]
    session: FetchSession
    forgotten: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    def __init__(self, replica_id: _Optional[int] = ..., replica_broker_epoch: _Optional[int] = ..., max_wait_ms: _Optional[int] = ..., min_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[FetchPartition, _Mapping]]] = ..., record_format: _Optional[_Union[RecordFormat, str]] = ..., correlation_id: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., session: _Optional[_Union[FetchSession, _Mapping]] = ..., forgotten: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ...) -> None: ...

class FetchSession(_message.Message):
    __slots__ = ("id", "epoch")
    ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    id: int
    epoch: int
    def __init__(self, id: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class FetchPartition(_message.Message):
    __slots__ = ("topic", "partition", "fetch_offset", "current_leader_epoch", "last_fetched_epoch", "log_start_offset", "partition_max_bytes", "topic_id")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    FETCH_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CURRENT_LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_FETCHED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PARTITION_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOPIC_ID_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    fetch_offset: int
    current_leader_epoch: int
    last_fetched_epoch: int
    log_start_offset: int
    partition_max_bytes: int
    topic_id: bytes
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., fetch_offset: _Optional[int] = ..., current_leader_epoch: _Optional[int] = ..., last_fetched_epoch: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., partition_max_bytes: _Optional[int] = ..., topic_id: _Optional[bytes] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("partitions", "correlation_id", "error_code", "error_message", "session_id")
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedCompositeFieldContainer[FetchPartitionResponse]
    correlation_id: int
    error_code: _errors_pb2.ErrorCode
    error_message: str
    session_id: int
    def __init__(self, partitions: _Optional[_Iterable[_Union[FetchPartitionResponse, _Mapping]]] = ..., correlation_id: _Optional[int] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., session_id: _Optional[int] = ...) -> None: ...

class FetchPartitionResponse(_message.Message):
    __slots__ = ("topic", "partition", "error_code", "error_message", "high_watermark", "log_start_offset", "diverging_epoch", "current_leader", "record_batches", "records", "log_end_offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DIVERGING_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CURRENT_LEADER_FIELD_NUMBER: _ClassVar[int]
    RECORD_BATCHES_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    LOG_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    error_code: _errors_pb2.ErrorCode
    error_message: str
    high_watermark: int
    log_start_offset: int
    diverging_epoch: _common_pb2.EpochEndOffset
    current_leader: _common_pb2.LeaderIdAndEpoch
    record_batches: bytes
    records: _containers.RepeatedCompositeFieldContainer[_common_pb2.Record]
    log_end_offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., high_watermark: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., diverging_epoch: _Optional[_Union[_common_pb2.EpochEndOffset, _Mapping]] = ..., current_leader: _Optional[_Union[_common_pb2.LeaderIdAndEpoch, _Mapping]] = ..., record_batches: _Optional[bytes] = ..., records: _Optional[_Iterable[_Union[_common_pb2.Record, _Mapping]]] = ..., log_end_offset: _Optional[int] = ...) -> None: ...

class ListOffsetsRequest(_message.Message):
    __slots__ = ("replica_id", "partitions")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    partitions: _containers.RepeatedCompositeFieldContainer[ListOffsetsPartition]
    def __init__(self, replica_id: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[ListOffsetsPartition, _Mapping]]] = ...) -> None: ...

class ListOffsetsPartition(_message.Message):
    __slots__ = ("topic", "partition", "current_leader_epoch", "spec", "timestamp_ms", "topic_id")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    CURRENT_LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_ID_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    current_leader_epoch: int
    spec: OffsetSpec
    timestamp_ms: int
    topic_id: bytes
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., current_leader_epoch: _Optional[int] = ..., spec: _Optional[_Union[OffsetSpec, str]] = ..., timestamp_ms: _Optional[int] = ..., topic_id: _Optional[bytes] = ...) -> None: ...

class ListOffsetsResponse(_message.Message):
    __slots__ = ("partitions",)
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedCompositeFieldContainer[ListOffsetsPartitionResponse]
    def __init__(self, partitions: _Optional[_Iterable[_Union[ListOffsetsPartitionResponse, _Mapping]]] = ...) -> None: ...

class ListOffsetsPartitionResponse(_message.Message):
    __slots__ = ("topic", "partition", "error_code", "error_message", "offset", "timestamp_ms", "leader_epoch")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    error_code: _errors_pb2.ErrorCode
    error_message: str
    offset: int
    timestamp_ms: int
    leader_epoch: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., offset: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class OffsetForLeaderEpochRequest(_message.Message):
    __slots__ = ("replica_id", "partitions")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    partitions: _containers.RepeatedCompositeFieldContainer[OffsetForLeaderEpochPartition]
    def __init__(self, replica_id: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[OffsetForLeaderEpochPartition, _Mapping]]] = ...) -> None: ...

class OffsetForLeaderEpochPartition(_message.Message):
    __slots__ = ("topic", "partition", "current_leader_epoch", "leader_epoch", "topic_id")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    CURRENT_LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOPIC_ID_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    current_leader_epoch: int
    leader_epoch: int
    topic_id: bytes
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., current_leader_epoch: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., topic_id: _Optional[bytes] = ...) -> None: ...

class OffsetForLeaderEpochResponse(_message.Message):
    __slots__ = ("partitions",)
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedCompositeFieldContainer[OffsetForLeaderEpochPartitionResponse]
    def __init__(self, partitions: _Optional[_Iterable[_Union[OffsetForLeaderEpochPartitionResponse, _Mapping]]] = ...) -> None: ...

class OffsetForLeaderEpochPartitionResponse(_message.Message):
    __slots__ = ("topic", "partition", "error_code", "error_message", "leader_epoch", "end_offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    error_code: _errors_pb2.ErrorCode
    error_message: str
    leader_epoch: int
    end_offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., leader_epoch: _Optional[int] = ..., end_offset: _Optional[int] = ...) -> None: ...

class InitProducerIdRequest(_message.Message):
    __slots__ = ("producer_id", "producer_epoch")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    producer_epoch: int
    def __init__(self, producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ...) -> None: ...

class InitProducerIdResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "producer_id", "producer_epoch")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    producer_id: int
    producer_epoch: int
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ...) -> None: ...

class LeaderAndIsrRequest(_message.Message):
    __slots__ = ("controller_id", "controller_epoch", "broker_epoch", "partition_states", "live_leaders", "topic_configs")
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PARTITION_STATES_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEADERS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_CONFIGS_FIELD_NUMBER: _ClassVar[int]
    controller_id: int
    controller_epoch: int
    broker_epoch: int
    partition_states: _containers.RepeatedCompositeFieldContainer[LeaderAndIsrPartitionState]
    live_leaders: _containers.RepeatedCompositeFieldContainer[_common_pb2.BrokerInfo]
    topic_configs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicConfig]
    def __init__(self, controller_id: _Optional[int] = ..., controller_epoch: _Optional[int] = ..., broker_epoch: _Optional[int] = ..., partition_states: _Optional[_Iterable[_Union[LeaderAndIsrPartitionState, _Mapping]]] = ..., live_leaders: _Optional[_Iterable[_Union[_common_pb2.BrokerInfo, _Mapping]]] = ..., topic_configs: _Optional[_Iterable[_Union[_common_pb2.TopicConfig, _Mapping]]] = ...) -> None: ...

class LeaderAndIsrPartitionState(_message.Message):
    __slots__ = ("topic", "partition", "controller_epoch", "leader", "leader_epoch", "isr", "partition_epoch", "replicas", "adding_replicas", "removing_replicas", "is_new", "topic_id", "eligible_leader_replicas")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    PARTITION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ADDING_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REMOVING_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    IS_NEW_FIELD_NUMBER: _ClassVar[int]
    TOPIC_ID_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_LEADER_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    controller_epoch: int
    leader: int
    leader_epoch: int
    isr: _containers.RepeatedScalarFieldContainer[int]
    partition_epoch: int
    replicas: _containers.RepeatedScalarFieldContainer[int]
    adding_replicas: _containers.RepeatedScalarFieldContainer[int]
    removing_replicas: _containers.RepeatedScalarFieldContainer[int]
    is_new: bool
    topic_id: bytes
    eligible_leader_replicas: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., controller_epoch: _Optional[int] = ..., leader: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., isr: _Optional[_Iterable[int]] = ..., partition_epoch: _Optional[int] = ..., replicas: _Optional[_Iterable[int]] = ..., adding_replicas: _Optional[_Iterable[int]] = ..., removing_replicas: _Optional[_Iterable[int]] = ..., is_new: _Optional[bool] = ..., topic_id: _Optional[bytes] = ..., eligible_leader_replicas: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaderAndIsrResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "partition_errors")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARTITION_ERRORS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    partition_errors: _containers.RepeatedCompositeFieldContainer[_common_pb2.PartitionError]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., partition_errors: _Optional[_Iterable[_Union[_common_pb2.PartitionError, _Mapping]]] = ...) -> None: ...

class StopReplicaRequest(_message.Message):
    __slots__ = ("controller_id", "controller_epoch", "broker_epoch", "partitions")
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    controller_id: int
    controller_epoch: int
    broker_epoch: int
    partitions: _containers.RepeatedCompositeFieldContainer[StopReplicaPartition]
    def __init__(self, controller_id: _Optional[int] = ..., controller_epoch: _Optional[int] = ..., broker_epoch: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[StopReplicaPartition, _Mapping]]] = ...) -> None: ...

class StopReplicaPartition(_message.Message):
    __slots__ = ("topic", "partition", "leader_epoch", "delete_partition")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DELETE_PARTITION_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    leader_epoch: int
    delete_partition: bool
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., delete_partition: _Optional[bool] = ...) -> None: ...

class StopReplicaResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "partition_errors")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARTITION_ERRORS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    partition_errors: _containers.RepeatedCompositeFieldContainer[_common_pb2.PartitionError]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., partition_errors: _Optional[_Iterable[_Union[_common_pb2.PartitionError, _Mapping]]] = ...) -> None: ...
