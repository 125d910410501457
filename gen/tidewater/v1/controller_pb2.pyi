from tidewater.v1 import common_pb2 as _common_pb2
from tidewater.v1 import errors_pb2 as _errors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ElectionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ELECTION_TYPE_PREFERRED: _ClassVar[ElectionType]
    ELECTION_TYPE_UNCLEAN: _ClassVar[ElectionType]

class BrokerStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BROKER_STATUS_ALIVE: _ClassVar[BrokerStatus]
    BROKER_STATUS_FENCED: _ClassVar[BrokerStatus]
    BROKER_STATUS_SHUTTING_DOWN: _ClassVar[BrokerStatus]

class ConfigSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONFIG_SOURCE_UNKNOWN: _ClassVar[ConfigSource]
    CONFIG_SOURCE_DYNAMIC_TOPIC_CONFIG: _ClassVar[ConfigSource]
    CONFIG_SOURCE_DEFAULT_CONFIG: _ClassVar[ConfigSource]

class ConfigOperation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONFIG_OPERATION_SET: _ClassVar[ConfigOperation]
    CONFIG_OPERATION_DELETE: _ClassVar[ConfigOperation]
ELECTION_TYPE_PREFERRED: ElectionType
ELECTION_TYPE_UNCLEAN: ElectionType
BROKER_STATUS_ALIVE: BrokerStatus
BROKER_STATUS_FENCED: BrokerStatus
BROKER_STATUS_SHUTTING_DOWN: BrokerStatus
CONFIG_SOURCE_UNKNOWN: ConfigSource
CONFIG_SOURCE_DYNAMIC_TOPIC_CONFIG: ConfigSource
CONFIG_SOURCE_DEFAULT_CONFIG: ConfigSource
CONFIG_OPERATION_SET: ConfigOperation
CONFIG_OPERATION_DELETE: ConfigOperation

class TopicError(_message.Message):
    __slots__ = ("topic", "error_code", "error_message")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    topic: str
    error_code: _errors_pb2.ErrorCode
    error_message: str
    def __init__(self, topic: _Optional[str] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ...) -> None: ...

class RegisterBrokerRequest(_message.Message):
    __slots__ = ("broker", "incarnation_id", "previous_broker_epoch", "min_insync_replicas")
    BROKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MIN_INSYNC_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    broker: _common_pb2.BrokerInfo
    incarnation_id: str
    previous_broker_epoch: int
    min_insync_replicas: int
    def __init__(self, broker: _Optional[_Union[_common_pb2.BrokerInfo, _Mapping]] = ..., incarnation_id: _Optional[str] = ..., previous_broker_epoch: _Optional[int] = ..., min_insync_replicas: _Optional[int] = ...) -> None: ...

class RegisterBrokerResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "broker_epoch")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    broker_epoch: int
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., broker_epoch: _Optional[int] = ...) -> None: ...

class BrokerHeartbeatRequest(_message.Message):
    __slots__ = ("broker_id", "broker_epoch", "want_shutdown")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WANT_SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    broker_id: int
    broker_epoch: int
    want_shutdown: bool
    def __init__(self, broker_id: _Optional[int] = ..., broker_epoch: _Optional[int] = ..., want_shutdown: _Optional[bool] = ...) -> None: ...

class BrokerHeartbeatResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "is_fenced", "should_shut_down")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    IS_FENCED_FIELD_NUMBER: _ClassVar[int]
    SHOULD_SHUT_DOWN_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    is_fenced: bool
    should_shut_down: bool
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., is_fenced: _Optional[bool] = ..., should_shut_down: _Optional[bool] = ...) -> None: ...

class AlterIsrRequest(_message.Message):
    __slots__ = ("broker_id", "broker_epoch", "partitions")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    broker_id: int
    broker_epoch: int
    partitions: _containers.RepeatedCompositeFieldContainer[AlterIsrPartition]
    def __init__(self, broker_id: _Optional[int] = ..., broker_epoch: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[AlterIsrPartition, _Mapping]]] = ...) -> None: ...

