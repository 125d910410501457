"""Which of a broker's logs are stray: on its disk, but no longer its per the controller's
whole view of the cluster (Kafka 3.7's stray logs, KAFKA-14616).

A broker holds such a log when it was down as a reassignment moved the partition away: the
StopReplica meant for its old incarnation is dropped when that one is fenced. It may even
still host the partition, when that StopReplica was lost while it stayed up (the controller
failed over before sending it, or fenced the broker for a missed session and resumed it): a
removed leader would go on leading in its old epoch, serving stale reads and taking acks=1
writes nobody replicates. The rule is pure; the replica manager applies it to each FULL
UpdateMetadata (stopping a hosted one as a StopReplica would), and the log manager renames
what it finds and deletes it after file.delete.delay.ms. Losing data is far worse than
leaking disk, so anything the view cannot vouch for stays; and a log whose whole topic the
view does not know is renamed out of the way but kept (`orphaned`): a topic deleted while
this broker was down waits on it in `deleting_topics` instead, so no topic should be missing
but from a controller that lost its etcd (review 37 #1: an emptied etcd's controller had a
restarted broker delete every log it held).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tidewater.v1 import cluster_pb2

TopicPartition = tuple[str, int]


@dataclass(frozen=True)
class ClusterView:
    """What the stray rule reads from an UpdateMetadata request."""

    full: bool
    controller_epoch: int
    # The incarnation of the recipient the controller meant it for; 0: none named.
    broker_epoch: int
    # Every partition the controller has a LeaderAndIsr for → its assigned replicas (during a
    # reassignment, targets and originals), and its leader epoch.
    replicas: Mapping[TopicPartition, tuple[int, ...]]
    leader_epochs: Mapping[TopicPartition, int]
    # Deleted topics whose logs a StopReplica(delete) to this broker is to delete.
    deleting_topics: frozenset[str]

    @classmethod
    def of(cls, request: cluster_pb2.UpdateMetadataRequest) -> ClusterView:
        states = request.partition_states
        return cls(
            full=request.type == cluster_pb2.UPDATE_METADATA_TYPE_FULL,
            controller_epoch=request.controller_epoch,
            broker_epoch=request.broker_epoch,
            replicas={(s.topic, s.partition): tuple(s.replicas) for s in states},
            leader_epochs={(s.topic, s.partition): s.leader_epoch for s in states},
            deleting_topics=frozenset(request.deleting_topics),
        )


def find_stray_logs(
    local: Iterable[TopicPartition],
    view: ClusterView,
    hosted: Mapping[TopicPartition, int],
    broker_id: int,
    broker_epoch: int,
    controller_epoch: int,
) -> dict[TopicPartition, str]:
    """The local logs that are stray per `view`, each with why. `hosted`: partitions this
    broker was told about by LeaderAndIsr, with the leader epoch it has; `broker_epoch`: its
    own (0 before it registered); `controller_epoch`: the newest it has seen.

    Only a FULL view names every partition, from a controller epoch no older than the newest
    seen, and meant for this incarnation (a deposed controller's queue, or a tool's request,
    decides nothing). A log is stray when its topic is not in the view, or its partition is
    not, or is assigned to other brokers: the controller sends LeaderAndIsr only for the
    partitions in its view, so no such log holds anything the cluster counts on. A hosted
    partition only when the view assigns it to other brokers in a newer leader epoch than the
    hosted one (its LeaderAndIsr may be newer than the view); never a topic whose deletion
    waits on this broker (its StopReplica(delete) deletes it and confirms)."""
    if (
        not view.full
        or view.controller_epoch < controller_epoch
        or not broker_epoch
        or view.broker_epoch != broker_epoch
    ):
        return {}
    topics = {topic for topic, _ in view.replicas}
    where = f"controller epoch {view.controller_epoch}'s view"
    stray: dict[TopicPartition, str] = {}
    for tp in sorted(local):
        if tp[0] in view.deleting_topics:
            continue
        replicas = view.replicas.get(tp)
        if tp in hosted:
            epoch = view.leader_epochs.get(tp, -1)
            if replicas is not None and broker_id not in replicas and epoch > hosted[tp]:
                stray[tp] = (
                    f"its replicas in {where} are {list(replicas)}, not broker {broker_id}, "
                    f"in leader epoch {epoch} (hosted in {hosted[tp]})"
                )
        elif tp[0] not in topics:
            stray[tp] = f"topic {tp[0]} is not in {where}"
        elif replicas is None:
            stray[tp] = f"partition {tp[1]} of {tp[0]} is not in {where}"
        elif broker_id not in replicas:
            stray[tp] = f"its replicas in {where} are {list(replicas)}, not broker {broker_id}"
    return stray


def orphaned(strays: Iterable[TopicPartition], view: ClusterView) -> set[TopicPartition]:
    """The strays whose topic the view does not know at all: kept, not deleted."""
    topics = {topic for topic, _ in view.replicas}
    return {tp for tp in strays if tp[0] not in topics}
