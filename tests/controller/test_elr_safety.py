"""The invariants the eligible leader replicas (KIP-966) rest on, at the controller's edges: a
new controller's ELRs, brokers whose min.insync.replicas differs from the controller's, the
ELR in AlterIsr answers, the clean-shutdown proof, a topic's lower min.insync.replicas.

Controllers run in the test's process on a real etcd (brokers with another value than the
controllers': real processes)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

import aetcd
import pytest

from tests.controller.cluster import Cluster, Eventually
from tests.controller.in_process import ConnectStore, RunController, seed
from tidewater.controller.controller import Controller
from tidewater.controller.model import PartitionRecord
from tidewater.controller.service import ControllerService
from tidewater.controller.store import ControllerStore
from tidewater.local.etcd import EtcdProcess
from tidewater.v1 import common_pb2
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

# No grace period ends, so no election, within a test.
LONG_SESSION_TIMEOUT_MS = 60_000


async def active_on(
    connect_store: ConnectStore,
    run_controller: RunController,
    record: PartitionRecord,
    min_insync_replicas: int,
) -> tuple[ControllerStore, Controller]:
    """An active controller with `min_insync_replicas` on what an earlier one left: brokers
    1, 2 and 3 registered, t-0 on them with `record`."""
    await seed(connect_store, (1, 2, 3), (1, 2, 3), record)
    store = await connect_store()
    controller, _ = await run_controller(
        store,
        session_timeout_ms=LONG_SESSION_TIMEOUT_MS,
        min_insync_replicas=min_insync_replicas,
    )
    return store, controller


async def test_a_controller_with_a_lower_min_insync_clears_stale_elrs_when_it_becomes_active(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Recorded by a controller whose --min-insync-replicas was 3: ISR {1, 2}, ELR {3}. The
    operator lowers it to 2 and restarts the controllers: with two in sync, leader 1 advances
    the HW without 3, so 3 leaves the ELR before this controller elects anyone."""
    store, controller = await active_on(
        connect_store, run_controller, PartitionRecord(1, 4, (1, 2), 1, elr=(3,)), 2
    )
    value, _ = (await store.load_partitions())["t", 0]
    assert (value["leader"], value["isr"], value["elr"]) == (1, [1, 2], [])
    # The leader epoch stays: brokers apply the new partition epoch alone.
    assert (value["leader_epoch"], value["controller_epoch"]) == (4, controller.epoch)
    assert controller.model.partitions["t", 0].elr == ()


def registration(
    broker_id: int,
    incarnation_id: str,
    previous_broker_epoch: int = 0,
    min_insync_replicas: int = 0,
) -> cpb.RegisterBrokerRequest:
    return cpb.RegisterBrokerRequest(
        broker=common_pb2.BrokerInfo(
            broker_id=broker_id, endpoint=common_pb2.Endpoint(host="127.0.0.1", port=9)
        ),
        incarnation_id=incarnation_id,
        previous_broker_epoch=previous_broker_epoch,
        min_insync_replicas=min_insync_replicas,
    )


async def register(service: ControllerService, request: cpb.RegisterBrokerRequest) -> int:
    response = await service.RegisterBroker(request, None)  # type: ignore[arg-type]
    assert response.error_code == ErrorCode.NONE, response.error_message
    return response.broker_epoch


async def heartbeat(
    controller: Controller, service: ControllerService, broker_id: int
) -> cpb.BrokerHeartbeatResponse:
    epoch = controller.model.brokers[broker_id].epoch
    request = cpb.BrokerHeartbeatRequest(broker_id=broker_id, broker_epoch=epoch)
    return await service.BrokerHeartbeat(request, None)  # type: ignore[arg-type]


