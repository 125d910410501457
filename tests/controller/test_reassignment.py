"""Partition reassignment (KIP-455) on a real cluster: cancelling one in progress, one (and a
cancel) cut by a controller failover, and one that moved a partition off a broker that was
down."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.controller.cluster import Cluster, Eventually
from tidewater.client import Admin, PartitionReassignment
from tidewater.controller.model import PartitionRecord, Reassignment, TopicState
from tidewater.v1 import common_pb2
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode


async def reassign(cluster: Cluster, replicas: list[int] | None) -> None:
    """Reassign "moving"-0 to `replicas`, or cancel its reassignment (None)."""
    partition = cpb.ReassignablePartition(
        topic="moving", partition=0, replicas=replicas or [], cancel=replicas is None
    )
    response = await cluster.call_controller(
        "AlterPartitionReassignments",
        cpb.AlterPartitionReassignmentsRequest(partitions=[partition]),
    )
    assert response.partitions[0].error_code == ErrorCode.NONE, response.partitions[0]


async def elect_preferred(cluster: Cluster) -> None:
    response = await cluster.call_controller(
        "ElectLeaders",
        cpb.ElectLeadersRequest(
            election_type=cpb.ELECTION_TYPE_PREFERRED,
            partitions=[common_pb2.TopicPartition(topic="moving", partition=0)],
        ),
    )
    assert response.partitions[0].error_code == ErrorCode.NONE, response.partitions[0]


async def partition_is(cluster: Cluster, check: Callable[[dict[str, Any]], bool]) -> bool:
    return check((await cluster.partitions("moving"))[0])


async def reassign_held_up(
    cluster: Cluster, eventually: Eventually, assignment: list[int], down: int, target: list[int]
) -> None:
    """Create "moving"-0 on `assignment`, kill broker `down` (one of them) and reassign it to
    `target`: its other replicas join the ISR, and it stays in flight while `down` is out."""
    await cluster.create_topic("moving", assignments=[tuple(assignment)])
    await eventually(lambda: cluster.produced("moving", 0, b"before"), 20)
    cluster.brokers[down].kill()
    up = [b for b in assignment if b != down]
    await eventually(lambda: partition_is(cluster, lambda s: s["isr"] == up), 20)
    await reassign(cluster, target)
    joined = sorted(set(up + target) - {down})
    await eventually(lambda: partition_is(cluster, lambda s: sorted(s["isr"]) == joined), 20)


async def test_cancelling_a_reassignment_takes_its_added_replicas_out_of_the_isr(
    cluster: Cluster, eventually: Eventually
) -> None:
    # Broker 3 is gone: neither the reassignment to [2, 3] nor its cancellation (back to
    # [1, 3]) can complete while it is out of the ISR.
    await reassign_held_up(cluster, eventually, [1, 3], down=3, target=[2, 3])
    # The replica being added leads (it is the preferred one of the target replicas).
    await elect_preferred(cluster)
    await eventually(lambda: partition_is(cluster, lambda s: s["leader"] == 2), 10)

    await reassign(cluster, None)
    # Back on [1, 3]: 2 is neither leader nor in the ISR of a partition it no longer holds,
    # and broker 1 leads and takes acks=all writes with an ISR of itself.
    assert (await cluster.store.load_topics())["moving"]["assignment"]["0"] == [1, 3]
    current = (await cluster.partitions("moving"))[0]
    assert (current["leader"], current["isr"]) == (1, [1])
    await eventually(lambda: cluster.produced("moving", 0, b"after"), 20)
    seen = await cluster.read(1, "moving", 0)
    assert {b"before", b"after"} <= set(seen)
    await eventually(lambda: not (cluster.root / "broker-2" / "moving-0").exists(), 10)


async def test_admin_lists_the_reassignments_in_progress(
    cluster: Cluster, eventually: Eventually
) -> None:
    """Admin.list_partition_reassignments (Kafka's listPartitionReassignments): one held up by
    a broker that is down, all of them or by partition, and none once it is cancelled."""
    await cluster.create_topic("moving", assignments=[(1, 3)])
    await cluster.create_topic("staying", assignments=[(1, 2)])
    await eventually(lambda: cluster.produced("moving", 0, b"before"), 20)
    cluster.brokers[3].kill()  # the target [2, 3] cannot complete without it
    controllers = [p.address for p in cluster.controllers.values()]
    async with Admin(controllers) as admin:
        assert await admin.list_partition_reassignments() == {}
        await admin.reassign({("moving", 0): [2, 3]})
        listed = PartitionReassignment(
            replicas=(2, 3, 1), adding_replicas=(2,), removing_replicas=(1,)
        )
        assert await admin.list_partition_reassignments() == {("moving", 0): listed}
        assert await admin.list_partition_reassignments([("moving", 0), ("nope", 0)]) == {
            ("moving", 0): listed
        }
        assert await admin.list_partition_reassignments([("staying", 0)]) == {}
        await admin.reassign({("moving", 0): None})
        assert await admin.list_partition_reassignments() == {}


@pytest.mark.parametrize(
    "target",
    [
        pytest.param((3, 1), id="adding-3"),
        # Its target is in the ISR already: it completes as soon as it starts.
        pytest.param((2,), id="completing"),
    ],
)
async def test_a_reassignment_cut_by_a_controller_failover_is_resumed(
    cluster: Cluster, eventually: Eventually, target: tuple[int, ...]
) -> None:
    await cluster.create_topic("moving", assignments=[(1, 2)])
    await eventually(lambda: cluster.produced("moving", 0, b"before"), 20)
    # The active controller dies after the start's txn (the assignment with the reassignment
    # in flight, the partition's state in a new leader epoch), before its LeaderAndIsr: the
    # next one tells every replica as it hears from them, and completes it.
    reassignment = Reassignment(original=(1, 2), target=target)
    await crash_after_a_step(
        cluster, lambda r: r.with_(leader_epoch=r.leader_epoch + 1), reassignment
    )

    async def finished() -> bool:
        listed = await cluster.call_controller(
            "ListPartitionReassignments", cpb.ListPartitionReassignmentsRequest()
        )
        state = (await cluster.partitions("moving"))[0]
        return not listed.reassignments and sorted(state["isr"]) == sorted(target)

    await eventually(finished, 30)
    assert (await cluster.store.load_topics())["moving"]["assignment"]["0"] == list(target)
    # Every replica follows the leader in its leader epoch; the new ones caught up: led by
    # the first of them, the partition serves what broker 1 acknowledged.
    await eventually(lambda: cluster.applied(["moving"]), 10)
    if (await cluster.partitions("moving"))[0]["leader"] != target[0]:
        await elect_preferred(cluster)
    await eventually(lambda: cluster.produced("moving", 0, b"after"), 20)
    assert (await cluster.partitions("moving"))[0]["leader"] == target[0]
    assert {b"before", b"after"} <= set(await cluster.read(target[0], "moving", 0))
    (removed,) = set(reassignment.removing)
    await eventually(lambda: not (cluster.root / f"broker-{removed}" / "moving-0").exists(), 10)


async def crash_after_a_step(
    cluster: Cluster,
    state: Callable[[PartitionRecord], PartitionRecord],
    in_flight: Reassignment | None,
    assignment: tuple[int, ...] = (),
) -> None:
    """Kill -9 the controllers as if the active one had written a reassignment's step in its
    one txn (the partition's state made by `state`; the reassignment `in_flight` and its
    replicas, or with none the assignment `assignment`) and died before its LeaderAndIsr and
    StopReplica went out; start them again."""
    value, partition_epoch = (await cluster.store.load_partitions())["moving", 0]
    after = state(PartitionRecord.from_json(value, partition_epoch))
    topic = TopicState.from_json("moving", (await cluster.store.load_topics())["moving"])
    if in_flight is None:
        topic.assignment[0] = assignment
        topic.reassignments.pop(0, None)
    else:
        topic.assignment[0] = in_flight.replicas
        topic.reassignments[0] = in_flight

    async def step(epoch: int) -> None:
        update = ("moving", 0, partition_epoch, after.with_(controller_epoch=epoch).to_json())
        await cluster.store.write_partitions(epoch, [update], topic=("moving", topic.to_json()))

    await cluster.crash_controllers_after(step)


async def test_a_cancel_whose_stop_replica_a_failover_lost_stops_the_replica_it_drops(
    cluster: Cluster, eventually: Eventually
) -> None:
    """A cancel is one txn (review 15 L1): the partition's state without broker 3, which it
    was adding, in a new leader epoch, and the assignment back to [1, 2]. The controller died
    after it, before the StopReplica: broker 3, up all along, finds the partition on other
    brokers in a newer leader epoch in the next controller's FULL view, stops it and removes
    its log. (Before, a cancel was three writes, and one cut after the first left 3 in the
    ISR of a partition whose assignment had dropped it.)"""
    # Held up by broker 2, which is down: broker 3 joins the ISR, and it stays in flight.
    await reassign_held_up(cluster, eventually, [1, 2], down=2, target=[3, 2])
    added_log = cluster.root / "broker-3" / "moving-0"
    assert added_log.exists()
    await crash_after_a_step(
        cluster, lambda r: r.with_(leader_epoch=r.leader_epoch + 1, isr=(1,)), None, (1, 2)
    )
    await eventually(lambda: not added_log.exists(), 30)
    current = (await cluster.partitions("moving"))[0]
    assert (current["leader"], current["isr"]) == (1, [1])
    await eventually(lambda: cluster.produced("moving", 0, b"after"), 20)
    assert {b"before", b"after"} <= set(await cluster.read(1, "moving", 0))


async def test_a_removed_leader_whose_stop_replica_was_lost_stops_at_the_next_full_view(
    cluster: Cluster, eventually: Eventually
) -> None:
    """Review 15 M2: the active controller completed a reassignment off broker 1, the leader,
    and died before its StopReplica went out: broker 1, up all along, went on hosting the
    partition and leading it in its old epoch (stale reads, acks=1 writes nobody replicates)
    until it restarted. The next controller's FULL UpdateMetadata names the partition on
    other brokers in a newer leader epoch: broker 1 stops it and removes its log."""
    await cluster.create_topic("moving", assignments=[(1, 3)])
    await eventually(lambda: cluster.produced("moving", 0, b"before"), 20)
    await eventually(lambda: partition_is(cluster, lambda s: sorted(s["isr"]) == [1, 3]), 20)
    old_log = cluster.root / "broker-1" / "moving-0"
    assert old_log.exists()
    await crash_after_a_step(
        cluster, lambda r: r.with_(leader=3, leader_epoch=r.leader_epoch + 1, isr=(3,)), None, (3,)
    )
    await eventually(lambda: not old_log.exists(), 30)
    await eventually(lambda: cluster.produced("moving", 0, b"after"), 20)
    assert {b"before", b"after"} <= set(await cluster.read(3, "moving", 0))


async def test_a_log_a_reassignment_moved_away_while_its_broker_was_down_is_deleted(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("moving", assignments=[(1, 3)])
    await eventually(lambda: cluster.produced("moving", 0, b"before"), 20)
    old_log = cluster.root / "broker-3" / "moving-0"
    assert old_log.exists()
    cluster.brokers[3].kill()

    async def down() -> bool:
        return 3 not in await cluster.alive_brokers()

    await eventually(down, 20)

    # Off broker 3 while it is down: the StopReplica meant for it is never answered.
    await reassign(cluster, [1, 2])

    async def moved() -> bool:
        state = (await cluster.partitions("moving"))[0]
        assignment = (await cluster.store.load_topics())["moving"]["assignment"]["0"]
        return assignment == [1, 2] and sorted(state["isr"]) == [1, 2]

    await eventually(moved, 30)
    assert old_log.exists()

    # Back, with the controller's FULL view: the log is stray, renamed, and deleted after
    # file.delete.delay.ms.
    await cluster.start_broker(3, **{"file.delete.delay.ms": "500"})
    warning = re.compile(r"WARNING.*stray log moving-0: .*; renamed to (\S+-stray), deleted in")

    def renamed() -> re.Match[str] | None:
        return warning.search(cluster.brokers[3].log_file.read_text(errors="replace"))

    stray = Path((await eventually(renamed, 20))[1])
    assert stray.parent == old_log.parent
    assert not old_log.exists()
    await eventually(lambda: not stray.exists(), 20)
    assert not any(p.name.startswith("moving-0") for p in old_log.parent.iterdir())

    # The partition's records live on its new replicas, which serve and take writes.
    await eventually(lambda: cluster.produced("moving", 0, b"after"), 20)
    leader = (await cluster.partitions("moving"))[0]["leader"]
    assert leader in (1, 2)
    seen = await cluster.read(leader, "moving", 0)
    assert {b"before", b"after"} <= set(seen)
