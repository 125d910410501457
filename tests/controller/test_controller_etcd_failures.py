"""When etcd fails the active controller: a write whose answer is lost, a controller epoch that
moved on. The controller resigns and campaigns again instead of dying, callers waiting on its
queue get NOT_CONTROLLER at once, and an admin request etcd failed part-way is healed by the
failover, and the SDK's Admin retries it at the new controller. (A write etcd applied without
answering, found by the next write: test_alter_isr.py.)

The controller runs in the test's process on a real etcd, through a TcpProxy where the link
fails."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aetcd
import grpc
import pytest

from tests.controller.cluster import Eventually
from tests.controller.in_process import IN_PROCESS_LEASE_TTL_S, ConnectStore, RunController, seed
from tidewater.client.admin import Admin
from tidewater.controller.controller import Controller, NotActive
from tidewater.controller.model import TopicState
from tidewater.controller.service import ControllerService
from tidewater.controller.store import ControllerStore
from tidewater.errors import NotController, StoreUnavailable, TidewaterError
from tidewater.local.etcd import EtcdProcess
from tidewater.local.tcp_proxy import LinkMode, TcpProxy
from tidewater.rpc.server import SERVER_OPTIONS
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1 import controller_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

# Short enough that an unanswered write fails well before the lease (3 s) counts as lost.
REQUEST_TIMEOUT_S = 0.5


async def test_a_write_whose_answer_is_lost_makes_the_controller_resign_not_die(
    etcd: EtcdProcess,
    connect_store: ConnectStore,
    run_controller: RunController,
    eventually: Eventually,
) -> None:
    seeded_epoch = await seed(connect_store)
    async with TcpProxy(etcd.endpoint) as proxy:
        store = await connect_store(proxy.address, request_timeout_s=REQUEST_TIMEOUT_S)
        controller, _ = await run_controller(store)
        assert controller.epoch == seeded_epoch + 1
        # etcd applies what the controller writes; the controller hears nothing back. The
        # first write is the session-expiry loop's, fencing broker 1 when the grace period ends.
        proxy.set_mode(LinkMode.ONE_WAY)
        await eventually(lambda: not controller.active, 10)
        proxy.set_mode(LinkMode.PASS)
        # It campaigns again (once its unrevoked lease expired) and wins.
        await eventually(lambda: controller.active, 3 * IN_PROCESS_LEASE_TTL_S)
        assert controller.epoch == seeded_epoch + 2
        # Its view is etcd's: the write that lost its answer had taken broker 1's leadership.
        record = controller.model.partitions["t", 0]
        assert (record.leader, record.leader_epoch) == (-1, 1)


async def test_a_controller_epoch_moved_on_makes_the_controller_resign_not_die(
    etcd: EtcdProcess,
    cluster_name: str,
    connect_store: ConnectStore,
    run_controller: RunController,
    eventually: Eventually,
) -> None:
    seeded_epoch = await seed(connect_store)
    # A grace period long enough to move the epoch before the fencing write at its end.
    controller, _ = await run_controller(await connect_store(), session_timeout_ms=2000)
    # Another controller's election, as etcd records it, before this one's fencing write.
    host, _, port = etcd.endpoint.rpartition(":")
    async with aetcd.Client(host, int(port)) as client:
        await client.put(
            f"/tidewater/{cluster_name}/controller_epoch".encode(), json.dumps(50).encode()
        )
    # Refused (NotController), it resigns: its lease and controller key go at once, and with
    # no other candidate it wins the next election.
    await eventually(lambda: controller.active and controller.epoch == 51, 10)
    assert seeded_epoch < 50


async def test_stepping_down_fails_the_queued_events(
    connect_store: ConnectStore,
    run_controller: RunController,
) -> None:
    store = await connect_store()
    controller, _ = await run_controller(store)
    running, never = asyncio.Event(), asyncio.Event()

    async def blocking() -> None:
        running.set()
        await never.wait()

    async def queued() -> None:
        pass

    first = asyncio.create_task(controller.submit(blocking))
    second = asyncio.create_task(controller.submit(queued))
    await asyncio.wait_for(running.wait(), 10)
    await store.resign()
    # Both callers hear NOT_CONTROLLER now, not at their RPC deadline.
    for call in (first, second):
        with pytest.raises(NotActive):
            await asyncio.wait_for(call, 5)


async def test_a_controller_stopped_while_it_steps_down_stops(
    connect_store: ConnectStore,
    run_controller: RunController,
) -> None:
    store = await connect_store()
    controller, task = await run_controller(store)
    stepping_down, release = asyncio.Event(), asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stepping_down.set()
            await release.wait()
            raise

    event = asyncio.create_task(controller.submit(slow_to_stop))
    await store.resign()
    await asyncio.wait_for(stepping_down.wait(), 5)
    # The process stops the controller while it is still stepping down.
    task.cancel()
    release.set()
    with pytest.raises(NotActive):
        await asyncio.wait_for(event, 5)
    await asyncio.wait([task], timeout=5)
    assert task.cancelled()
    assert not controller.active


# -- an admin request that etcd fails part-way -----------------------------------------------

# Long: nothing is fenced or moved on a timer; the brokers' heartbeats end the grace period.
LONG_SESSION_TIMEOUT_MS = 60_000
TIMED_OUT = ErrorCode.REQUEST_TIMED_OUT


def fail_once(
    store: ControllerStore,
    method: str,
    applied: bool = False,
    when: Callable[..., bool] = lambda *args: True,
    error: type[TidewaterError] = StoreUnavailable,
) -> None:
    """The store's next `method` call (for which `when` holds) raises `error`, after etcd
    applied it if `applied` (its answer lost); the others go through."""
    real = getattr(store, method)

    async def failing(*args: Any) -> Any:
        if not when(*args):
            return await real(*args)
        delattr(store, method)
        if applied:
            await real(*args)
        raise error("etcd failed the write (simulated)")

    setattr(store, method, failing)


async def heartbeat(controller: Controller, *broker_ids: int) -> None:
    """What the brokers' heartbeats do: unfence them; the last ends the grace period."""
    service = ControllerService(controller)
    for broker_id in broker_ids:
        request = cpb.BrokerHeartbeatRequest(
            broker_id=broker_id, broker_epoch=controller.model.brokers[broker_id].epoch
        )
        response = await service.BrokerHeartbeat(request, None)  # type: ignore[arg-type]
        assert response.error_code == ErrorCode.NONE, response.error_message
        assert not response.is_fenced