class AlterIsrPartition(_message.Message):
    __slots__ = ("topic", "partition", "leader_epoch", "new_isr", "partition_epoch", "new_isr_broker_epochs")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEW_ISR_FIELD_NUMBER: _ClassVar[int]
    PARTITION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEW_ISR_BROKER_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    leader_epoch: int
    new_isr: _containers.RepeatedScalarFieldContainer[int]
    partition_epoch: int
    new_isr_broker_epochs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., new_isr: _Optional[_Iterable[int]] = ..., partition_epoch: _Optional[int] = ..., new_isr_broker_epochs: _Optional[_Iterable[int]] = ...) -> None: ...

class AlterIsrResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "partitions")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    partitions: _containers.RepeatedCompositeFieldContainer[AlterIsrPartitionResponse]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., partitions: _Optional[_Iterable[_Union[AlterIsrPartitionResponse, _Mapping]]] = ...) -> None: ...

class AlterIsrPartitionResponse(_message.Message):
    __slots__ = ("topic", "partition", "error_code", "error_message", "leader", "leader_epoch", "isr", "partition_epoch", "eligible_leader_replicas")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    PARTITION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_LEADER_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    error_code: _errors_pb2.ErrorCode
    error_message: str
    leader: int
    leader_epoch: int
    isr: _containers.RepeatedScalarFieldContainer[int]
    partition_epoch: int
    eligible_leader_replicas: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., leader: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., isr: _Optional[_Iterable[int]] = ..., partition_epoch: _Optional[int] = ..., eligible_leader_replicas: _Optional[_Iterable[int]] = ...) -> None: ...

class ControlledShutdownRequest(_message.Message):
    __slots__ = ("broker_id", "broker_epoch")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    broker_id: int
    broker_epoch: int
    def __init__(self, broker_id: _Optional[int] = ..., broker_epoch: _Optional[int] = ...) -> None: ...

class ControlledShutdownResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "remaining_partitions")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    REMAINING_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    remaining_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., remaining_partitions: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ...) -> None: ...

class AllocateProducerIdsRequest(_message.Message):
    __slots__ = ("broker_id", "broker_epoch")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    broker_id: int
    broker_epoch: int
    def __init__(self, broker_id: _Optional[int] = ..., broker_epoch: _Optional[int] = ...) -> None: ...

class AllocateProducerIdsResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "first_producer_id", "producer_id_count")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    FIRST_PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_COUNT_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    first_producer_id: int
    producer_id_count: int
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., first_producer_id: _Optional[int] = ..., producer_id_count: _Optional[int] = ...) -> None: ...

class CreateTopicsRequest(_message.Message):
    __slots__ = ("topics", "timeout_ms", "validate_only")
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedCompositeFieldContainer[CreatableTopic]
    timeout_ms: int
    validate_only: bool
    def __init__(self, topics: _Optional[_Iterable[_Union[CreatableTopic, _Mapping]]] = ..., timeout_ms: _Optional[int] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class CreatableTopic(_message.Message):
    __slots__ = ("name", "num_partitions", "replication_factor", "assignments", "configs")
    class ConfigsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    CONFIGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_partitions: int
    replication_factor: int
    assignments: _containers.RepeatedCompositeFieldContainer[CreatableReplicaAssignment]
    configs: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., num_partitions: _Optional[int] = ..., replication_factor: _Optional[int] = ..., assignments: _Optional[_Iterable[_Union[CreatableReplicaAssignment, _Mapping]]] = ..., configs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CreatableReplicaAssignment(_message.Message):
    __slots__ = ("partition", "broker_ids")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BROKER_IDS_FIELD_NUMBER: _ClassVar[int]
    partition: int
    broker_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, partition: _Optional[int] = ..., broker_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CreateTopicsResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "topics")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    topics: _containers.RepeatedCompositeFieldContainer[CreatableTopicResult]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., topics: _Optional[_Iterable[_Union[CreatableTopicResult, _Mapping]]] = ...) -> None: ...

