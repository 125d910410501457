"""AlterIsr on a real cluster, sent as a partition leader's AlterIsr channel would send it."""

from __future__ import annotations

from typing import Any

from tests.controller.cluster import Cluster, Eventually
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode


async def alter_isr(
    cluster: Cluster,
    topic: str,
    state: dict[str, Any],
    partition_epoch: int,
    new_isr: list[int],
    new_isr_broker_epochs: list[int] | None = None,
) -> cpb.AlterIsrPartitionResponse:
    """Partition 0's leader per `state` (a LeaderAndIsr) proposes `new_isr`."""
    leader = state["leader"]
    request = cpb.AlterIsrRequest(
        broker_id=leader,
        broker_epoch=(await cluster.store.load_brokers())[leader]["epoch"],
        partitions=[
            cpb.AlterIsrPartition(
                topic=topic,
                partition=0,
                leader_epoch=state["leader_epoch"],
                new_isr=new_isr,
                partition_epoch=partition_epoch,
                new_isr_broker_epochs=new_isr_broker_epochs,
            )
        ],
    )
    return (await cluster.call_controller("AlterIsr", request)).partitions[0]


async def created(cluster: Cluster, eventually: Eventually, topic: str) -> tuple[Any, int]:
    """A topic with partition 0 on brokers 1, 2, 3 (1 leading) that took a write; its
    LeaderAndIsr in etcd and partition epoch."""
    await cluster.create_topic(topic, assignments=[(1, 2, 3)])
    await eventually(lambda: cluster.produced(topic, 0, b"warm-up"), 20)
    return (await cluster.store.load_partitions())[topic, 0]


async def test_a_retried_alter_isr_whose_answer_was_lost_gets_the_committed_state(
    cluster: Cluster, eventually: Eventually
) -> None:
    state, partition_epoch = await created(cluster, eventually, "retried")
    assert (state["leader"], sorted(state["isr"])) == (1, [1, 2, 3])
    first = await alter_isr(cluster, "retried", state, partition_epoch, [1, 2])
    assert first.error_code == ErrorCode.NONE, first.error_message
    # The leader never saw that answer (a timeout, a controller failover) and sends the same
    # proposal again: it learns the committed ISR and partition epoch instead of a refusal.
    retried = await alter_isr(cluster, "retried", state, partition_epoch, [1, 2])
    assert retried.error_code == ErrorCode.NONE, ErrorCode.Name(retried.error_code)
    committed, committed_epoch = (await cluster.store.load_partitions())["retried", 0]
    assert committed["isr"] == [1, 2]
    assert (retried.leader, retried.leader_epoch, list(retried.isr)) == (
        1,
        state["leader_epoch"],
        [1, 2],
    )
    assert retried.partition_epoch == first.partition_epoch == committed_epoch > partition_epoch


async def test_a_state_etcd_holds_but_the_brokers_never_heard_of_is_announced(
    cluster: Cluster, eventually: Eventually
) -> None:
    state, partition_epoch = await created(cluster, eventually, "ambiguous")
    active = await cluster.store.active_controller()
    assert active is not None
    # A write of the active controller that etcd applied, but whose answer never came back:
    # broker 2 leads in the next leader epoch. The controller still believes broker 1 leads.
    moved = {**state, "leader": 2, "leader_epoch": state["leader_epoch"] + 1}
    (written,) = await cluster.store.write_partitions(
        active[2], [("ambiguous", 0, partition_epoch, moved)]
    )
    assert written.ok
    # Its next write to that partition (broker 1's ISR shrink, as broker 1 sends it) finds the
    # newer state: the controller takes it, and tells the brokers.
    result = await alter_isr(cluster, "ambiguous", state, partition_epoch, [1, 2])
    assert (result.leader, result.leader_epoch) == (2, moved["leader_epoch"])

    async def everyone_follows_broker_2() -> bool:
        for broker_id in (1, 2, 3):
            if not await cluster.replica_sees(broker_id, "ambiguous", 0, 2, moved["leader_epoch"]):
                return False
        return True

    await eventually(everyone_follows_broker_2, 10)


async def test_an_expansion_naming_a_stale_incarnation_of_a_member_is_refused(
    cluster: Cluster, eventually: Eventually
) -> None:
    """KIP-903 through the controller's RPC and etcd: an expansion whose new member's broker
    epoch is not its current registration commits nothing."""
    state, partition_epoch = await created(cluster, eventually, "incarnations")
    shrunk = await alter_isr(cluster, "incarnations", state, partition_epoch, [1, 2])
    assert shrunk.error_code == ErrorCode.NONE, shrunk.error_message
    epoch_of_3 = (await cluster.store.load_brokers())[3]["epoch"]
    stale = await alter_isr(
        cluster, "incarnations", state, shrunk.partition_epoch, [1, 2, 3], [-1, -1, epoch_of_3 - 1]
    )
    assert stale.error_code == ErrorCode.INELIGIBLE_REPLICA, ErrorCode.Name(stale.error_code)
    committed, committed_epoch = (await cluster.store.load_partitions())["incarnations", 0]
    assert (committed["isr"], committed_epoch) == ([1, 2], shrunk.partition_epoch)
    current = await alter_isr(
        cluster, "incarnations", state, shrunk.partition_epoch, [1, 2, 3], [-1, -1, epoch_of_3]
    )
    assert current.error_code == ErrorCode.NONE, current.error_message
    assert list(current.isr) == [1, 2, 3]
