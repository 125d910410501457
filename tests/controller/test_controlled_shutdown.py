"""Controlled shutdown across a controller failover: an in-process controller on a real etcd."""

from __future__ import annotations

from tests.controller.in_process import ConnectStore, RunController, heartbeat, seed
from tidewater.controller.model import PartitionRecord
from tidewater.controller.service import ControllerService
from tidewater.local.wait import eventually
from tidewater.metadata.server import MetadataServer
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode


async def test_a_broker_shutting_down_stays_so_at_a_controller_elected_meanwhile(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 20 M2: broker 2 finished its controlled shutdown at the previous controller and
    is stopping; its heartbeats go on until then. The new controller, which loads every
    broker fenced, unfenced it at its first heartbeat: leaders took it back into their ISRs
    just before it stopped, and acks=all waited for its session to expire. Its heartbeats
    say so now (want_shutdown): it stays fenced and shutting down, and may stop."""
    await seed(
        connect_store, brokers=(1, 2), replicas=(1, 2), record=PartitionRecord(1, 0, (1,), 1)
    )
    controller, _ = await run_controller(await connect_store(), 60_000)
    stopping = await heartbeat(controller, 2, want_shutdown=True)
    assert (stopping.is_fenced, stopping.should_shut_down) == (True, True)
    assert (await heartbeat(controller, 1)).is_fenced is False
    assert controller.model.usable_brokers() == {1}
    assert controller.model.brokers[2].shutting_down


async def test_a_leader_in_controlled_shutdown_shows_in_metadata_until_it_is_fenced(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 20 L2: broker 1 is the only ISR member of t-0, so its controlled shutdown cannot
    move the leadership, and it serves t-0 until it stops. Metadata left it out of the live
    brokers: t-0 showed no leader (LEADER_NOT_AVAILABLE) while it could still be produced to.
    It shows as leader now, the broker marked in controlled shutdown; once fenced, the
    partition has no leader."""
    await seed(
        connect_store, brokers=(1, 2), replicas=(1, 2), record=PartitionRecord(1, 0, (1,), 1)
    )
    server = MetadataServer("127.0.0.1:0")
    await server.start()
    try:
        controller, _ = await run_controller(
            await connect_store(), 60_000, metadata_addresses=[server.address]
        )
        service = ControllerService(controller)
        for broker_id in (1, 2):
            await heartbeat(controller, broker_id)
        shutdown = await service.ControlledShutdown(
            cpb.ControlledShutdownRequest(
                broker_id=1, broker_epoch=controller.model.brokers[1].epoch
            ),
            None,  # type: ignore[arg-type]
        )
        assert [p.topic for p in shutdown.remaining_partitions] == ["t"]

        def shown() -> tuple[list[tuple[int, bool]], int, int, list[int]]:
            described = server.cache.describe(["t"])
            brokers = [(b.broker_id, b.in_controlled_shutdown) for b in described.brokers]
            if not described.topics[0].partitions:
                return brokers, -1, described.topics[0].error_code, []
            (partition,) = described.topics[0].partitions
            return brokers, partition.leader, partition.error_code, list(partition.offline_replicas)

        await eventually(lambda: shown()[0] == [(1, True), (2, False)], 10)
        assert shown() == ([(1, True), (2, False)], 1, ErrorCode.NONE, [])

        await controller.fence(controller.model.brokers[1], "stopped")
        await eventually(lambda: shown()[0] == [(2, False)], 10)
        assert shown()[1:] == (-1, ErrorCode.LEADER_NOT_AVAILABLE, [1])
    finally:
        await server.stop()
