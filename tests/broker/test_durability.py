"""Crash and corruption on disk, with real broker processes and real files."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from tidewater.local.fetch import consumer_fetch, read_served
from tidewater.local.process import ManagedProcess
from tidewater.local.standin_controller import make_leader
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.records.header import read_header
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "durable"
SMALL_SEGMENTS = {"log.segment.bytes": "20000"}


Lead = Callable[[str, int], Awaitable[broker_pb2_grpc.BrokerServiceStub]]


@pytest.fixture
async def lead() -> AsyncIterator[Lead]:
    """Make the broker at an address leader of the partition at an epoch; its stub. The
    channels close before the test's event loop does: one collected later would complete its
    calls on that closed loop, which grpc.aio logs as an error during some later test."""
    channels: list[grpc.aio.Channel] = []

    async def lead(address: str, epoch: int) -> broker_pb2_grpc.BrokerServiceStub:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        channels.append(channel)
        await make_leader(channel, TOPIC, 0, leader=1, leader_epoch=epoch, replicas=[1])
        return broker_pb2_grpc.BrokerServiceStub(channel)

    yield lead
    for channel in channels:
        await channel.close()


async def produce(stub: broker_pb2_grpc.BrokerServiceStub, batch: bytes) -> int:
    response = await stub.Produce(
        pb.ProduceRequest(
            acks=1,
            partitions=[pb.PartitionProduceData(topic=TOPIC, partition=0, record_batch=batch)],
        )
    )
    result = response.partitions[0]
    assert result.error_code == ErrorCode.NONE, result.error_message
    return result.base_offset


def batches(count: int) -> list[bytes]:
    return [
        build_batch(
            [Record(key=str(i).encode(), value=f"value-{i}-{j}".encode() * 20) for j in range(10)]
        )
        for i in range(count)
    ]


def split(served: bytes) -> list[tuple[int, bytes]]:
    out = []
    pos = 0
    while pos < len(served):
        header = read_header(served, pos)
        out.append((header.base_offset, served[pos + 17 : pos + header.size]))
        pos += header.size
    return out


async def test_kill_9_after_acks_loses_nothing(
    broker_processes: Callable[..., ManagedProcess],
    lead: Lead,
) -> None:
    broker = broker_processes(1, **SMALL_SEGMENTS)
    stub = await lead(broker.start(), 1)
    sent = batches(200)
    acked = [await produce(stub, b) for b in sent]
    broker.kill()

    restarted = broker_processes(1, **SMALL_SEGMENTS)
    stub = await lead(restarted.start(), 2)
    served = split(await read_served(stub, TOPIC, 0))
    assert [offset for offset, _ in served] == acked
    assert [body for _, body in served] == [b[17:] for b in sent]


async def test_torn_tail_is_truncated_on_restart(
    broker_processes: Callable[..., ManagedProcess],
    lead: Lead,
    tmp_path: Path,
) -> None:
    broker = broker_processes(1)
    stub = await lead(broker.start(), 1)
    sent = batches(10)
    acked = [await produce(stub, b) for b in sent]
    broker.kill()

    segment = sorted((tmp_path / "broker-1" / f"{TOPIC}-0").glob("*.log"))[-1]
    size = segment.stat().st_size
    segment.write_bytes(segment.read_bytes()[: size - len(sent[-1]) // 2])

    restarted = broker_processes(1)
    stub = await lead(restarted.start(), 2)
    served = split(await read_served(stub, TOPIC, 0))
    assert [offset for offset, _ in served] == acked[:-1]
    assert [body for _, body in served] == [b[17:] for b in sent[:-1]]
    assert await produce(stub, sent[-1]) == acked[-1]
    assert "WARNING" in restarted.log_tail(200)


async def test_deleted_indexes_are_rebuilt(
    broker_processes: Callable[..., ManagedProcess],
    lead: Lead,
    tmp_path: Path,
) -> None:
    settings = {**SMALL_SEGMENTS, "log.index.interval.bytes": "1000"}
    broker = broker_processes(1, **settings)
    stub = await lead(broker.start(), 1)
    sent = batches(60)
    acked = [await produce(stub, b) for b in sent]
    assert broker.stop() == 0

    partition_dir = tmp_path / "broker-1" / f"{TOPIC}-0"
    indexes = list(partition_dir.glob("*.index")) + list(partition_dir.glob("*.timeindex"))
    assert len(indexes) > 4  # several segments
    for index in indexes:
        index.unlink()

    restarted = broker_processes(1, **settings)
    stub = await lead(restarted.start(), 2)
    assert [offset for offset, _ in split(await read_served(stub, TOPIC, 0))] == acked
    # Reads starting inside the log go through the rebuilt index.
    for offset in (acked[17] + 3, acked[45]):
        response = await stub.Fetch(consumer_fetch(TOPIC, 0, offset, max_bytes=1))
        records = list(decode_batches(response.partitions[0].record_batches))
        assert any(r.offset == offset for r in records)
    assert all(index.exists() for index in indexes if "00000000000000000000" in index.name)


async def test_sigterm_shuts_down_cleanly_and_keeps_data(
    broker_processes: Callable[..., ManagedProcess],
    lead: Lead,
) -> None:
    broker = broker_processes(1)
    stub = await lead(broker.start(), 1)
    acked = [await produce(stub, b) for b in batches(5)]
    assert broker.stop() == 0
    assert "stopped cleanly" in broker.log_tail()
    restarted = broker_processes(1)
    stub = await lead(restarted.start(), 2)
    assert [offset for offset, _ in split(await read_served(stub, TOPIC, 0))] == acked