async def test_a_broker_whose_min_insync_differs_from_the_controllers_is_registered(
    connect_store: ConnectStore, run_controller: RunController, caplog: pytest.LogCaptureFixture
) -> None:
    """A controller with 2, brokers with 1, 3 and none reported (0: an older broker): each
    registers and its heartbeats unfence it; a value that differs is logged. Before, a broker
    below the controller's value was refused with INVALID_CONFIG and stopped: its leaders
    would have advanced the HW past replicas the controller kept eligible. They hold it now
    while the ELR that comes with the ISR is not empty (test_elr_gate)."""
    store = await connect_store()
    controller, _ = await run_controller(
        store, session_timeout_ms=LONG_SESSION_TIMEOUT_MS, min_insync_replicas=2
    )
    service = ControllerService(controller)
    with caplog.at_level(logging.WARNING, logger="tidewater.controller.service"):
        for broker_id, reported in ((1, 1), (2, 3), (3, 0)):
            await register(service, registration(broker_id, "a", min_insync_replicas=reported))
    assert sorted(await store.load_brokers()) == [1, 2, 3]
    for broker_id in (1, 2, 3):
        response = await heartbeat(controller, service, broker_id)
        assert (response.error_code, response.is_fenced) == (ErrorCode.NONE, False)
    assert [r.getMessage() for r in caplog.records] == [
        "broker 1: its default min.insync.replicas 1 differs from this controller's "
        "--min-insync-replicas 2",
        "broker 2: its default min.insync.replicas 3 differs from this controller's "
        "--min-insync-replicas 2",
    ]