class CreatableTopicResult(_message.Message):
    __slots__ = ("name", "error_code", "error_message", "num_partitions", "replication_factor", "topic_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    TOPIC_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    error_code: _errors_pb2.ErrorCode
    error_message: str
    num_partitions: int
    replication_factor: int
    topic_id: bytes
    def __init__(self, name: _Optional[str] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., num_partitions: _Optional[int] = ..., replication_factor: _Optional[int] = ..., topic_id: _Optional[bytes] = ...) -> None: ...

class DeleteTopicsRequest(_message.Message):
    __slots__ = ("topic_names", "timeout_ms")
    TOPIC_NAMES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    topic_names: _containers.RepeatedScalarFieldContainer[str]
    timeout_ms: int
    def __init__(self, topic_names: _Optional[_Iterable[str]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class DeleteTopicsResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "topics")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    topics: _containers.RepeatedCompositeFieldContainer[TopicError]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., topics: _Optional[_Iterable[_Union[TopicError, _Mapping]]] = ...) -> None: ...

class CreatePartitionsRequest(_message.Message):
    __slots__ = ("topics", "timeout_ms", "validate_only")
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedCompositeFieldContainer[CreatePartitionsTopic]
    timeout_ms: int
    validate_only: bool
    def __init__(self, topics: _Optional[_Iterable[_Union[CreatePartitionsTopic, _Mapping]]] = ..., timeout_ms: _Optional[int] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class CreatePartitionsTopic(_message.Message):
    __slots__ = ("name", "count", "assignments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    count: int
    assignments: _containers.RepeatedCompositeFieldContainer[CreatableReplicaAssignment]
    def __init__(self, name: _Optional[str] = ..., count: _Optional[int] = ..., assignments: _Optional[_Iterable[_Union[CreatableReplicaAssignment, _Mapping]]] = ...) -> None: ...

class CreatePartitionsResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "topics")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    topics: _containers.RepeatedCompositeFieldContainer[TopicError]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., topics: _Optional[_Iterable[_Union[TopicError, _Mapping]]] = ...) -> None: ...

class AlterPartitionReassignmentsRequest(_message.Message):
    __slots__ = ("partitions",)
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedCompositeFieldContainer[ReassignablePartition]
    def __init__(self, partitions: _Optional[_Iterable[_Union[ReassignablePartition, _Mapping]]] = ...) -> None: ...

class ReassignablePartition(_message.Message):
    __slots__ = ("topic", "partition", "replicas", "cancel")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    replicas: _containers.RepeatedScalarFieldContainer[int]
    cancel: bool
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., replicas: _Optional[_Iterable[int]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class AlterPartitionReassignmentsResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "partitions")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.PartitionError]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., partitions: _Optional[_Iterable[_Union[_common_pb2.PartitionError, _Mapping]]] = ...) -> None: ...

class ListPartitionReassignmentsRequest(_message.Message):
    __slots__ = ("partitions",)
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    def __init__(self, partitions: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ...) -> None: ...

class ListPartitionReassignmentsResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "reassignments")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    REASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    reassignments: _containers.RepeatedCompositeFieldContainer[OngoingPartitionReassignment]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., reassignments: _Optional[_Iterable[_Union[OngoingPartitionReassignment, _Mapping]]] = ...) -> None: ...

class OngoingPartitionReassignment(_message.Message):
    __slots__ = ("topic", "partition", "replicas", "adding_replicas", "removing_replicas")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ADDING_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REMOVING_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    replicas: _containers.RepeatedScalarFieldContainer[int]
    adding_replicas: _containers.RepeatedScalarFieldContainer[int]
    removing_replicas: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., replicas: _Optional[_Iterable[int]] = ..., adding_replicas: _Optional[_Iterable[int]] = ..., removing_replicas: _Optional[_Iterable[int]] = ...) -> None: ...

