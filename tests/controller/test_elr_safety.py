"""The invariants the eligible leader replicas (KIP-966) rest on, at the controller's edges: a
new controller's ELRs, brokers' min.insync.replicas at registration and at heartbeats, the
clean-shutdown proof, a topic's lower min.insync.replicas.

Controllers run in the test's process on a real etcd (a broker's refusal: real processes)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable

import aetcd

from tests.controller.cluster import Cluster, Eventually
from tests.controller.in_process import ConnectStore, RunController, seed
from tidewater.broker.log.manager import CLEAN_SHUTDOWN_FILE
from tidewater.controller.controller import Controller
from tidewater.controller.model import PartitionRecord
from tidewater.controller.service import ControllerService
from tidewater.controller.store import ControllerStore
from tidewater.local.etcd import EtcdProcess
from tidewater.local.process import ProcessFailed
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
    reported: dict[int, int] | None = None,
) -> tuple[ControllerStore, Controller]:
    """An active controller with `min_insync_replicas` on what an earlier one left: brokers
    1, 2 and 3 registered (`reported`: the default min.insync.replicas some reported), t-0 on
    them with `record`."""
    await seed(connect_store, (1, 2, 3), (1, 2, 3), record, reported)
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


async def test_a_broker_whose_min_insync_is_below_the_controllers_is_refused(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """The controller keeps replicas eligible while the ISR is below its 2; a broker holding
    the HW only below 1 would commit records without them. Nothing is registered."""
    store = await connect_store()
    controller, _ = await run_controller(store, min_insync_replicas=2)
    service = ControllerService(controller)
    request = registration(1, "a", min_insync_replicas=1)
    refused = await service.RegisterBroker(request, None)  # type: ignore[arg-type]
    assert refused.error_code == ErrorCode.INVALID_CONFIG
    assert refused.error_message == (
        "broker 1: its default min.insync.replicas 1 is below the controller's "
        "--min-insync-replicas 2; set them alike"
    )
    assert await store.load_brokers() == {}
    # At or above it, and from a broker too old to report it (0), registrations go through.
    await register(service, registration(1, "a", min_insync_replicas=2))
    await register(service, registration(2, "a", min_insync_replicas=3))
    await register(service, registration(3, "a"))
    stored = await store.load_brokers()
    assert {b: r.get("min_insync_replicas") for b, r in stored.items()} == {1: 2, 2: 3, 3: 0}


async def test_a_registered_broker_below_a_new_controllers_min_insync_stays_fenced(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Broker 1 registered reporting 1 under a controller whose --min-insync-replicas was 1;
    this one runs with 2 (raised across a restart). Before, only registrations were checked:
    its first heartbeat unfenced it, and its leaders went on advancing the HW with one in
    sync while this controller kept the replicas that left eligible. Its heartbeats are
    refused now, naming both values, and it stays fenced. 2 reported 2; 3 was stored by an
    older controller (no value): both are unfenced."""
    _, controller = await active_on(
        connect_store, run_controller, PartitionRecord(1, 4, (1, 2, 3), 1), 2, {1: 1, 2: 2}
    )
    service = ControllerService(controller)

    async def heartbeat(broker_id: int) -> cpb.BrokerHeartbeatResponse:
        epoch = controller.model.brokers[broker_id].epoch
        request = cpb.BrokerHeartbeatRequest(broker_id=broker_id, broker_epoch=epoch)
        return await service.BrokerHeartbeat(request, None)  # type: ignore[arg-type]

    refused = await heartbeat(1)
    assert refused.error_code == ErrorCode.INVALID_CONFIG
    assert refused.error_message == (
        "broker 1: its default min.insync.replicas 1 is below the controller's "
        "--min-insync-replicas 2; set them alike"
    )
    assert controller.model.brokers[1].fenced
    for broker_id in (2, 3):
        response = await heartbeat(broker_id)
        assert (response.error_code, response.is_fenced) == (ErrorCode.NONE, False)
    assert controller.model.brokers[1].fenced


async def test_a_broker_below_the_controllers_min_insync_stops_naming_both_values(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    cluster = await make_cluster(broker_ids=(), min_insync_replicas=2)
    # Its default, 1: it may be refused (and exit) before it announces its address.
    with contextlib.suppress(ProcessFailed):
        await cluster.start_broker(1)
    broker = cluster.brokers[1]
    await eventually(lambda: broker.proc is not None and broker.proc.poll() is not None, 30)
    assert broker.proc is not None and broker.proc.returncode == 1
    assert (
        "tidewater: INVALID_CONFIG: broker 1: its default min.insync.replicas 1 is below the "
        "controller's --min-insync-replicas 2; set them alike" in broker.log_tail()
    )
    assert "broker 1 stopped: the controller refused its configuration" in broker.log_tail()
    assert "stopped cleanly" not in broker.log_tail()
    assert await cluster.store.load_brokers() == {}


async def test_a_registered_broker_stops_when_the_controllers_come_back_with_a_higher_min_insync(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    """Brokers 1 and 2 registered with their default 1 under controllers with 1; the
    controllers restart (at their addresses) with 2. Before, nothing refused the brokers,
    registered already; now their first heartbeats are refused and they stop, naming both
    values, with the clean-shutdown proof of flushed logs; restarted unchanged (systemd's
    Restart=on-failure), refused at registration twice, each keeps its proof."""
    cluster = await make_cluster(broker_ids=(1, 2))
    addresses = {c: proc.address for c, proc in cluster.controllers.items()}
    for proc in cluster.controllers.values():
        proc.kill()
    cluster.min_insync_replicas = 2
    for controller_id, address in addresses.items():
        await cluster.start_controller(controller_id, listen=address)
    registered = await cluster.store.load_brokers()
    for broker_id in (1, 2):
        broker = cluster.brokers[broker_id]
        await eventually(lambda b=broker: b.proc is not None and b.proc.poll() is not None, 30)
        assert broker.proc is not None and broker.proc.returncode == 1
        assert (
            f"tidewater: INVALID_CONFIG: broker {broker_id}: its default min.insync.replicas 1 "
            "is below the controller's --min-insync-replicas 2; set them alike" in broker.log_tail()
        )
        assert "stopped cleanly" not in broker.log_tail()
        proof = json.loads((cluster.root / f"broker-{broker_id}" / CLEAN_SHUTDOWN_FILE).read_text())
        assert proof["broker_epoch"] == registered[broker_id]["epoch"]
    assert sorted(await cluster.store.load_brokers()) == [1, 2]
    for _ in range(2):
        # It may be refused (and exit) before it announces its address.
        with contextlib.suppress(ProcessFailed):
            await cluster.start_broker(1)
        broker = cluster.brokers[1]  # the new process's
        await eventually(lambda b=broker: b.proc is not None and b.proc.poll() is not None, 30)
        assert broker.proc is not None and broker.proc.returncode == 1
        assert "registration refused: " in broker.log_tail()
        proof = json.loads((cluster.root / "broker-1" / CLEAN_SHUTDOWN_FILE).read_text())
        assert proof["broker_epoch"] == registered[1]["epoch"]


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
