"""The cluster view a metadata service serves: what the active controller last pushed with
UpdateMetadata (Kafka's MetadataCache), described to clients as GetMetadataResponse."""

from __future__ import annotations

from collections.abc import Iterable

from tidewater.errors import InvalidRequest, StaleControllerEpoch, TidewaterError
from tidewater.topic_names import validate_topic_name
from tidewater.v1 import cluster_pb2, common_pb2, metadata_pb2
from tidewater.v1.errors_pb2 import ErrorCode

PartitionState = cluster_pb2.UpdateMetadataPartitionState


class MetadataCache:
    """Live brokers and partition states, replaced by a FULL request and amended by a DELTA.

    Not thread-safe and not async: each call runs to completion, so a request is applied
    whole or not at all."""

    def __init__(self) -> None:
        # The newest controller epoch seen, even in a refused request: it fences the older
        # controllers at once, before the new one's FULL view arrives.
        self._newest_controller_epoch = -1
        # The controller epoch of the FULL view the current state builds on; None until one.
        self._full_view_epoch: int | None = None
        self._controller = common_pb2.ControllerInfo(controller_id=-1, controller_epoch=-1)
        self._brokers: dict[int, common_pb2.BrokerInfo] = {}
        self._topics: dict[str, dict[int, PartitionState]] = {}

    @property
    def ready(self) -> bool:
        """Whether a FULL view has been applied (from any controller epoch)."""
        return self._full_view_epoch is not None

    @property
    def controller_epoch(self) -> int:
        """The newest controller epoch seen; -1 before any request."""
        return self._newest_controller_epoch

    @property
    def broker_count(self) -> int:
        return len(self._brokers)

    @property
    def partition_count(self) -> int:
        return sum(len(partitions) for partitions in self._topics.values())

    def apply(self, request: cluster_pb2.UpdateMetadataRequest) -> None:
        """Apply an UpdateMetadata request, or raise and change nothing but the newest
        controller epoch seen. Topic configs are not kept: GetMetadata does not serve them."""
        epoch = request.controller_epoch
        if epoch < self._newest_controller_epoch:
            raise StaleControllerEpoch(
                f"controller epoch {epoch} is older than {self._newest_controller_epoch}, "
                "the newest this metadata service has seen"
            )
        self._newest_controller_epoch = epoch
        full = request.type == cluster_pb2.UPDATE_METADATA_TYPE_FULL
        _check_consistent(request, full)
        if not full and self._full_view_epoch != epoch:
            held = (
                "none" if self._full_view_epoch is None else f"one of epoch {self._full_view_epoch}"
            )
            raise TidewaterError(
                f"a DELTA of controller epoch {epoch} needs a FULL view of that epoch first; "
                f"this metadata service holds {held}",
                ErrorCode.INVALID_UPDATE_VERSION,
            )
        if full:
            self._topics = {}
            self._full_view_epoch = epoch
        for topic in request.deleted_topics:
            self._topics.pop(topic, None)
        for state in request.partition_states:
            partitions = self._topics.setdefault(state.topic, {})
            held = next(iter(partitions.values()), None)
            if held is not None and held.topic_id != state.topic_id:
                partitions.clear()  # another topic of that name: none of its partitions stay
            partitions[state.partition] = state
        self._brokers = {broker.broker_id: broker for broker in request.live_brokers}
        self._controller = common_pb2.ControllerInfo(
            controller_id=request.controller_id,
            endpoint=request.controller_endpoint
            if request.HasField("controller_endpoint")
            else None,
            controller_epoch=epoch,
        )

    def describe(
        self, topics: Iterable[str] = (), no_topics: bool = False
    ) -> metadata_pb2.GetMetadataResponse:
        """The named topics in request order, each once; every topic by name when none, and
        none with `no_topics`."""
        response = metadata_pb2.GetMetadataResponse(
            controller=self._controller,
            brokers=[self._brokers[b] for b in sorted(self._brokers)],
        )
        if no_topics:
            return response
        names = list(dict.fromkeys(topics)) or sorted(self._topics)
        response.topics.extend(self._describe_topic(name) for name in names)
        return response

    def _describe_topic(self, name: str) -> metadata_pb2.TopicMetadata:
        try:
            validate_topic_name(name)
        except TidewaterError as e:
            return metadata_pb2.TopicMetadata(
                topic=name, error_code=e.code, error_message=e.args[0]
            )
        partitions = self._topics.get(name)
        if partitions is None:
            return metadata_pb2.TopicMetadata(
                topic=name,
                error_code=ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
                error_message=f"topic {name!r} does not exist in this cluster view",
            )
        return metadata_pb2.TopicMetadata(
            topic=name,
            partitions=[self._describe_partition(partitions[p]) for p in sorted(partitions)],
            topic_id=next(iter(partitions.values())).topic_id,
        )

    def _describe_partition(self, state: PartitionState) -> metadata_pb2.PartitionMetadata:
        # Offline: not in the live list as the last view has it (a DELTA replaces the brokers
        # only). Not what the partition's state last said: a broker back since stayed offline
        # there until its next change (review 20 M1: every partition, after a failover).
        offline = [r for r in state.replicas if r not in self._brokers]
        partition = metadata_pb2.PartitionMetadata(
            partition=state.partition,
            leader=state.leader,
            leader_epoch=state.leader_epoch,
            replicas=state.replicas,
            isr=state.isr,
            offline_replicas=offline,
            eligible_leader_replicas=state.eligible_leader_replicas,
            last_known_elr=state.last_known_elr,
            partition_epoch=state.partition_epoch,
        )
        if state.leader not in self._brokers:
            # As Kafka: a leader that is not live is no leader to a client.
            partition.leader = -1
            partition.error_code = ErrorCode.LEADER_NOT_AVAILABLE
            partition.error_message = (
                "the partition has no leader"
                if state.leader < 0
                else f"leader broker {state.leader} is not live"
            )
        elif offline:
            partition.error_code = ErrorCode.REPLICA_NOT_AVAILABLE
            partition.error_message = f"replicas {offline} are offline"
        return partition


def _check_consistent(request: cluster_pb2.UpdateMetadataRequest, full: bool) -> None:
    if not request.deleted_topics:
        return
    if full:
        raise InvalidRequest("a FULL update cannot name deleted topics")
    both = set(request.deleted_topics) & {s.topic for s in request.partition_states}
    if both:
        raise InvalidRequest(f"topics {sorted(both)} are both deleted and updated")
