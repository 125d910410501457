"""What the metadata services show across a controller failover: an in-process controller on a
real etcd, and a real metadata service on loopback."""

from __future__ import annotations

from tests.controller.in_process import ConnectStore, RunController, heartbeat, seed
from tests.metadata.updates import FULL, state, update
from tidewater.controller.model import PartitionRecord
from tidewater.local.wait import eventually
from tidewater.metadata.server import MetadataServer
from tidewater.v1 import cluster_pb2


async def test_a_new_controller_sends_its_view_once_its_grace_period_is_over(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 20 M1: a new controller sent its FULL view at once, before any broker had
    heartbeated to it: it named no broker live, and every partition showed no leader (the
    SDK dropped leaders nobody had moved) until the leaders heartbeated. The metadata
    services keep the last controller's view through the grace period now."""
    await seed(
        connect_store, brokers=(1, 2), replicas=(1, 2), record=PartitionRecord(1, 0, (1, 2), 1)
    )
    server = MetadataServer("127.0.0.1:0")
    await server.start()
    views: list[cluster_pb2.UpdateMetadataRequest] = []
    apply = server.cache.apply

    def recorded(request: cluster_pb2.UpdateMetadataRequest) -> None:
        views.append(request)
        apply(request)

    server.cache.apply = recorded  # type: ignore[method-assign]
    try:
        # The last controller's view (epoch 1).
        server.cache.apply(update(FULL, 1, [state("t", 0, replicas=(1, 2))], brokers=(1, 2)))
        controller, _ = await run_controller(
            await connect_store(), 60_000, metadata_addresses=[server.address]
        )
        for broker_id in (1, 2):
            await heartbeat(controller, broker_id)

        def full_views() -> list[list[int]]:
            return [
                [b.broker_id for b in view.live_brokers]
                for view in views
                if view.controller_epoch == controller.epoch
                and view.type == cluster_pb2.UPDATE_METADATA_TYPE_FULL
            ]

        await eventually(full_views, 10)
        assert full_views() == [[1, 2]]
        (partition,) = server.cache.describe(["t"]).topics[0].partitions
        assert (partition.leader, list(partition.offline_replicas)) == (1, [])
    finally:
        await server.stop()