async def failed_over(controller: Controller, epoch: int, eventually: Eventually) -> None:
    """The controller resigned and, the only candidate, leads again at a later epoch, with
    every broker heartbeating to it."""
    await eventually(lambda: controller.active and controller.epoch > epoch, 10)
    await heartbeat(controller, *controller.model.brokers)


async def leading(
    connect_store: ConnectStore,
    run_controller: RunController,
    port: int = 1,
) -> tuple[ControllerStore, Controller, ControllerService]:
    store = await connect_store()
    controller, _ = await run_controller(store, LONG_SESSION_TIMEOUT_MS, port)
    await heartbeat(controller, *controller.model.brokers)
    return store, controller, ControllerService(controller)


def create_topics(*names: str) -> cpb.CreateTopicsRequest:
    """Topics with one partition on broker 1."""
    one = [cpb.CreatableReplicaAssignment(partition=0, broker_ids=[1])]
    return cpb.CreateTopicsRequest(
        topics=[cpb.CreatableTopic(name=name, assignments=one) for name in names]
    )


@pytest.mark.parametrize("applied", [False, True], ids=["not-applied", "answer-lost"])
async def test_create_topics_that_etcd_fails_resigns_and_the_failover_gives_it_its_leaders(
    connect_store: ConnectStore,
    run_controller: RunController,
    eventually: Eventually,
    applied: bool,
) -> None:
    await seed(connect_store)
    store, controller, service = await leading(connect_store, run_controller)
    epoch = controller.epoch
    # u is stored; the write of its partition's state fails. v is never tried.
    fail_once(store, "write_partitions", applied)
    response = await service.CreateTopics(create_topics("u", "v"), None)  # type: ignore[arg-type]
    assert response.error_code == TIMED_OUT
    assert [(t.name, t.error_code) for t in response.topics] == [("u", TIMED_OUT), ("v", TIMED_OUT)]
    # The controller resigns rather than lead on with a model etcd may not hold (before, it
    # led on with u and no state for u-0: u never got a leader).
    await failed_over(controller, epoch, eventually)
    await eventually(lambda: ("u", 0) in controller.model.partitions, 10)
    assert controller.model.partitions["u", 0].leader == 1
    stored, _ = (await store.load_partitions())["u", 0]
    assert stored["leader"] == 1
    assert "v" not in controller.model.topics
    # A retry: u exists (whole), v is created.
    retry = await service.CreateTopics(create_topics("u", "v"), None)  # type: ignore[arg-type]
    assert [(t.name, t.error_code) for t in retry.topics] == [
        ("u", ErrorCode.TOPIC_ALREADY_EXISTS),
        ("v", ErrorCode.NONE),
    ]


