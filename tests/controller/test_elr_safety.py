"""The invariants the eligible leader replicas (KIP-966) rest on, at the controller's edges: a
new controller's ELRs, brokers' min.insync.replicas at registration, the clean-shutdown proof.

Controllers run in the test's process on a real etcd."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conftest import ConnectStore, RunController, seed

from tidewater.controller.model import PartitionRecord

if TYPE_CHECKING:
    from conftest import Eventually

# No grace period ends, so no election, within a test.
LONG_SESSION_TIMEOUT_MS = 60_000


async def test_a_controller_with_a_lower_min_insync_clears_stale_elrs_when_it_becomes_active(
    connect_store: ConnectStore, run_controller: RunController, eventually: Eventually
) -> None:
    """Recorded by a controller whose --min-insync-replicas was 3: ISR {1, 2}, ELR {3}. The
    operator lowers it to 2 and restarts the controllers: with two in sync, leader 1 advances
    the HW without 3, so 3 leaves the ELR before this controller elects anyone."""
    stored = PartitionRecord(1, 4, (1, 2), 1, elr=(3,))
    await seed(connect_store, brokers=(1, 2, 3), replicas=(1, 2, 3), record=stored)
    store = await connect_store()
    controller, _ = run_controller(
        store, session_timeout_ms=LONG_SESSION_TIMEOUT_MS, min_insync_replicas=2
    )
    await eventually(lambda: controller.active, 10)
    value, _ = (await store.load_partitions())["t", 0]
    assert (value["leader"], value["isr"], value["elr"]) == (1, [1, 2], [])
    # A new leader epoch: the leader learns the new partition epoch.
    assert (value["leader_epoch"], value["controller_epoch"]) == (5, controller.epoch)
    assert controller.model.partitions["t", 0].elr == ()
