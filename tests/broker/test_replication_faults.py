"""Replication under faults with real broker processes: kill -9 of the leader under load, and a
follower paused with SIGSTOP. The test plays the controller (StandinController)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.log import Log
from tidewater.local.fetch import list_offsets, read_served
from tidewater.local.fetch import log_bytes as stored
from tidewater.local.process import ManagedProcess
from tidewater.local.standin_controller import StandinController
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "faults"
TP = (TOPIC, 0)
SETTINGS = {
    "replica.lag.time.max.ms": "1500",
    "replica.fetch.backoff.ms": "100",
    "replica.fetch.wait.max.ms": "200",
}


class Cluster:
    def __init__(
        self,
        make: Callable[..., ManagedProcess],
        controller: StandinController,
        controller_address: str,
    ) -> None:
        self.make = make
        self.controller = controller
        self.controller_address = controller_address
        self.procs: dict[int, ManagedProcess] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}

    def start(self, broker_id: int) -> None:
        """Start (or restart, on a port of its own) a broker process."""
        proc = self.make(broker_id, controllers=self.controller_address, **SETTINGS)
        self.controller.brokers[broker_id] = proc.start()
        self.procs[broker_id] = proc

    def stub(self, broker_id: int) -> broker_pb2_grpc.BrokerServiceStub:
        address = self.controller.brokers[broker_id]
        if address not in self.channels:
            self.channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return broker_pb2_grpc.BrokerServiceStub(self.channels[address])

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()

    async def offsets(self, broker_id: int) -> tuple[int, int]:
        """(HW, LEO) of the leader's log, from ListOffsets."""
        stub = self.stub(broker_id)
        found = []
        for replica_id in (-1, broker_id):
            response = await stub.ListOffsets(
                list_offsets(TOPIC, 0, pb.OFFSET_SPEC_LATEST, replica_id=replica_id),
                timeout=5,
            )
            found.append(response.partitions[0].offset)
        return found[0], found[1]


@pytest.fixture
async def cluster(broker_processes: Callable[..., ManagedProcess]) -> AsyncIterator[Cluster]:
    controller = StandinController(brokers={})
    address = await controller.start()
    cluster = Cluster(broker_processes, controller, address)
    controller.configs[TOPIC] = {"min.insync.replicas": "2"}
    for broker_id in (1, 2, 3):
        cluster.start(broker_id)
    await controller.elect(TOPIC, 0, leader=1, replicas=[1, 2, 3])
    try:
        yield cluster
    finally:
        await cluster.close()
        await controller.stop()


async def produce(cluster: Cluster, value: bytes) -> int | None:
    """One acks=all batch to the current leader; its base offset, or None if not acknowledged."""
    leader = cluster.controller.states[TP].leader
    try:
        response = await cluster.stub(leader).Produce(
            pb.ProduceRequest(
                acks=-1,
                timeout_ms=5000,
                partitions=[
                    pb.PartitionProduceData(
                        topic=TOPIC, partition=0, record_batch=build_batch([Record(value=value)])
                    )
                ],
            ),
            timeout=8,
        )
    except grpc.aio.AioRpcError:
        return None
    result = response.partitions[0]
    return result.base_offset if result.error_code == ErrorCode.NONE else None


async def consume_all(cluster: Cluster, up_to: int) -> list[tuple[int, bytes]]:
    """What the leader serves a consumer from offset 0 until `up_to`: (offset, value)."""
    leader = cluster.controller.states[TP].leader
    served = await read_served(cluster.stub(leader), TOPIC, 0, up_to=up_to, timeout_s=5)
    return [(record.offset, record.value or b"") for record in decode_batches(served)]


def log_bytes(tmp_path: Path, broker_id: int, up_to: int) -> bytes:
    log = Log.open(tmp_path / f"broker-{broker_id}" / f"{TOPIC}-0", LogConfig())
    try:
        return stored(log, up_to)
    finally:
        log.close()


async def test_kill_9_of_the_leader_under_acks_all_load_loses_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    acked: dict[bytes, int] = {}
    killed = asyncio.Event()
    stop = asyncio.Event()

    async def producer() -> None:
        for i in range(600):
            if stop.is_set():
                return
            value = f"record-{i}".encode()
            offset = await produce(cluster, value)
            if offset is not None:
                acked[value] = offset
            if len(acked) == 100 and not killed.is_set():
                killed.set()

    task = asyncio.create_task(producer())
    await asyncio.wait_for(killed.wait(), 60)
    old_leader = cluster.procs[1]
    del cluster.controller.brokers[1]
    old_leader.kill()
    # As the controller: the new leader comes from the ISR, without the dead broker.
    isr = [b for b in cluster.controller.states[TP].isr if b != 1]
    await cluster.controller.elect(TOPIC, 0, leader=isr[0], isr=isr)
    acked_before = len(acked)
    await eventually(lambda: len(acked) >= acked_before + 100, 60)

    cluster.start(1)
    await cluster.controller.elect(TOPIC, 0, leader=isr[0])  # broker 1 back, as a follower
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.wait_for(task, 60)

    leader = cluster.controller.states[TP].leader

    async def all_in_sync() -> bool:
        hw, leo = await cluster.offsets(leader)
        return cluster.controller.states[TP].isr == [1, 2, 3] and hw == leo

    await eventually(all_in_sync, 60)
    hw, _ = await cluster.offsets(leader)
    consumed = await consume_all(cluster, hw)
    offsets_of: dict[bytes, list[int]] = {}
    for offset, value in consumed:
        offsets_of.setdefault(value, []).append(offset)
    for value, offset in acked.items():
        assert offsets_of.get(value) == [offset], value
    for proc in cluster.procs.values():
        # In a thread: the stand-in controller answering the broker's controlled shutdown
        # runs on this test's event loop.
        assert await asyncio.to_thread(proc.stop) == 0
    logs = [log_bytes(tmp_path, b, hw) for b in (1, 2, 3)]
    assert logs[0] == logs[1] == logs[2]


async def test_paused_follower_leaves_the_isr_and_rejoins(cluster: Cluster) -> None:
    assert await produce(cluster, b"warm-up") is not None
    cluster.procs[3].signal(signal.SIGSTOP)
    try:
        # acks=all waits for the paused follower until it is proposed out of the ISR.
        assert await produce(cluster, b"while paused") is not None
        assert (TOPIC, 0, [1, 2]) in cluster.controller.isr_changes
    finally:
        cluster.procs[3].signal(signal.SIGCONT)
    for i in range(5):
        assert await produce(cluster, f"after-{i}".encode()) is not None

    await eventually(lambda: cluster.controller.states[TP].isr == [1, 2, 3], 30)
    assert cluster.controller.isr_changes[-1] == (TOPIC, 0, [1, 2, 3])
