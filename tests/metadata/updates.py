"""UpdateMetadata requests as a controller pushes them, for the metadata tests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tidewater.v1 import cluster_pb2, common_pb2

FULL = cluster_pb2.UPDATE_METADATA_TYPE_FULL
DELTA = cluster_pb2.UPDATE_METADATA_TYPE_DELTA


def state(
    topic: str,
    partition: int,
    leader: int = 1,
    replicas: Sequence[int] = (1, 2, 3),
    isr: Sequence[int] | None = None,
    offline: Sequence[int] = (),
    leader_epoch: int = 0,
    topic_id: bytes = b"",
) -> cluster_pb2.UpdateMetadataPartitionState:
    return cluster_pb2.UpdateMetadataPartitionState(
        topic=topic,
        topic_id=topic_id,
        partition=partition,
        leader=leader,
        leader_epoch=leader_epoch,
        replicas=replicas,
        isr=replicas if isr is None else isr,
        offline_replicas=offline,
    )


def update(
    kind: int,
    epoch: int,
    states: Iterable[cluster_pb2.UpdateMetadataPartitionState] = (),
    brokers: Iterable[int] = (1, 2, 3),
    deleted: Iterable[str] = (),
    controller_id: int = 7,
) -> cluster_pb2.UpdateMetadataRequest:
    return cluster_pb2.UpdateMetadataRequest(
        controller_id=controller_id,
        controller_epoch=epoch,
        type=kind,
        live_brokers=[
            common_pb2.BrokerInfo(
                broker_id=b, endpoint=common_pb2.Endpoint(host="10.0.0.1", port=9000 + b)
            )
            for b in brokers
        ],
        partition_states=states,
        deleted_topics=deleted,
        controller_endpoint=common_pb2.Endpoint(host="10.0.0.9", port=9093),
    )