async def test_alter_isr_answers_carry_the_elr_committed_with_the_isr(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """The controller's min ISR is 2 (the brokers may have another): leader 1's shrink to
    ISR {1} commits ELR {2, 3}, and the answer says so, as does the answer to the same
    proposal sent again (its first answer lost); the expansion back to {1, 2} clears it.
    Before, AlterIsr answers carried no ELR, and the leader learnt of none."""
    store, controller = await active_on(
        connect_store, run_controller, PartitionRecord(1, 4, (1, 2, 3), 1), 2
    )
    service = ControllerService(controller)
    for broker_id in (1, 2, 3):
        assert (await heartbeat(controller, service, broker_id)).error_code == ErrorCode.NONE

    async def alter_isr(new_isr: list[int], partition_epoch: int) -> cpb.AlterIsrPartitionResponse:
        request = cpb.AlterIsrRequest(
            broker_id=1,
            broker_epoch=controller.model.brokers[1].epoch,
            partitions=[
                cpb.AlterIsrPartition(
                    topic="t",
                    partition=0,
                    leader_epoch=4,
                    new_isr=new_isr,
                    partition_epoch=partition_epoch,
                )
            ],
        )
        response = await service.AlterIsr(request, None)  # type: ignore[arg-type]
        assert response.error_code == ErrorCode.NONE, response.error_message
        [result] = response.partitions
        assert result.error_code == ErrorCode.NONE, result.error_message
        return result

    _, since = (await store.load_partitions())["t", 0]
    shrunk = await alter_isr([1], since)
    assert (list(shrunk.isr), list(shrunk.eligible_leader_replicas)) == ([1], [2, 3])
    again = await alter_isr([1], since)
    assert (again.partition_epoch, list(again.eligible_leader_replicas)) == (
        shrunk.partition_epoch,
        [2, 3],
    )
    grown = await alter_isr([1, 2], shrunk.partition_epoch)
    assert (list(grown.isr), list(grown.eligible_leader_replicas)) == ([1, 2], [])
    value, _ = (await store.load_partitions())["t", 0]
    assert (value["isr"], value["elr"]) == ([1, 2], [])


# Three controller restarts and a broker's: a minute's waits on a loaded machine.
@pytest.mark.timeout(300)
async def test_controllers_back_with_a_higher_min_insync_keep_the_brokers_whose_leaders_hold_to_it(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    """Brokers 1 and 2 run with their default 1 under controllers with 1; the controllers
    restart (at their addresses) with 2. Before, the brokers' heartbeats were refused and
    they stopped; they stay up now. A topic without its own value on 1 and 2: broker 2
    stops, ISR {1} with ELR {2} by the controllers' 2, and leader 1, whose own value ISR {1}
    meets, refuses acks=all naming the ELR (its HW holds: 2 may lead again). 2 comes back:
    the ISR meets 2, the ELR is cleared and acks=all goes through."""
    cluster = await make_cluster(broker_ids=(1, 2))
    addresses = {c: proc.address for c, proc in cluster.controllers.items()}
    # The epoch of the controllers killed: a restarted one takes over at once (it revokes
    # the lease its previous life held at its address), maybe before it is read again.
    epoch = (await cluster.store.active_controller() or (0, "", 0))[2]
    for proc in cluster.controllers.values():
        proc.kill()
    cluster.min_insync_replicas = 2
    for controller_id, address in addresses.items():
        await cluster.start_controller(controller_id, listen=address)

    async def alive_under_the_new_controllers() -> bool:
        active = await cluster.store.active_controller()
        return active is not None and active[2] > epoch and await cluster.has_alive_brokers({1, 2})

    await eventually(alive_under_the_new_controllers, 60)
    topic = "held"
    await cluster.create_topic(topic, assignments=[(1, 2)])
    await eventually(lambda: cluster.settled([topic]), 60)
    await cluster.produce_all(topic, 0, [b"both"])
    assert all(cluster.brokers[b].running for b in (1, 2))

    assert cluster.brokers[2].stop() == 0

    async def leader_holds_isr_1_with_elr_2() -> bool:
        s = (await cluster.partitions(topic))[0]
        return (s["isr"], s["elr"]) == ([1], [2]) and await cluster.replica_sees(
            1, topic, 0, 1, s["leader_epoch"]
        )

    await eventually(leader_holds_isr_1_with_elr_2, 60)
    refused = await cluster.send(1, topic, 0, b"refused")
    assert refused is not None
    assert refused.error_code == ErrorCode.NOT_ENOUGH_REPLICAS, refused.error_message
    assert refused.error_message == (
        f"{topic}-0: ISR [1] is below min.insync.replicas as the controller counts it "
        "(eligible leader replicas [2])"
    )

    await cluster.start_broker(2)
    await eventually(lambda: cluster.produced(topic, 0, b"back"), 60)
    s = (await cluster.partitions(topic))[0]
    assert (sorted(s["isr"]), s["elr"]) == ([1, 2], [])
    assert set(await cluster.read(1, topic, 0)) == {b"both", b"back"}


async def test_only_the_previous_registrations_epoch_proves_a_clean_shutdown(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Leader 1 alone in the ISR, 2 and 3 eligible (the controller's min ISR is 2). Each
    broker registers again: with its last registration's epoch (clean: it stays eligible),
    with an older one of its epochs (unclean: it leaves the ELR), with 0 (unclean)."""
    store, controller = await active_on(
        connect_store, run_controller, PartitionRecord(1, 4, (1,), 1, elr=(2, 3)), 2
    )
    service = ControllerService(controller)

    async def elr() -> list[int]:
        value, _ = (await store.load_partitions())["t", 0]
        return value["elr"]

    first = controller.model.brokers[2].epoch
    await register(service, registration(2, "b", previous_broker_epoch=first))
    assert await elr() == [2, 3]
    await register(service, registration(2, "c", previous_broker_epoch=first))
    assert await elr() == [3]
    await register(service, registration(3, "b", previous_broker_epoch=0))
    assert await elr() == []


async def test_a_lower_topic_min_insync_and_the_elr_it_clears_are_one_etcd_txn(
    etcd: EtcdProcess,
    cluster_name: str,
    connect_store: ConnectStore,
    run_controller: RunController,
) -> None:
    """ISR {1, 2}, ELR {3} under the controller's 3; the topic sets 2. Before, the ELR was
    cleared in one txn and the value written in the next: a failover between them kept 3
    (the leaders hold the HW) with 3 no longer eligible."""
    _, controller = await active_on(
        connect_store, run_controller, PartitionRecord(1, 4, (1, 2), 1, elr=(3,)), 3
    )
    set_2 = cpb.AlterableConfig(
        name="min.insync.replicas", operation=cpb.CONFIG_OPERATION_SET, value="2"
    )
    request = cpb.IncrementalAlterConfigsRequest(
        topics=[cpb.AlterConfigsTopic(topic="t", configs=[set_2])]
    )
    response = await ControllerService(controller).IncrementalAlterConfigs(request, None)  # type: ignore[arg-type]
    assert [t.error_code for t in response.topics] == [ErrorCode.NONE], response
    host, _, port = etcd.endpoint.rpartition(":")
    async with aetcd.Client(host, int(port)) as client:
        topic = await client.get(f"/tidewater/{cluster_name}/topics/t".encode())
        partition = await client.get(f"/tidewater/{cluster_name}/partitions/t/0".encode())
    assert topic is not None and partition is not None
    assert json.loads(topic.value)["configs"] == {"min.insync.replicas": "2"}
    assert json.loads(partition.value)["elr"] == []
    assert topic.mod_revision == partition.mod_revision
