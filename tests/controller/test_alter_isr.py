"""AlterIsr on a real cluster, sent as a partition leader's AlterIsr channel would send it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

if TYPE_CHECKING:
    from conftest import Cluster, Eventually


async def test_a_retried_alter_isr_whose_answer_was_lost_gets_the_committed_state(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("retried", assignments=[(1, 2, 3)])
    await eventually(lambda: cluster.produced("retried", 0, b"warm-up"), 20)
    state, partition_epoch = (await cluster.store.load_partitions())["retried", 0]
    assert (state["leader"], sorted(state["isr"])) == (1, [1, 2, 3])
    request = cpb.AlterIsrRequest(
        broker_id=1,
        broker_epoch=(await cluster.store.load_brokers())[1]["epoch"],
        partitions=[
            cpb.AlterIsrPartition(
                topic="retried",
                partition=0,
                leader_epoch=state["leader_epoch"],
                new_isr=[1, 2],
                partition_epoch=partition_epoch,
            )
        ],
    )
    first = (await cluster.call_controller("AlterIsr", request)).partitions[0]
    assert first.error_code == ErrorCode.NONE, first.error_message
    # The leader never saw that answer (a timeout, a controller failover) and sends the same
    # proposal again: it learns the committed ISR and partition epoch instead of a refusal.
    retried = (await cluster.call_controller("AlterIsr", request)).partitions[0]
    assert retried.error_code == ErrorCode.NONE, ErrorCode.Name(retried.error_code)
    committed, committed_epoch = (await cluster.store.load_partitions())["retried", 0]
    assert committed["isr"] == [1, 2]
    assert (retried.leader, retried.leader_epoch, list(retried.isr)) == (
        1,
        state["leader_epoch"],
        [1, 2],
    )
    assert retried.partition_epoch == first.partition_epoch == committed_epoch > partition_epoch
