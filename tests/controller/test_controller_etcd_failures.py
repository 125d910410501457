"""When etcd fails the active controller: a write whose answer is lost, a controller epoch that
moved on. The controller resigns and campaigns again instead of dying, callers waiting on its
queue get NOT_CONTROLLER at once. (A write etcd applied without answering, found by the next
write: test_alter_isr.py.)

The controller runs in the test's process on a real etcd, through a TcpProxy where the link
fails."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import aetcd
import pytest

from tidewater.controller.controller import Controller, ControllerConfig, NotActive
from tidewater.controller.model import PartitionRecord, TopicState
from tidewater.controller.server import wall_clock_ms
from tidewater.controller.store import ControllerStore
from tidewater.local.etcd import EtcdProcess
from tidewater.local.tcp_proxy import LinkMode, TcpProxy

if TYPE_CHECKING:
    from conftest import Eventually

ConnectStore = Callable[..., Awaitable[ControllerStore]]
RunController = Callable[..., tuple[Controller, "asyncio.Task[None]"]]
# Short enough that an unanswered write fails well before the lease (3 s) counts as lost.
REQUEST_TIMEOUT_S = 0.5
LEASE_TTL_S = 3
# Also the grace period after election: broker 1 never heartbeats, so it is fenced then.
SESSION_TIMEOUT_MS = 300


async def seed(connect_store: ConnectStore) -> int:
    """What an earlier controller left in etcd: broker 1 registered, topic t with partition 0
    on broker 1 alone, led by it. Returns that controller's epoch."""
    store = await connect_store()
    epoch = await store.campaign(9, "127.0.0.1:9", LEASE_TTL_S)
    registration = {
        "broker_id": 1,
        "host": "127.0.0.1",
        "port": 9,
        "rack": "",
        "incarnation_id": "a",
    }
    await store.put_broker(epoch, 1, registration)
    await store.put_topic(epoch, "t", TopicState("t", {}, {0: (1,)}).to_json())
    await store.write_partitions(
        epoch, [("t", 0, None, PartitionRecord(1, 0, (1,), epoch).to_json())]
    )
    await store.resign()
    return epoch


@pytest.fixture
async def run_controller() -> AsyncIterator[RunController]:
    """Run a controller (campaigning at once) on a store: the controller and the task that
    runs it, stopped at teardown."""
    running: list[tuple[Controller, asyncio.Task[None]]] = []

    def run(
        store: ControllerStore, session_timeout_ms: int = SESSION_TIMEOUT_MS
    ) -> tuple[Controller, asyncio.Task[None]]:
        controller = Controller(
            ControllerConfig(
                controller_id=1,
                host="127.0.0.1",
                port=1,
                lease_ttl_s=LEASE_TTL_S,
                broker_session_timeout_ms=session_timeout_ms,
                session_check_interval_ms=50,
            ),
            store,
            wall_clock_ms,
        )
        running.append((controller, asyncio.create_task(controller.run())))
        return running[-1]

    yield run
    for controller, task in running:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        controller.sender.reset()


async def test_a_write_whose_answer_is_lost_makes_the_controller_resign_not_die(
    etcd: EtcdProcess,
    connect_store: ConnectStore,
    run_controller: RunController,
    eventually: Eventually,
) -> None:
    seeded_epoch = await seed(connect_store)
    async with TcpProxy(etcd.endpoint) as proxy:
        store = await connect_store(proxy.address, request_timeout_s=REQUEST_TIMEOUT_S)
        controller, _ = run_controller(store)
        await eventually(lambda: controller.active, 10)
        assert controller.epoch == seeded_epoch + 1
        # etcd applies what the controller writes; the controller hears nothing back. The
        # first write is the session-expiry loop's, fencing broker 1 when the grace period ends.
        proxy.set_mode(LinkMode.ONE_WAY)
        await eventually(lambda: not controller.active, 10)
        proxy.set_mode(LinkMode.PASS)
        # It campaigns again (once its unrevoked lease expired) and wins.
        await eventually(lambda: controller.active, 3 * LEASE_TTL_S)
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
    controller, _ = run_controller(await connect_store(), session_timeout_ms=2000)
    await eventually(lambda: controller.active, 10)
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
    eventually: Eventually,
) -> None:
    store = await connect_store()
    controller, _ = run_controller(store)
    await eventually(lambda: controller.active, 10)
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
    eventually: Eventually,
) -> None:
    store = await connect_store()
    controller, task = run_controller(store)
    await eventually(lambda: controller.active, 10)
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