class ElectLeadersRequest(_message.Message):
    __slots__ = ("election_type", "partitions", "timeout_ms")
    ELECTION_TYPE_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    election_type: ElectionType
    partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    timeout_ms: int
    def __init__(self, election_type: _Optional[_Union[ElectionType, str]] = ..., partitions: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class ElectLeadersResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "partitions")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.PartitionError]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., partitions: _Optional[_Iterable[_Union[_common_pb2.PartitionError, _Mapping]]] = ...) -> None: ...

class DescribeClusterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeClusterResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "cluster_id", "brokers")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    BROKERS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    cluster_id: str
    brokers: _containers.RepeatedCompositeFieldContainer[BrokerDescription]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., cluster_id: _Optional[str] = ..., brokers: _Optional[_Iterable[_Union[BrokerDescription, _Mapping]]] = ...) -> None: ...

class BrokerDescription(_message.Message):
    __slots__ = ("broker", "broker_epoch", "status")
    BROKER_FIELD_NUMBER: _ClassVar[int]
    BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    broker: _common_pb2.BrokerInfo
    broker_epoch: int
    status: BrokerStatus
    def __init__(self, broker: _Optional[_Union[_common_pb2.BrokerInfo, _Mapping]] = ..., broker_epoch: _Optional[int] = ..., status: _Optional[_Union[BrokerStatus, str]] = ...) -> None: ...

class DescribeConfigsRequest(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topics: _Optional[_Iterable[str]] = ...) -> None: ...

class DescribeConfigsResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "topics")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    topics: _containers.RepeatedCompositeFieldContainer[DescribeConfigsResult]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., topics: _Optional[_Iterable[_Union[DescribeConfigsResult, _Mapping]]] = ...) -> None: ...

class DescribeConfigsResult(_message.Message):
    __slots__ = ("topic", "error_code", "error_message", "configs", "entries")
    class ConfigsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONFIGS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    topic: str
    error_code: _errors_pb2.ErrorCode
    error_message: str
    configs: _containers.ScalarMap[str, str]
    entries: _containers.RepeatedCompositeFieldContainer[DescribeConfigsEntry]
    def __init__(self, topic: _Optional[str] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., configs: _Optional[_Mapping[str, str]] = ..., entries: _Optional[_Iterable[_Union[DescribeConfigsEntry, _Mapping]]] = ...) -> None: ...

class DescribeConfigsEntry(_message.Message):
    __slots__ = ("name", "value", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    source: ConfigSource
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ..., source: _Optional[_Union[ConfigSource, str]] = ...) -> None: ...

class IncrementalAlterConfigsRequest(_message.Message):
    __slots__ = ("topics", "validate_only")
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedCompositeFieldContainer[AlterConfigsTopic]
    validate_only: bool
    def __init__(self, topics: _Optional[_Iterable[_Union[AlterConfigsTopic, _Mapping]]] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class AlterConfigsTopic(_message.Message):
    __slots__ = ("topic", "configs")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    CONFIGS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    configs: _containers.RepeatedCompositeFieldContainer[AlterableConfig]
    def __init__(self, topic: _Optional[str] = ..., configs: _Optional[_Iterable[_Union[AlterableConfig, _Mapping]]] = ...) -> None: ...

class AlterableConfig(_message.Message):
    __slots__ = ("name", "operation", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    operation: ConfigOperation
    value: str
    def __init__(self, name: _Optional[str] = ..., operation: _Optional[_Union[ConfigOperation, str]] = ..., value: _Optional[str] = ...) -> None: ...

class IncrementalAlterConfigsResponse(_message.Message):
    __slots__ = ("error_code", "error_message", "controller", "topics")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    controller: _common_pb2.ControllerInfo
    topics: _containers.RepeatedCompositeFieldContainer[TopicError]
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., controller: _Optional[_Union[_common_pb2.ControllerInfo, _Mapping]] = ..., topics: _Optional[_Iterable[_Union[TopicError, _Mapping]]] = ...) -> None: ...
