from tidewater.v1 import common_pb2 as _common_pb2
from tidewater.v1 import errors_pb2 as _errors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateMetadataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_METADATA_TYPE_DELTA: _ClassVar[UpdateMetadataType]
    UPDATE_METADATA_TYPE_FULL: _ClassVar[UpdateMetadataType]
UPDATE_METADATA_TYPE_DELTA: UpdateMetadataType
UPDATE_METADATA_TYPE_FULL: UpdateMetadataType

class UpdateMetadataRequest(_message.Message):
    __slots__ = ("controller_id", "controller_epoch", "broker_epoch", "type", "live_brokers", "partition_states", "deleted_topics", "topic_configs", "controller_endpoint", "deleting_topics")
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BROKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    LIVE_BROKERS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_STATES_FIELD_NUMBER: _ClassVar[int]
    DELETED_TOPICS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_CONFIGS_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DELETING_TOPICS_FIELD_NUMBER: _ClassVar[int]
    controller_id: int
    controller_epoch: int
    broker_epoch: int
    type: UpdateMetadataType
    live_brokers: _containers.RepeatedCompositeFieldContainer[_common_pb2.BrokerInfo]
    partition_states: _containers.RepeatedCompositeFieldContainer[UpdateMetadataPartitionState]
    deleted_topics: _containers.RepeatedScalarFieldContainer[str]
    topic_configs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicConfig]
    controller_endpoint: _common_pb2.Endpoint
    deleting_topics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, controller_id: _Optional[int] = ..., controller_epoch: _Optional[int] = ..., broker_epoch: _Optional[int] = ..., type: _Optional[_Union[UpdateMetadataType, str]] = ..., live_brokers: _Optional[_Iterable[_Union[_common_pb2.BrokerInfo, _Mapping]]] = ..., partition_states: _Optional[_Iterable[_Union[UpdateMetadataPartitionState, _Mapping]]] = ..., deleted_topics: _Optional[_Iterable[str]] = ..., topic_configs: _Optional[_Iterable[_Union[_common_pb2.TopicConfig, _Mapping]]] = ..., controller_endpoint: _Optional[_Union[_common_pb2.Endpoint, _Mapping]] = ..., deleting_topics: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateMetadataPartitionState(_message.Message):
    __slots__ = ("topic", "partition", "controller_epoch", "leader", "leader_epoch", "isr", "partition_epoch", "replicas", "offline_replicas", "topic_id", "eligible_leader_replicas", "last_known_elr")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    PARTITION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_ID_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_LEADER_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LAST_KNOWN_ELR_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    controller_epoch: int
    leader: int
    leader_epoch: int
    isr: _containers.RepeatedScalarFieldContainer[int]
    partition_epoch: int
    replicas: _containers.RepeatedScalarFieldContainer[int]
    offline_replicas: _containers.RepeatedScalarFieldContainer[int]
    topic_id: bytes
    eligible_leader_replicas: _containers.RepeatedScalarFieldContainer[int]
    last_known_elr: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., controller_epoch: _Optional[int] = ..., leader: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., isr: _Optional[_Iterable[int]] = ..., partition_epoch: _Optional[int] = ..., replicas: _Optional[_Iterable[int]] = ..., offline_replicas: _Optional[_Iterable[int]] = ..., topic_id: _Optional[bytes] = ..., eligible_leader_replicas: _Optional[_Iterable[int]] = ..., last_known_elr: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateMetadataResponse(_message.Message):
    __slots__ = ("error_code", "error_message")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ...) -> None: ...