async def test_create_partitions_that_etcd_fails_resigns_and_the_failover_gives_them_leaders(
    connect_store: ConnectStore, run_controller: RunController, eventually: Eventually
) -> None:
    await seed(connect_store)
    store, controller, service = await leading(connect_store, run_controller)
    epoch = controller.epoch
    fail_once(store, "write_partitions")
    grow = cpb.CreatePartitionsRequest(
        topics=[
            cpb.CreatePartitionsTopic(
                name="t",
                count=2,
                assignments=[cpb.CreatableReplicaAssignment(partition=1, broker_ids=[1])],
            )
        ]
    )
    response = await service.CreatePartitions(grow, None)  # type: ignore[arg-type]
    assert (response.error_code, response.topics[0].error_code) == (TIMED_OUT, TIMED_OUT)
    await failed_over(controller, epoch, eventually)
    await eventually(lambda: ("t", 1) in controller.model.partitions, 10)
    assert controller.model.partitions["t", 1].leader == 1
    assert ("t", 1) in await store.load_partitions()
    # t has its two partitions: a retry asks for no more than it has.
    retry = await service.CreatePartitions(grow, None)  # type: ignore[arg-type]
    assert retry.topics[0].error_code == ErrorCode.INVALID_PARTITIONS


async def test_a_reassignment_that_etcd_fails_resigns_and_completes_after_the_failover(
    connect_store: ConnectStore, run_controller: RunController, eventually: Eventually
) -> None:
    await seed(connect_store, brokers=(1, 2))
    store, controller, service = await leading(connect_store, run_controller)
    epoch = controller.epoch
    # etcd stores the reassignment of t-0 to broker 2 (its one txn); its answer is lost.
    fail_once(store, "write_partitions", applied=True)
    move = cpb.AlterPartitionReassignmentsRequest(
        partitions=[cpb.ReassignablePartition(topic="t", partition=0, replicas=[2])]
    )
    response = await service.AlterPartitionReassignments(move, None)  # type: ignore[arg-type]
    assert (response.error_code, response.partitions[0].error_code) == (TIMED_OUT, TIMED_OUT)
    # The next controller loads it in flight...
    await failed_over(controller, epoch, eventually)
    await eventually(lambda: controller.model.replicas(("t", 0)) == (2, 1), 10)
    # ... and completes it once broker 2 is in the ISR, as its leader proposes.
    record = controller.model.partitions["t", 0]
    brokers = controller.model.brokers
    request = cpb.AlterIsrRequest(
        broker_id=1,
        broker_epoch=brokers[1].epoch,
        partitions=[
            cpb.AlterIsrPartition(
                topic="t",
                partition=0,
                leader_epoch=record.leader_epoch,
                partition_epoch=record.partition_epoch,
                new_isr=[1, 2],
                new_isr_broker_epochs=[brokers[1].epoch, brokers[2].epoch],
            )
        ],
    )
    answer = await service.AlterIsr(request, None)  # type: ignore[arg-type]
    assert answer.partitions[0].error_code == ErrorCode.NONE, answer.partitions[0].error_message
    assert controller.model.replicas(("t", 0)) == (2,)
    assert controller.model.partitions["t", 0].leader == 2
    assert not controller.model.topics["t"].reassignments
    assert (await store.load_topics())["t"]["assignment"]["0"] == [2]


async def test_alter_configs_that_etcd_fails_part_way_answers_what_was_committed(
    connect_store: ConnectStore, run_controller: RunController, eventually: Eventually
) -> None:
    seeder = await connect_store()
    seed_epoch = await seeder.campaign(9, "127.0.0.1:9", IN_PROCESS_LEASE_TTL_S)
    for name in ("a", "b", "c"):
        await seeder.put_topic(seed_epoch, name, TopicState(name, {}, {0: (1,)}).to_json())
    await seeder.resign()
    store, controller, service = await leading(connect_store, run_controller)
    epoch = controller.epoch
    # b's new value is written with its partitions' changes (none here), in one txn.
    fail_once(store, "write_partitions", when=lambda e, u, topic: bool(topic) and topic[0] == "b")
    set_retention = [
        cpb.AlterableConfig(name="retention.ms", operation=cpb.CONFIG_OPERATION_SET, value="1000")
    ]
    alter = cpb.IncrementalAlterConfigsRequest(
        topics=[cpb.AlterConfigsTopic(topic=t, configs=set_retention) for t in ("a", "b", "c")]
    )
    response = await service.IncrementalAlterConfigs(alter, None)  # type: ignore[arg-type]
    # a is committed (and announced); b failed; c was never tried (before: all three NONE).
    assert response.error_code == TIMED_OUT
    assert [t.error_code for t in response.topics] == [ErrorCode.NONE, TIMED_OUT, TIMED_OUT]
    await failed_over(controller, epoch, eventually)
    configs = {name: t.configs for name, t in controller.model.topics.items()}
    assert configs == {"a": {"retention.ms": "1000"}, "b": {}, "c": {}}


