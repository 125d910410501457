"""Idempotent produce with real broker processes: producer ids from the controller's blocks,
duplicates answered with the original offsets across retries, leader failover and restarts.
The test plays the controller (StandinController)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tidewater.broker.producer_state import SNAPSHOT_SUFFIX
from tidewater.local.fetch import list_offsets
from tidewater.local.process import ManagedProcess
from tidewater.local.standin_controller import StandinController
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "idempotent"
TP = (TOPIC, 0)
SETTINGS = {"replica.fetch.backoff.ms": "100", "replica.fetch.wait.max.ms": "200"}


class Cluster:
    def __init__(
        self, make: Callable[..., ManagedProcess], controller: StandinController, address: str
    ) -> None:
        self.make = make
        self.controller = controller
        self.controller_address = address
        self.procs: dict[int, ManagedProcess] = {}

    def start(self, broker_id: int, **settings: str) -> None:
        """Start (or restart, on a port of its own) a broker process."""
        proc = self.make(broker_id, controllers=self.controller_address, **SETTINGS | settings)
        self.controller.brokers[broker_id] = proc.start()
        self.procs[broker_id] = proc

    def kill(self, broker_id: int) -> None:
        """kill -9; the controller treats the broker as dead."""
        self.procs[broker_id].kill()
        del self.controller.brokers[broker_id]

    async def call(self, broker_id: int, method: str, request: object) -> Any:
        address = self.controller.brokers[broker_id]
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            return await getattr(stub, method)(request, timeout=10)

    async def init_producer_id(
        self, broker_id: int, pid: int = -1, epoch: int = -1
    ) -> tuple[int, int]:
        response = await self.call(
            broker_id,
            "InitProducerId",
            pb.InitProducerIdRequest(producer_id=pid, producer_epoch=epoch),
        )
        assert response.error_code == ErrorCode.NONE, response.error_message
        return response.producer_id, response.producer_epoch

    async def produce(self, broker_id: int, batch: bytes) -> pb.PartitionProduceResponse:
        response = await self.call(
            broker_id,
            "Produce",
            pb.ProduceRequest(
                acks=-1,
                timeout_ms=5000,
                partitions=[pb.PartitionProduceData(topic=TOPIC, partition=0, record_batch=batch)],
            ),
        )
        return response.partitions[0]

    async def log_end_offset(self, broker_id: int) -> int:
        response = await self.call(
            broker_id,
            "ListOffsets",
            list_offsets(TOPIC, 0, pb.OFFSET_SPEC_LATEST, replica_id=broker_id),
        )
        return response.partitions[0].offset


@pytest.fixture
async def cluster(broker_processes: Callable[..., ManagedProcess]) -> AsyncIterator[Cluster]:
    controller = StandinController(brokers={})
    address = await controller.start()
    try:
        yield Cluster(broker_processes, controller, address)
    finally:
        await controller.stop()


def idempotent_batch(pid: int, epoch: int, sequence: int, records: int = 1) -> bytes:
    return build_batch(
        [Record(value=f"record-{sequence + i}".encode()) for i in range(records)],
        producer_id=pid,
        producer_epoch=epoch,
        base_sequence=sequence,
    )


async def test_producer_ids_come_from_the_controllers_blocks(cluster: Cluster) -> None:
    cluster.start(1)
    cluster.start(2)
    first = await cluster.init_producer_id(1)
    second = await cluster.init_producer_id(1)
    other_broker = await cluster.init_producer_id(2)
    assert first[1] == second[1] == other_broker[1] == 0
    assert len({first[0], second[0], other_broker[0]}) == 3
    # Naming an id takes nothing over (review 32 #3): a new id, as Kafka's InitProducerId
    # without a transactional id.
    taken = await cluster.init_producer_id(2, first[0], 0)
    assert taken[1] == 0 and taken[0] not in {first[0], second[0], other_broker[0]}


async def test_a_resent_batch_is_appended_once_and_a_gap_is_refused(cluster: Cluster) -> None:
    for broker_id in (1, 2, 3):
        cluster.start(broker_id)
    await cluster.controller.elect(TOPIC, 0, leader=1, replicas=[1, 2, 3])
    pid, epoch = await cluster.init_producer_id(1)

    batch = idempotent_batch(pid, epoch, 0, records=3)
    answers = [await cluster.produce(1, batch) for _ in range(2)]
    assert [(a.error_code, a.base_offset) for a in answers] == [(ErrorCode.NONE, 0)] * 2
    assert await cluster.log_end_offset(1) == 3

    gap = await cluster.produce(1, idempotent_batch(pid, epoch, 5))
    assert gap.error_code == ErrorCode.OUT_OF_ORDER_SEQUENCE
    unknown = await cluster.produce(1, idempotent_batch(pid + 1, 0, 4))
    assert unknown.error_code == ErrorCode.UNKNOWN_PRODUCER_ID
    new_epoch = await cluster.produce(1, idempotent_batch(pid, epoch + 1, 0))
    assert (new_epoch.error_code, new_epoch.base_offset) == (ErrorCode.NONE, 3)
    stale = await cluster.produce(1, idempotent_batch(pid, epoch, 3))
    assert stale.error_code == ErrorCode.INVALID_PRODUCER_EPOCH
    assert await cluster.log_end_offset(1) == 4


async def test_a_retry_after_the_leader_is_killed_is_deduplicated_by_the_new_leader(
    cluster: Cluster,
) -> None:
    for broker_id in (1, 2, 3):
        cluster.start(broker_id)
    await cluster.controller.elect(TOPIC, 0, leader=1, replicas=[1, 2, 3])
    pid, epoch = await cluster.init_producer_id(1)
    first = await cluster.produce(1, idempotent_batch(pid, epoch, 0, records=2))
    assert (first.error_code, first.base_offset) == (ErrorCode.NONE, 0)

    # The next batch is appended and replicated (acks=all), but the producer never sees the
    # answer: the leader dies, and the producer retries with the new leader.
    lost = idempotent_batch(pid, epoch, 2, records=2)
    assert (await cluster.produce(1, lost)).base_offset == 2
    cluster.kill(1)
    await cluster.controller.elect(TOPIC, 0, leader=2, isr=[2, 3])

    retry = await cluster.produce(2, lost)
    assert (retry.error_code, retry.base_offset) == (ErrorCode.NONE, 2)
    assert await cluster.log_end_offset(2) == 4
    after = await cluster.produce(2, idempotent_batch(pid, epoch, 4))
    assert (after.error_code, after.base_offset) == (ErrorCode.NONE, 4)


async def test_a_follower_expires_idle_producers_too(cluster: Cluster) -> None:
    expiry = {
        "producer.id.expiration.ms": "1000",
        "producer.id.expiration.check.interval.ms": "100",
    }
    for broker_id in (1, 2):
        cluster.start(broker_id, **expiry)
    await cluster.controller.elect(TOPIC, 0, leader=1, replicas=[1, 2])
    pid, epoch = await cluster.init_producer_id(1)
    first = await cluster.produce(1, idempotent_batch(pid, epoch, 0))
    assert (first.error_code, first.base_offset) == (ErrorCode.NONE, 0)  # acks=all: on 2 too

    # The follower forgets the idle producer by itself, as it would keep it for good before.
    follower_log = cluster.procs[2].log_file
    await eventually(lambda: "expired 1 producer(s)" in follower_log.read_text(), 30)
    cluster.kill(1)
    await cluster.controller.elect(TOPIC, 0, leader=2, isr=[2])
    # The producer's next batch, in sequence, finds no state: the client bumps its epoch.
    after = await cluster.produce(2, idempotent_batch(pid, epoch, 1))
    assert after.error_code == ErrorCode.UNKNOWN_PRODUCER_ID
    assert await cluster.log_end_offset(2) == 1


@pytest.mark.parametrize("shutdown", ["kill -9", "clean"])
async def test_a_restarted_broker_rebuilds_producer_state(
    cluster: Cluster, tmp_path: Path, shutdown: str
) -> None:
    # Small segments: rolls snapshot the state, and a restart replays the log after the last.
    cluster.controller.configs[TOPIC] = {"segment.bytes": "200"}
    cluster.start(1)
    await cluster.controller.elect(TOPIC, 0, leader=1, replicas=[1])
    pid, epoch = await cluster.init_producer_id(1)
    for sequence in range(8):
        answer = await cluster.produce(1, idempotent_batch(pid, epoch, sequence))
        assert (answer.error_code, answer.base_offset) == (ErrorCode.NONE, sequence)
    partition_dir = tmp_path / "broker-1" / f"{TOPIC}-0"

    if shutdown == "clean":
        # In a thread: the stand-in controller answering the broker's controlled shutdown
        # runs on this test's event loop.
        assert await asyncio.to_thread(cluster.procs[1].stop) == 0
        del cluster.controller.brokers[1]
    else:
        cluster.kill(1)
    snapshots = sorted(p.name for p in partition_dir.glob(f"*{SNAPSHOT_SUFFIX}"))
    assert len(snapshots) == 2  # the newest two are kept
    if shutdown == "clean":
        assert snapshots[-1] == f"{8:020d}{SNAPSHOT_SUFFIX}"
    else:
        assert snapshots[-1] < f"{8:020d}{SNAPSHOT_SUFFIX}"  # log after it is replayed
    cluster.start(1)
    await cluster.controller.elect(TOPIC, 0, leader=1)

    for sequence in (3, 7):  # the oldest and the newest of the last five batches
        retry = await cluster.produce(1, idempotent_batch(pid, epoch, sequence))
        assert (retry.error_code, retry.base_offset) == (ErrorCode.NONE, sequence)
    assert await cluster.log_end_offset(1) == 8
    gap = await cluster.produce(1, idempotent_batch(pid, epoch, 9))
    assert gap.error_code == ErrorCode.OUT_OF_ORDER_SEQUENCE
