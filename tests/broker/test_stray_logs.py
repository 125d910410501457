"""The stray log rule: which local logs a FULL view of the cluster says are no longer this
broker's, and every case where it must keep one."""

from __future__ import annotations

import pytest

from tidewater.broker.stray_logs import ClusterView, find_stray_logs, orphaned
from tidewater.v1 import cluster_pb2

BROKER = 3
EPOCH = 40  # this broker's epoch
CONTROLLER_EPOCH = 7


def view(
    replicas: dict[tuple[str, int], tuple[int, ...]],
    *,
    full: bool = True,
    controller_epoch: int = CONTROLLER_EPOCH,
    broker_epoch: int = EPOCH,
    deleting: frozenset[str] = frozenset(),
    leader_epochs: dict[tuple[str, int], int] | None = None,
) -> ClusterView:
    epochs = leader_epochs or dict.fromkeys(replicas, 5)
    return ClusterView(full, controller_epoch, broker_epoch, replicas, epochs, deleting)


def stray(
    local: list[tuple[str, int]],
    cluster: ClusterView,
    hosted: dict[tuple[str, int], int] | None = None,
    broker_epoch: int = EPOCH,
    controller_epoch: int = CONTROLLER_EPOCH,
) -> list[tuple[str, int]]:
    return list(
        find_stray_logs(local, cluster, hosted or {}, BROKER, broker_epoch, controller_epoch)
    )


ASSIGNED = {("kept", 0): (1, 3), ("moved", 0): (1, 2), ("moved", 1): (2, 3)}


def test_a_partition_assigned_elsewhere_or_of_a_topic_not_in_the_view_is_stray() -> None:
    local = [("kept", 0), ("moved", 0), ("moved", 1), ("gone", 0)]
    assert stray(local, view(ASSIGNED)) == [("gone", 0), ("moved", 0)]


def test_the_reason_names_the_view_and_the_replicas() -> None:
    found = find_stray_logs(
        [("moved", 0), ("gone", 2)], view(ASSIGNED), {}, BROKER, EPOCH, CONTROLLER_EPOCH
    )
    assert found == {
        ("gone", 2): "topic gone is not in controller epoch 7's view",
        ("moved", 0): "its replicas in controller epoch 7's view are [1, 2], not broker 3",
    }


def test_a_partition_the_view_does_not_name_of_a_topic_it_does_is_stray() -> None:
    # The controller sends a LeaderAndIsr only for partitions in its view: a log of another
    # partition comes from an earlier topic of that name.
    assert stray([("kept", 5)], view(ASSIGNED)) == [("kept", 5)]


def test_a_reassignment_in_flight_keeps_its_original_replicas() -> None:
    # Targets [1, 2] plus originals [3]: broker 3 is still assigned until it completes.
    assert stray([("moving", 0)], view({("moving", 0): (1, 2, 3)})) == []


def test_a_hosted_partition_is_stray_only_when_the_view_moved_it_in_a_newer_epoch() -> None:
    """Review 15 M2: a removed replica whose StopReplica was lost (a controller failover
    before it was sent, or a missed session) kept hosting the partition, a removed leader
    leading in its old epoch, until it restarted. A view in the hosted leader epoch or an
    older one may be older than the LeaderAndIsr that made this broker a replica."""
    hosted = {("moved", 0): 4, ("gone", 0): 4, ("kept", 0): 4}
    assert stray(list(hosted), view(ASSIGNED), hosted) == [("moved", 0)]
    assert stray(list(hosted), view(ASSIGNED), dict.fromkeys(hosted, 5)) == []
    found = find_stray_logs([("moved", 0)], view(ASSIGNED), hosted, BROKER, EPOCH, 7)
    assert found == {
        ("moved", 0): "its replicas in controller epoch 7's view are [1, 2], not broker 3, "
        "in leader epoch 5 (hosted in 4)"
    }


def test_a_topic_whose_deletion_waits_on_this_broker_is_left_to_its_stop_replica() -> None:
    cluster = view(ASSIGNED, deleting=frozenset({"gone"}))
    assert stray([("gone", 0), ("gone", 1), ("moved", 0)], cluster) == [("moved", 0)]


@pytest.mark.parametrize(
    ("cluster", "broker_epoch", "controller_epoch"),
    [
        pytest.param(view(ASSIGNED, full=False), EPOCH, CONTROLLER_EPOCH, id="delta"),
        pytest.param(
            view(ASSIGNED, controller_epoch=CONTROLLER_EPOCH - 1),
            EPOCH,
            CONTROLLER_EPOCH,
            id="stale-controller-epoch",
        ),
        pytest.param(
            view(ASSIGNED, broker_epoch=EPOCH - 1), EPOCH, CONTROLLER_EPOCH, id="old-incarnation"
        ),
        pytest.param(view(ASSIGNED, broker_epoch=0), EPOCH, CONTROLLER_EPOCH, id="no-broker-epoch"),
        pytest.param(view(ASSIGNED), 0, CONTROLLER_EPOCH, id="not-registered"),
    ],
)
def test_only_a_full_view_from_the_newest_controller_for_this_incarnation_decides(
    cluster: ClusterView, broker_epoch: int, controller_epoch: int
) -> None:
    local = [("moved", 0), ("gone", 0)]
    assert stray(local, cluster, broker_epoch=broker_epoch, controller_epoch=controller_epoch) == []


def test_a_newer_controller_epoch_decides() -> None:
    cluster = view(ASSIGNED, controller_epoch=CONTROLLER_EPOCH + 1)
    assert stray([("moved", 0)], cluster) == [("moved", 0)]


def test_the_view_of_a_request() -> None:
    request = cluster_pb2.UpdateMetadataRequest(
        controller_epoch=CONTROLLER_EPOCH,
        broker_epoch=EPOCH,
        type=cluster_pb2.UPDATE_METADATA_TYPE_FULL,
        deleting_topics=["gone"],
    )
    request.partition_states.add(topic="kept", partition=0, replicas=[1, 3], leader_epoch=9)
    assert ClusterView.of(request) == view(
        {("kept", 0): (1, 3)}, deleting=frozenset({"gone"}), leader_epochs={("kept", 0): 9}
    )
    request.type = cluster_pb2.UPDATE_METADATA_TYPE_DELTA
    assert not ClusterView.of(request).full


def test_strays_of_a_topic_the_view_does_not_know_are_orphaned_not_deleted() -> None:
    """Review 37 #1: only a controller that lost its etcd sends a view without a topic whose
    logs a broker holds (a deletion waits on the broker in deleting_topics)."""
    cluster = view(ASSIGNED)
    strays = find_stray_logs([("moved", 0), ("gone", 0)], cluster, {}, BROKER, EPOCH, 7)
    assert orphaned(strays, cluster) == {("gone", 0)}