# -- the SDK's Admin retries what etcd failed ------------------------------------------------


@pytest.fixture
async def served(
    connect_store: ConnectStore, run_controller: RunController
) -> AsyncIterator[tuple[ControllerStore, Controller, str]]:
    """A leading controller (broker 1 and topic t seeded) served on gRPC: its store, itself,
    and its address (the one it names itself by when active)."""
    await seed(connect_store)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    port = server.add_insecure_port("127.0.0.1:0")
    store, controller, service = await leading(connect_store, run_controller, port)
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(service, server)
    await server.start()
    yield store, controller, f"127.0.0.1:{port}"
    await server.stop(0)


@pytest.mark.parametrize(
    "error",
    [StoreUnavailable, NotController],
    ids=["timed-out", "not-controller"],
)
async def test_admin_retries_at_the_new_controller_only_what_etcd_did_not_commit(
    served: tuple[ControllerStore, Controller, str], error: type[TidewaterError]
) -> None:
    store, controller, address = served
    async with Admin([address]) as admin:
        for name in ("a", "b", "c"):
            await admin.create_topic(name, assignments=[[1]])
        epoch = controller.epoch
        # a is deleted; etcd fails b's deletion; c is never tried. The controller resigns,
        # answering REQUEST_TIMED_OUT or NOT_CONTROLLER at the top level.
        fail_once(
            store, "delete_topic", when=lambda epoch, name, deletion: name == "b", error=error
        )
        # Before, this raised REQUEST_TIMED_OUT, or (NOT_CONTROLLER) the whole request was
        # sent again. a is not sent again (it would be answered UNKNOWN_TOPIC_OR_PARTITION);
        # b and c are, once the controller leads again.
        await admin.delete_topics(["a", "b", "c"])
    assert controller.epoch > epoch
    assert sorted(controller.model.topics) == ["t"]
    assert sorted(await store.load_deletions()) == ["a", "b", "c"]


async def test_admin_resends_the_item_in_flight_when_the_controller_stepped_down(
    served: tuple[ControllerStore, Controller, str],
) -> None:
    store, controller, address = served
    real = store.delete_topic
    in_flight = asyncio.Event()

    async def hanging(epoch: int, name: str, deletion: Any) -> None:
        if name != "b":
            return await real(epoch, name, deletion)
        store.delete_topic = real  # type: ignore[method-assign]
        in_flight.set()
        await asyncio.Event().wait()  # cancelled when the controller steps down

    async with Admin([address]) as admin:
        for name in ("a", "b", "c"):
            await admin.create_topic(name, assignments=[[1]])
        epoch = controller.epoch
        store.delete_topic = hanging  # type: ignore[method-assign]
        deleting = asyncio.create_task(admin.delete_topics(["a", "b", "c"]))
        await asyncio.wait_for(in_flight.wait(), 10)
        # It loses its lease with b's deletion in flight and answers NOT_CONTROLLER: a done,
        # b ambiguous, c never tried (before, b and c were answered NONE, or all three resent).
        await store.resign()
        await asyncio.wait_for(deleting, 30)
    assert sorted(controller.model.topics) == ["t"]
    assert controller.epoch > epoch
    assert sorted(await store.load_deletions()) == ["a", "b", "c"]


@pytest.mark.parametrize("applied", [False, True], ids=["not-applied", "answer-lost"])
async def test_admin_retries_a_create_etcd_failed_and_an_ambiguous_one_may_exist_already(
    served: tuple[ControllerStore, Controller, str], applied: bool
) -> None:
    store, controller, address = served
    epoch = controller.epoch
    fail_once(store, "put_topic", applied)
    async with Admin([address]) as admin:
        if applied:
            # etcd stored u but its answer was lost: the retry finds u, as Kafka's would.
            with pytest.raises(TidewaterError) as info:
                await admin.create_topic("u", assignments=[[1]])
            assert info.value.code == ErrorCode.TOPIC_ALREADY_EXISTS
        else:  # before, REQUEST_TIMED_OUT
            topic_id = await admin.create_topic("u", assignments=[[1]])
            assert topic_id == controller.model.topics["u"].topic_id
    assert controller.epoch > epoch
    assert "u" in (await store.load_topics())
