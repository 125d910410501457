"""A leader whose disk fails, against a real cluster (etcd, two controllers, three broker
processes): the broker stops at once, and its partition goes on on an in-sync replica with
every acknowledged record."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tests.controller.cluster import Cluster, Eventually
from tidewater.broker.log.dir_failure import HALT_EXIT_CODE

# The failing broker's files stop growing here: its partition's segment reaches it after
# about 200 records of 1 KiB.
FILE_SIZE_LIMIT = 256 * 1024
VALUE_BYTES = 1024
MAX_RECORDS = 2000
ACKED_AFTER_FAILURE = 50


async def test_a_leader_whose_disk_fails_stops_and_its_partition_goes_on_without_loss(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    cluster = await make_cluster(broker_ids=(1, 2))
    await cluster.start_broker(3, file_size_limit=FILE_SIZE_LIMIT)
    await eventually(lambda: cluster.has_alive_brokers({1, 2, 3}), 30)
    await cluster.create_topic("disk", assignments=[[3, 1, 2]], **{"min.insync.replicas": "2"})
    await eventually(lambda: cluster.settled(["disk"]), 30)

    acked: dict[bytes, int] = {}
    failed = cluster.brokers[3]

    async def produce(i: int) -> bool:
        value = f"{i:08d}".encode().ljust(VALUE_BYTES, b".")
        offset = await cluster.produce("disk", 0, value)
        if offset is not None:
            acked[value] = offset
        return offset is not None

    sent = 0
    while failed.running and sent < MAX_RECORDS:
        await produce(sent)
        sent += 1

    # The broker stopped on its own, saying why, and never answered past its disk's end.
    assert not failed.running, f"{sent} records did not fill the disk"
    assert failed.proc is not None and failed.proc.returncode == HALT_EXIT_CODE
    assert "stopping the broker: log dir" in failed.log_tail(200)
    assert len(acked) * VALUE_BYTES < FILE_SIZE_LIMIT
    # Its partition goes on, led by an in-sync replica.
    for i in range(sent, sent + ACKED_AFTER_FAILURE):
        await eventually(lambda i=i: produce(i), 20)
    state = (await cluster.partitions("disk"))[0]
    assert state["leader"] in (1, 2)
    assert 3 not in state["isr"]

    # Every acknowledged record is there, at its offset, once.
    async def all_readable() -> bool:
        served = await cluster.read(state["leader"], "disk", 0)
        return all(served.get(value) == offset for value, offset in acked.items())

    await eventually(all_readable, 20)
    served = await cluster.read(state["leader"], "disk", 0)
    assert len(set(served.values())) == len(served)
