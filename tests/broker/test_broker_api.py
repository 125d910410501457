"""The single-replica broker through its real gRPC API: produce, fetch, offsets, errors."""

from __future__ import annotations

import asyncio
import errno
import logging
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.broker.logged import Logged
from tidewater.broker import replica_manager
from tidewater.broker.log import segment as segment_module
from tidewater.broker.log.checkpoints import OffsetCheckpoint
from tidewater.broker.partition import HostedPartition
from tidewater.errors import TidewaterError
from tidewater.local.fetch import consumer_fetch, list_offsets
from tidewater.local.standin_controller import leader_and_isr_request, make_leader
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.records.header import (
    CRC_OFFSET,
    HEADER_SIZE,
    Compression,
    compute_crc,
    read_header,
)
from tidewater.replication.partition import AlterIsrProposal
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import cluster_pb2, common_pb2
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "events"
WAIT_S = 20.0


def batch_of(values: list[bytes], **kwargs: Any) -> bytes:
    return build_batch([Record(key=b"k", value=v) for v in values], **kwargs)


def produce_request(
    batch: bytes, acks: int = 1, topic: str = TOPIC, partition: int = 0, timeout_ms: int = 0
) -> pb.ProduceRequest:
    return pb.ProduceRequest(
        acks=acks,
        timeout_ms=timeout_ms,
        partitions=[pb.PartitionProduceData(topic=topic, partition=partition, record_batch=batch)],
    )


def fetch_request(
    offset: int,
    *,
    epoch: int = -1,
    max_wait_ms: int = 0,
    topic: str = TOPIC,
    fmt: int = pb.RECORD_FORMAT_BATCHES,
    max_bytes: int = 1 << 24,
) -> pb.FetchRequest:
    return consumer_fetch(
        topic,
        0,
        offset,
        leader_epoch=epoch,
        max_wait_ms=max_wait_ms,
        min_bytes=1,
        max_bytes=max_bytes,
        record_format=fmt,
    )


@pytest.fixture
async def leader(start_broker: Callable[..., Any]) -> Any:
    """A broker leading events-0 at leader epoch 1."""
    _, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    return client


async def produce_ok(client: Any, batch: bytes, acks: int = 1) -> int:
    response = await client.service.Produce(produce_request(batch, acks))
    result = response.partitions[0]
    assert result.error_code == ErrorCode.NONE, result.error_message
    return result.base_offset


async def test_round_trip_serves_stored_bytes(leader: Any) -> None:
    batches = [
        batch_of([f"v{i}-{j}".encode() for j in range(5)], compression=c)
        for i, c in enumerate(
            [Compression.NONE, Compression.GZIP, Compression.LZ4, Compression.ZSTD]
        )
    ]
    offsets = [
        await produce_ok(leader, b, acks=a) for b, a in zip(batches, [1, -1, 1, 0], strict=True)
    ]
    assert offsets == [0, 5, 10, 15]

    response = await leader.service.Fetch(fetch_request(0))
    result = response.partitions[0]
    assert result.error_code == ErrorCode.NONE
    assert result.high_watermark == 20
    served = result.record_batches
    pos = 0
    for sent, base in zip(batches, offsets, strict=True):
        header = read_header(served, pos)
        assert header.base_offset == base
        assert header.partition_leader_epoch == 1
        # Everything but the broker-patched base offset and leader epoch is byte-identical.
        assert served[pos + 17 : pos + header.size] == sent[17:]
        pos += header.size
    assert pos == len(served)
    values = [r.value for r in decode_batches(served)]
    assert values == [f"v{i}-{j}".encode() for i in range(4) for j in range(5)]


async def test_plain_records_for_clients_without_batches(leader: Any) -> None:
    request = pb.ProduceRequest(
        acks=1,
        partitions=[
            pb.PartitionProduceData(
                topic=TOPIC,
                partition=0,
                records=[
                    common_pb2.Record(
                        key=b"a", value=b"1", headers=[common_pb2.RecordHeader(key="h", value=b"x")]
                    ),
                    common_pb2.Record(value=b"2", timestamp_ms=1234),
                ],
            )
        ],
    )
    response = await leader.service.Produce(request)
    assert response.partitions[0].error_code == ErrorCode.NONE
    fetched = await leader.service.Fetch(fetch_request(1, fmt=pb.RECORD_FORMAT_RECORDS))
    records = fetched.partitions[0].records
    assert [(r.offset, r.value, r.timestamp_ms) for r in records] == [(1, b"2", 1234)]
    assert not records[0].HasField("key")
    everything = await leader.service.Fetch(fetch_request(0, fmt=pb.RECORD_FORMAT_RECORDS))
    first = everything.partitions[0].records[0]
    assert (first.key, first.value, first.headers[0].key, first.headers[0].value) == (
        b"a",
        b"1",
        "h",
        b"x",
    )


async def test_plain_records_whose_timestamps_leave_int64_are_invalid_timestamp(
    leader: Any,
) -> None:
    """Review 32 #5: their deltas did not fit the encoding, and the encoder's ValueError
    answered UNKNOWN_SERVER_ERROR (with a traceback in the broker's log)."""
    records = [common_pb2.Record(value=b"a", timestamp_ms=t) for t in (-(2**63), 2**63 - 1)]
    response = await leader.service.Produce(
        pb.ProduceRequest(
            acks=1, partitions=[pb.PartitionProduceData(topic=TOPIC, partition=0, records=records)]
        )
    )
    assert response.partitions[0].error_code == ErrorCode.INVALID_TIMESTAMP
    assert "too far apart" in response.partitions[0].error_message


async def test_long_poll_fetch_wakes_on_new_data(start_broker: Callable[..., Any]) -> None:
    server, leader = await start_broker(1)
    await make_leader(leader.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    waiting = asyncio.ensure_future(leader.service.Fetch(fetch_request(0, max_wait_ms=30_000)))
    await eventually(lambda: server.replica_manager.fetch_purgatory.watched == 1, 10)
    assert not waiting.done()
    await produce_ok(leader, batch_of([b"hello"]))
    response = await asyncio.wait_for(waiting, 20)
    assert [r.value for r in decode_batches(response.partitions[0].record_batches)] == [b"hello"]


async def test_long_poll_returns_empty_after_max_wait(leader: Any) -> None:
    response = await leader.service.Fetch(fetch_request(0, max_wait_ms=50))
    assert response.partitions[0].error_code == ErrorCode.NONE
    assert response.partitions[0].record_batches == b""


async def test_a_long_poll_whose_client_has_gone_waits_no_more(
    start_broker: Callable[..., Any],
) -> None:
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    purgatory = server.replica_manager.fetch_purgatory
    reads: list[int] = []
    read_partitions = server.replica_manager._read_partitions
    server.replica_manager._read_partitions = lambda *a: reads.append(1) or read_partitions(*a)
    # The longest wait a client may ask for; the broker takes it as asked, as Kafka's does.
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await client.service.Fetch(fetch_request(0, max_wait_ms=2**31 - 1), timeout=0.2)
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: purgatory.watched == 0, 10, 0.01)
    assert reads == []  # nothing read for a client that is not there


async def test_a_follower_long_poll_with_a_diverging_epoch_is_answered_at_once(
    start_broker: Callable[..., Any],
) -> None:
    _, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1, 2])
    await produce_ok(client, batch_of([b"a", b"b"]))  # epoch 1: offsets 0-1
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=3, replicas=[1, 2], isr=[1])
    await produce_ok(client, batch_of([b"c", b"d", b"e"]))  # epoch 3: offsets 2-4
    # A follower whose log ends at 5 in epoch 2, which this leader never had: its history
    # agrees up to where epoch 1 ends.
    fetch = pb.FetchRequest(replica_id=2, max_wait_ms=60_000, min_bytes=1, max_bytes=1 << 20)
    fetch.partitions.add(
        topic=TOPIC, partition=0, fetch_offset=5, current_leader_epoch=3, last_fetched_epoch=2
    )
    response = await asyncio.wait_for(client.service.Fetch(fetch), 20)
    result = response.partitions[0]
    assert result.error_code == ErrorCode.NONE
    assert (result.diverging_epoch.epoch, result.diverging_epoch.end_offset) == (1, 2)


async def test_a_broker_not_registered_yet_refuses_control_requests_naming_an_epoch(
    start_broker: Callable[..., Any],
) -> None:
    """Review 20 H1: a broker restarted at its address listens before it registers. The
    controller still retried a LeaderAndIsr queued for its previous incarnation (epoch 41),
    which it obeyed, leading with the shorter log a power loss left it, and a follower
    truncated committed records to match. It refuses any request naming a broker epoch until
    it has one (a tool's, naming none, still goes)."""
    server, client = await start_broker(1)
    request = leader_and_isr_request(TOPIC, 0, leader=1, leader_epoch=7, replicas=[1, 2])
    request.broker_epoch = 41
    response = await client.control.LeaderAndIsr(request)
    assert response.error_code == ErrorCode.STALE_BROKER_EPOCH, ErrorCode.Name(response.error_code)
    assert (TOPIC, 0) not in server.replica_manager.partitions
    request.broker_epoch = 0
    assert (await client.control.LeaderAndIsr(request)).error_code == ErrorCode.NONE


async def test_a_follower_fetch_from_a_stale_incarnation_is_refused_whole(
    start_broker: Callable[..., Any],
) -> None:
    """KIP-903: the controller says broker 2 registered at epoch 50; a fetch of its epoch 49
    is refused as a whole, with nothing recorded (no progress, no session, no ISR change)."""
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1, 2], isr=[1])
    await produce_ok(client, batch_of([b"a", b"b"]))
    metadata = cluster_pb2.UpdateMetadataRequest(controller_epoch=1)
    metadata.live_brokers.add(broker_id=1, broker_epoch=10)
    metadata.live_brokers.add(broker_id=2, broker_epoch=50)
    assert (await client.control.UpdateMetadata(metadata)).error_code == ErrorCode.NONE
    state = server.replica_manager.partitions[(TOPIC, 0)].state

    async def follower_fetch(broker_epoch: int) -> pb.FetchResponse:
        fetch = pb.FetchRequest(replica_id=2, replica_broker_epoch=broker_epoch, max_bytes=1 << 20)
        fetch.partitions.add(
            topic=TOPIC, partition=0, fetch_offset=2, current_leader_epoch=1, last_fetched_epoch=1
        )
        return await asyncio.wait_for(client.service.Fetch(fetch), 20)

    stale = await follower_fetch(49)
    assert stale.error_code == ErrorCode.STALE_BROKER_EPOCH, ErrorCode.Name(stale.error_code)
    assert (list(stale.partitions), stale.session_id) == ([], 0)
    assert state.remote_replicas[2].log_end_offset == -1
    # Without an epoch (a tool) the fetch is served, but does not bring broker 2 into the ISR:
    # only fetches of the incarnation the leader knows do.
    unchecked = await follower_fetch(0)
    assert unchecked.error_code == ErrorCode.NONE
    assert unchecked.partitions[0].error_code == ErrorCode.NONE
    assert state.remote_replicas[2].log_end_offset == 2
    assert state.isr_state.proposed is None
    current = await follower_fetch(50)
    assert current.error_code == ErrorCode.NONE
    assert state.remote_replicas[2].broker_epoch == 50
    assert state.isr_state.proposed == {1, 2}


async def test_a_follower_in_controlled_shutdown_is_served_but_not_let_into_the_isr(
    start_broker: Callable[..., Any],
) -> None:
    """KIP-841: the controller marks broker 2 as in controlled shutdown (live: it still serves
    what it leads). Its fetches are answered, and it is proposed into no ISR until the
    controller names it usable again."""
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1, 2], isr=[1])
    await produce_ok(client, batch_of([b"a", b"b"]))
    state = server.replica_manager.partitions[(TOPIC, 0)].state

    async def tell(shutting_down: bool) -> None:
        metadata = cluster_pb2.UpdateMetadataRequest(controller_epoch=1)
        metadata.live_brokers.add(broker_id=1, broker_epoch=10)
        metadata.live_brokers.add(
            broker_id=2, broker_epoch=50, in_controlled_shutdown=shutting_down
        )
        assert (await client.control.UpdateMetadata(metadata)).error_code == ErrorCode.NONE

    async def follower_fetch() -> None:
        fetch = pb.FetchRequest(replica_id=2, replica_broker_epoch=50, max_bytes=1 << 20)
        fetch.partitions.add(
            topic=TOPIC, partition=0, fetch_offset=2, current_leader_epoch=1, last_fetched_epoch=1
        )
        answer = await asyncio.wait_for(client.service.Fetch(fetch), 20)
        assert answer.partitions[0].error_code == ErrorCode.NONE

    await tell(shutting_down=True)
    await follower_fetch()
    assert state.remote_replicas[2].log_end_offset == 2
    assert state.isr_state.proposed is None
    await tell(shutting_down=False)
    await follower_fetch()
    assert state.isr_state.proposed == {1, 2}


async def test_an_acks_all_batch_commits_once_the_follower_holding_its_hw_is_unusable(
    start_broker: Callable[..., Any],
) -> None:
    """Review 22 M1 through the broker: follower 3, out of the ISR (its controlled shutdown
    began, the controller refused it back in), caught up, so it held the HW as a follower
    about to join. An acks=all batch that broker 2 fetched, and 3 did not, waited on it; the
    UpdateMetadata marking 3 in controlled shutdown moved no LEO, and nothing recomputed the
    HW: the produce timed out. It completes once the broker learns 3 is not usable."""
    server, client = await start_broker(1)
    await make_leader(
        client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1, 2, 3], isr=[1, 2]
    )
    await produce_ok(client, batch_of([b"a", b"b"]))
    state = server.replica_manager.partitions[(TOPIC, 0)].state

    async def tell(shutting_down: set[int]) -> None:
        metadata = cluster_pb2.UpdateMetadataRequest(controller_epoch=1)
        for broker_id in (1, 2, 3):
            metadata.live_brokers.add(
                broker_id=broker_id, in_controlled_shutdown=broker_id in shutting_down
            )
        assert (await client.control.UpdateMetadata(metadata)).error_code == ErrorCode.NONE

    async def follower_fetch(replica_id: int, offset: int) -> None:
        fetch = pb.FetchRequest(replica_id=replica_id, max_bytes=1 << 20)
        fetch.partitions.add(
            topic=TOPIC,
            partition=0,
            fetch_offset=offset,
            current_leader_epoch=1,
            last_fetched_epoch=1,
        )
        answer = await asyncio.wait_for(client.service.Fetch(fetch), 20)
        assert answer.partitions[0].error_code == ErrorCode.NONE

    await tell(set())
    await follower_fetch(2, 2)
    await follower_fetch(3, 2)
    proposed = state.isr_state.proposed
    assert proposed == {1, 2, 3}
    # The controller refuses it: 3 is shutting down (its UpdateMetadata not here yet).
    proposal = AlterIsrProposal(TOPIC, 0, 1, (1, 2, 3), state.partition_epoch, (-1, -1, -1))
    refusal = TidewaterError("shutting down", ErrorCode.INELIGIBLE_REPLICA)
    state.on_alter_isr_result(proposal, None, refusal, server.replica_manager.time_ms())
    assert state.isr == {1, 2} and state.high_watermark == 2

    produced = asyncio.ensure_future(client.service.Produce(produce_request(batch_of([b"c"]), -1)))
    partition = server.replica_manager.partitions[(TOPIC, 0)]
    await eventually(lambda: partition.log.log_end_offset == 3, 20)
    await follower_fetch(2, 3)
    assert state.high_watermark == 2  # 3, caught up within its lag time, holds it
    assert not produced.done()
    await tell({3})
    response = await asyncio.wait_for(produced, 20)
    assert response.partitions[0].error_code == ErrorCode.NONE
    assert state.high_watermark == 3


async def test_list_offsets(leader: Any) -> None:
    for ts in (1000, 2000, 3000):
        await produce_ok(leader, build_batch([Record(value=b"x", timestamp_ms=ts)] * 2))

    async def offset(spec: int, ts: int = 0) -> tuple[int, int]:
        response = await leader.service.ListOffsets(list_offsets(TOPIC, 0, spec, timestamp_ms=ts))
        result = response.partitions[0]
        assert result.error_code == ErrorCode.NONE
        return result.offset, result.timestamp_ms

    assert (await offset(pb.OFFSET_SPEC_EARLIEST))[0] == 0
    assert (await offset(pb.OFFSET_SPEC_LATEST))[0] == 6
    assert await offset(pb.OFFSET_SPEC_TIMESTAMP, 1500) == (2, 2000)
    assert await offset(pb.OFFSET_SPEC_TIMESTAMP, 3000) == (4, 3000)
    assert (await offset(pb.OFFSET_SPEC_TIMESTAMP, 9999))[0] == -1


async def test_list_offsets_from_a_replica_id_that_is_no_replica_is_refused(leader: Any) -> None:
    """Review 32 #4: a client that left replica_id at proto3's default (0) was answered as a
    replica, the LEO as LATEST: past the HW, an offset not committed."""
    request = list_offsets(TOPIC, 0, pb.OFFSET_SPEC_LATEST)
    request.replica_id = 0
    result = (await leader.service.ListOffsets(request)).partitions[0]
    assert result.error_code == ErrorCode.INVALID_REQUEST
    assert "a consumer sends -1" in result.error_message
    request.replica_id = 1  # the leader's own id: a replica (debugging tools)
    assert (await leader.service.ListOffsets(request)).partitions[0].error_code == ErrorCode.NONE


async def test_offset_for_leader_epoch(leader: Any) -> None:
    await produce_ok(leader, batch_of([b"a", b"b"]))
    await make_leader(leader.channel, TOPIC, 0, leader=1, leader_epoch=3, replicas=[1])
    await produce_ok(leader, batch_of([b"c"]))

    async def end_of(epoch: int) -> tuple[int, int]:
        response = await leader.service.OffsetForLeaderEpoch(
            pb.OffsetForLeaderEpochRequest(
                replica_id=-1,
                partitions=[
                    pb.OffsetForLeaderEpochPartition(
                        topic=TOPIC, partition=0, current_leader_epoch=3, leader_epoch=epoch
                    )
                ],
            )
        )
        result = response.partitions[0]
        assert result.error_code == ErrorCode.NONE
        return result.leader_epoch, result.end_offset

    assert await end_of(1) == (1, 2)
    assert await end_of(2) == (1, 2)
    assert await end_of(3) == (3, 3)


async def test_streams_answer_by_correlation_id(leader: Any) -> None:
    async def produce_requests() -> Any:
        for i in range(20):
            request = produce_request(batch_of([f"s{i}".encode()]), acks=-1)
            request.correlation_id = 100 + i
            yield request

    call = leader.service.ProduceStream(produce_requests())
    responses = [r async for r in call]
    assert sorted(r.correlation_id for r in responses) == list(range(100, 120))
    by_id = {r.correlation_id: r.partitions[0].base_offset for r in responses}
    assert [by_id[100 + i] for i in range(20)] == list(range(20))

    async def fetch_requests() -> Any:
        for offset in (0, 10, 19):
            request = fetch_request(offset)
            request.correlation_id = offset
            yield request

    fetched = {r.correlation_id: r async for r in leader.service.FetchStream(fetch_requests())}
    for offset in (0, 10, 19):
        first = next(decode_batches(fetched[offset].partitions[0].record_batches))
        assert first.offset == offset


@pytest.mark.usefixtures("off_loop_writes")
@pytest.mark.parametrize("idempotent", [False, True])
async def test_a_produce_stream_appends_its_requests_in_arrival_order(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, idempotent: bool
) -> None:
    """Request 1 appends to partition 0, whose write waits for the disk (here: a gate), then
    to partition 1; request 2, pipelined behind it on the same stream, appends to partition 1
    as well. Its batch lands after request 1's, as on a Kafka connection: before, it landed
    first (a reordered partition, or for an idempotent producer a spurious
    OUT_OF_ORDER_SEQUENCE)."""
    server, client = await start_broker(1)
    for partition in (0, 1):
        await make_leader(client.channel, TOPIC, partition, leader=1, leader_epoch=1, replicas=[1])
    rm = server.replica_manager
    segment = rm.partitions[(TOPIC, 0)].log.segments[-1]
    write, gate = segment.write, threading.Event()

    def write_when_the_gate_opens(data: bytes, drop_behind_bytes: int) -> None:
        gate.wait(WAIT_S)
        write(data, drop_behind_bytes)

    monkeypatch.setattr(segment, "write", write_when_the_gate_opens)
    produce, arrived = rm.produce, []

    def arrival(request: pb.ProduceRequest, *args: Any) -> Any:
        arrived.append(request.correlation_id)
        return produce(request, *args)

    monkeypatch.setattr(rm, "produce", arrival)

    def batch(value: bytes, sequence: int) -> bytes:
        if not idempotent:
            return batch_of([value])
        return batch_of([value], producer_id=1000, producer_epoch=0, base_sequence=sequence)

    def request(correlation_id: int, *batches: tuple[int, bytes, int]) -> pb.ProduceRequest:
        return pb.ProduceRequest(
            acks=-1,
            timeout_ms=int(WAIT_S * 1000),
            correlation_id=correlation_id,
            partitions=[
                pb.PartitionProduceData(
                    topic=TOPIC, partition=partition, record_batch=batch(value, sequence)
                )
                for partition, value, sequence in batches
            ],
        )

    call = client.service.ProduceStream()
    try:
        await call.write(request(1, (0, b"stalled", 0), (1, b"first", 0)))
        await call.write(request(2, (1, b"second", 1)))
        await eventually(lambda: arrived == [1, 2], WAIT_S)
    finally:
        gate.set()
    answers = {}
    async with asyncio.timeout(WAIT_S):
        for _ in range(2):
            answer = await call.read()
            answers[answer.correlation_id] = [
                (p.error_code, p.base_offset) for p in answer.partitions
            ]
    await call.done_writing()
    assert answers == {1: [(ErrorCode.NONE, 0), (ErrorCode.NONE, 0)], 2: [(ErrorCode.NONE, 1)]}
    stored = rm.partitions[(TOPIC, 1)].log.read(0, 1 << 20)
    assert [r.value for r in decode_batches(stored)] == [b"first", b"second"]


async def test_health_and_reflection(leader: Any) -> None:
    health = health_pb2_grpc.HealthStub(leader.channel)
    for service in ("", "tidewater.v1.BrokerService", "tidewater.v1.BrokerControl"):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(leader.channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name async for r in responses for s in r.list_services_response.service}
    assert {"tidewater.v1.BrokerService", "tidewater.v1.BrokerControl"} <= names


async def test_init_producer_id_without_a_controller_fails_with_a_named_error(
    leader: Any,
) -> None:
    response = await leader.service.InitProducerId(
        pb.InitProducerIdRequest(producer_id=-1, producer_epoch=-1)
    )
    assert response.error_code == ErrorCode.PRODUCER_ID_ALLOCATION_FAILED
    assert response.producer_id == -1


# -- bad input: a named error, and nothing acknowledged lost ---------------------------------


async def produce_error(client: Any, request: pb.ProduceRequest) -> tuple[int, str]:
    response = await client.service.Produce(request)
    result = response.partitions[0]
    assert result.base_offset == -1
    return result.error_code, result.error_message


def corrupt(batch: bytes, pos: int, value: int | None = None) -> bytes:
    data = bytearray(batch)
    data[pos] = value if value is not None else data[pos] ^ 0xFF
    return bytes(data)


@pytest.mark.parametrize(
    ("mangle", "expected"),
    [
        (lambda b: corrupt(b, len(b) - 1), ErrorCode.CORRUPT_MESSAGE),  # CRC mismatch
        (lambda b: b[:40], ErrorCode.CORRUPT_MESSAGE),  # shorter than a header
        (lambda b: b[:-3], ErrorCode.CORRUPT_MESSAGE),  # length field disagrees
        (lambda b: corrupt(b, 8, 0x80), ErrorCode.CORRUPT_MESSAGE),  # negative length
        (lambda b: corrupt(b, 16, 1), ErrorCode.UNSUPPORTED_VERSION),  # magic 1
        (lambda b: b"", ErrorCode.INVALID_REQUEST),  # no records at all
    ],
    ids=["crc", "short-header", "length-mismatch", "negative-length", "magic", "empty"],
)
async def test_malformed_batches_are_rejected(
    leader: Any, mangle: Callable[[bytes], bytes], expected: int
) -> None:
    await produce_ok(leader, batch_of([b"kept"]))
    code, message = await produce_error(leader, produce_request(mangle(batch_of([b"x", b"y"]))))
    assert ErrorCode.Name(code) == ErrorCode.Name(expected)
    # The message explains; the code travels in error_code and is not repeated in it.
    assert message and not message.startswith(ErrorCode.Name(code))
    # Nothing acknowledged is lost, and the log still takes appends at the right offset.
    assert await produce_ok(leader, batch_of([b"after"])) == 1
    records = list(
        decode_batches((await leader.service.Fetch(fetch_request(0))).partitions[0].record_batches)
    )
    assert [r.value for r in records] == [b"kept", b"after"]


async def test_record_count_disagreeing_with_bytes(leader: Any) -> None:
    from tidewater.records.header import HEADER, compute_crc

    good = bytearray(batch_of([b"a", b"b"]))
    fields = list(HEADER.unpack_from(good))
    fields[-1] = 3  # record_count
    fields[6] = 2  # last_offset_delta, so the header is self-consistent
    HEADER.pack_into(good, 0, *fields)
    HEADER.pack_into(good, 0, *fields[:4], compute_crc(good), *fields[5:])
    code, _ = await produce_error(leader, produce_request(bytes(good)))
    assert code == ErrorCode.CORRUPT_MESSAGE


async def test_snappy_is_unsupported(leader: Any) -> None:
    from tidewater.records.header import HEADER, compute_crc

    batch = bytearray(batch_of([b"a"]))
    fields = list(HEADER.unpack_from(batch))
    fields[5] = Compression.SNAPPY
    HEADER.pack_into(batch, 0, *fields)
    HEADER.pack_into(batch, 0, *fields[:4], compute_crc(batch), *fields[5:])
    code, _ = await produce_error(leader, produce_request(bytes(batch)))
    assert code == ErrorCode.UNSUPPORTED_COMPRESSION_TYPE


async def test_message_too_large(start_broker: Callable[..., Any]) -> None:
    _, client = await start_broker(1, **{"message.max.bytes": 1000})
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    code, message = await produce_error(client, produce_request(batch_of([b"x" * 2000])))
    assert code == ErrorCode.MESSAGE_TOO_LARGE
    assert "1000" in message


async def test_a_record_timestamp_out_of_the_topics_bounds_is_refused(
    start_broker: Callable[..., Any],
) -> None:
    """KIP-937: a record stamped more than message.timestamp.after.max.ms ahead of the
    leader's clock (an hour by default, as Kafka 4.0), or more than before.max.ms behind it,
    is refused with INVALID_TIMESTAMP, and nothing of its batch is appended."""
    _, client = await start_broker(1, **{"log.message.timestamp.before.max.ms": 86_400_000})
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    now = time.time_ns() // 1_000_000
    for stamp in (now + 2 * 3_600_000, now - 2 * 86_400_000):
        records = [Record(value=b"now", timestamp_ms=now), Record(value=b"x", timestamp_ms=stamp)]
        code, message = await produce_error(client, produce_request(build_batch(records)))
        assert code == ErrorCode.INVALID_TIMESTAMP, message
    assert await produce_ok(client, build_batch([Record(value=b"ok", timestamp_ms=now)])) == 0


async def test_unknown_partition_invalid_topic_and_acks(leader: Any) -> None:
    batch = batch_of([b"x"])
    assert (await produce_error(leader, produce_request(batch, partition=7)))[0] == (
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    )
    for name in ("", ".", "..", "bad/name", "x" * 250):
        assert (await produce_error(leader, produce_request(batch, topic=name)))[0] == (
            ErrorCode.INVALID_TOPIC
        ), name
    assert (await produce_error(leader, produce_request(batch, acks=2)))[0] == (
        ErrorCode.INVALID_REQUIRED_ACKS
    )
    both = produce_request(batch)
    both.partitions[0].records.add(value=b"y")
    assert (await produce_error(leader, both))[0] == ErrorCode.INVALID_REQUEST


async def test_not_leader_after_becoming_follower(leader: Any) -> None:
    await produce_ok(leader, batch_of([b"x"]))
    # Broker 2 does not run: this broker's fetches to it just fail and back off.
    await make_leader(
        leader.channel,
        TOPIC,
        0,
        leader=2,
        leader_epoch=2,
        replicas=[1, 2],
        leaders={2: "127.0.0.1:1"},
    )
    code, _ = await produce_error(leader, produce_request(batch_of([b"y"])))
    assert code == ErrorCode.NOT_LEADER_OR_FOLLOWER
    response = await leader.service.Produce(produce_request(batch_of([b"y"])))
    assert response.partitions[0].current_leader.leader_id == 2
    fetched = await leader.service.Fetch(fetch_request(0))
    assert fetched.partitions[0].error_code == ErrorCode.NOT_LEADER_OR_FOLLOWER


async def test_a_newer_partition_epoch_alone_keeps_the_role_and_the_fetch(
    start_broker: Callable[..., Any],
) -> None:
    """The controller changed the ISR or ELR alone, in the leader epoch the replicas have
    (KRaft's partition change): the follower takes the partition epoch and goes on with the
    fetch it had (before, the request was refused, FENCED_LEADER_EPOCH); the same partition
    epoch again is refused, as before."""
    server, client = await start_broker(1)
    # Broker 2 does not run: this broker's fetches to it just fail and back off.
    follow = leader_and_isr_request(
        TOPIC, 0, leader=2, leader_epoch=3, replicas=[1, 2], leaders={2: "127.0.0.1:1"}
    )

    async def answer() -> int:
        response = await client.control.LeaderAndIsr(follow)
        return response.partition_errors[0].error_code

    assert await answer() == ErrorCode.NONE
    fetchers = server.replica_manager.fetcher_manager.fetchers
    (fetching,) = [f.partitions[TOPIC, 0] for f in fetchers.values()]
    follow.partition_states[0].partition_epoch = 4
    follow.partition_states[0].isr[:] = [2]
    assert await answer() == ErrorCode.NONE
    assert server.replica_manager.partitions[TOPIC, 0].state.partition_epoch == 4
    (still,) = [f.partitions[TOPIC, 0] for f in fetchers.values()]
    assert still is fetching
    assert await answer() == ErrorCode.FENCED_LEADER_EPOCH


@pytest.mark.usefixtures("off_loop_writes")
async def test_concurrent_produces_to_a_partition_append_in_arrival_order(
    start_broker: Callable[..., Any],
) -> None:
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    values = [b"v%d" % i for i in range(8)]
    # Each append waits for the one before it to be written (off the event loop).
    responses = await asyncio.gather(
        *(server.replica_manager.produce(produce_request(batch_of([v]))) for v in values)
    )
    assert [r.partitions[0].base_offset for r in responses] == list(range(8))
    fetched = await client.service.Fetch(fetch_request(0))
    records = decode_batches(fetched.partitions[0].record_batches)
    assert [r.value for r in records] == values


@pytest.mark.usefixtures("off_loop_writes")
@pytest.mark.parametrize("delete", [False, True])
async def test_a_produce_waiting_for_its_turn_is_refused_once_the_replica_stops(
    start_broker: Callable[..., Any], delete: bool
) -> None:
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    rm = server.replica_manager
    first = asyncio.create_task(rm.produce(produce_request(batch_of([b"a"]))))
    second = asyncio.create_task(rm.produce(produce_request(batch_of([b"b"]))))
    await asyncio.sleep(0)  # the first is being written; the second waits for its turn
    stopped = await rm.stop_replica(
        pb.StopReplicaRequest(
            controller_epoch=1,
            partitions=[pb.StopReplicaPartition(topic=TOPIC, partition=0, delete_partition=delete)],
        )
    )
    assert stopped.error_code == ErrorCode.NONE, stopped.error_message
    written, refused = (await first).partitions[0], (await second).partitions[0]
    assert (written.error_code, written.base_offset) == (ErrorCode.NONE, 0)
    assert refused.error_code == ErrorCode.NOT_LEADER_OR_FOLLOWER


@pytest.mark.usefixtures("off_loop_writes")
async def test_a_new_leader_epoch_starts_after_a_batch_still_being_written(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    rm = server.replica_manager
    log = rm.partitions[(TOPIC, 0)].log
    segment = log.segments[-1]
    write, written = segment.write, threading.Event()

    def slow_write(data: bytes, drop_behind_bytes: int) -> None:
        written.wait(10)
        write(data, drop_behind_bytes)

    monkeypatch.setattr(segment, "write", slow_write)
    produce = asyncio.create_task(rm.produce(produce_request(batch_of([b"a"]))))
    await asyncio.sleep(0)  # the batch is being written, slowly
    threading.Timer(0.2, written.set).start()
    await rm.become_leader_or_follower(
        leader_and_isr_request(TOPIC, 0, leader=1, leader_epoch=2, replicas=[1])
    )
    assert (await produce).partitions[0].base_offset == 0
    assert [tuple(e) for e in log.leader_epoch_cache.epoch_entries] == [(1, 0), (2, 1)]


async def test_fetch_offset_out_of_range_and_epoch_fencing(leader: Any) -> None:
    await produce_ok(leader, batch_of([b"x", b"y"]))

    async def fetch_code(offset: int, epoch: int = -1) -> int:
        return (
            (await leader.service.Fetch(fetch_request(offset, epoch=epoch)))
            .partitions[0]
            .error_code
        )

    assert await fetch_code(3) == ErrorCode.OFFSET_OUT_OF_RANGE
    assert await fetch_code(-1) == ErrorCode.OFFSET_OUT_OF_RANGE
    assert await fetch_code(2) == ErrorCode.NONE  # the LEO itself: empty, not an error
    assert await fetch_code(0, epoch=0) == ErrorCode.FENCED_LEADER_EPOCH
    assert await fetch_code(0, epoch=2) == ErrorCode.UNKNOWN_LEADER_EPOCH
    assert await fetch_code(0, epoch=1) == ErrorCode.NONE


async def test_a_replica_that_does_not_lead_checks_the_epoch_first(
    start_broker: Callable[..., Any],
) -> None:
    """Review 19 #6: the leadership was checked before the epoch (KIP-320), and a client
    ahead of this follower (it learned of the epoch in which this replica leads first) got
    NOT_LEADER_OR_FOLLOWER, and one behind it the same, where Kafka answers
    UNKNOWN_LEADER_EPOCH (wait for the replica to learn) and FENCED_LEADER_EPOCH (refresh)."""
    _, client = await start_broker(1)
    await make_leader(
        client.channel,
        TOPIC,
        0,
        leader=2,
        leader_epoch=3,
        replicas=[1, 2],
        leaders={2: "127.0.0.1:1"},  # nobody there: it follows, fetching nothing
    )

    async def fetch_code(epoch: int) -> int:
        response = await client.service.Fetch(fetch_request(0, epoch=epoch))
        return response.partitions[0].error_code

    assert await fetch_code(4) == ErrorCode.UNKNOWN_LEADER_EPOCH
    assert await fetch_code(2) == ErrorCode.FENCED_LEADER_EPOCH
    assert await fetch_code(3) == ErrorCode.NOT_LEADER_OR_FOLLOWER


async def test_leader_and_isr_epoch_checks(leader: Any) -> None:
    stale_controller = leader_and_isr_request(
        TOPIC, 0, leader=1, leader_epoch=5, replicas=[1], controller_epoch=0
    )
    response = await leader.control.LeaderAndIsr(stale_controller)
    assert response.error_code == ErrorCode.STALE_CONTROLLER_EPOCH

    same_epoch = leader_and_isr_request(TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    response = await leader.control.LeaderAndIsr(same_epoch)
    assert response.partition_errors[0].error_code == ErrorCode.FENCED_LEADER_EPOCH

    elsewhere = leader_and_isr_request(TOPIC, 1, leader=2, leader_epoch=1, replicas=[2, 3])
    response = await leader.control.LeaderAndIsr(elsewhere)
    assert response.partition_errors[0].error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION

    bad_config = leader_and_isr_request(
        "other", 0, leader=1, leader_epoch=1, replicas=[1], configs={"retention.ms": "soon"}
    )
    response = await leader.control.LeaderAndIsr(bad_config)
    assert response.partition_errors[0].error_code == ErrorCode.INVALID_CONFIG


async def test_acks_all_checks_min_insync_replicas(start_broker: Callable[..., Any]) -> None:
    _, client = await start_broker(1)
    await make_leader(
        client.channel,
        TOPIC,
        0,
        leader=1,
        leader_epoch=1,
        replicas=[1, 2],
        isr=[1],
        configs={"min.insync.replicas": "2"},
    )
    code, message = await produce_error(client, produce_request(batch_of([b"x"]), acks=-1))
    assert code == ErrorCode.NOT_ENOUGH_REPLICAS
    assert "min.insync.replicas=2" in message
    assert await produce_ok(client, batch_of([b"x"]), acks=1) == 0


async def test_acks_all_times_out_when_the_isr_does_not_replicate(
    start_broker: Callable[..., Any],
) -> None:
    _, client = await start_broker(1)
    # Broker 2 is in the ISR but never fetches: the HW cannot cover the batch.
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1, 2])
    code, _ = await produce_error(
        client, produce_request(batch_of([b"x"]), acks=-1, timeout_ms=100)
    )
    assert code == ErrorCode.REQUEST_TIMED_OUT
    # A consumer sees nothing above the HW.
    fetched = await client.service.Fetch(fetch_request(0))
    assert fetched.partitions[0].high_watermark == 0
    assert fetched.partitions[0].record_batches == b""


async def test_retention_moves_the_log_start_offset(start_broker: Callable[..., Any]) -> None:
    _, client = await start_broker(1, **{"log.retention.check.interval.ms": 50})
    await make_leader(
        client.channel,
        TOPIC,
        0,
        leader=1,
        leader_epoch=1,
        replicas=[1],
        configs={"segment.bytes": "2000", "retention.bytes": "4000"},
    )
    for i in range(20):
        await produce_ok(client, batch_of([bytes(300) + str(i).encode()]))

    async def earliest() -> int:
        response = await client.service.ListOffsets(list_offsets(TOPIC, 0, pb.OFFSET_SPEC_EARLIEST))
        return response.partitions[0].offset

    start = await eventually(earliest, 20, 0.02)  # the first offset once retention moved it
    fetched = await client.service.Fetch(fetch_request(start))
    assert next(decode_batches(fetched.partitions[0].record_batches)).offset == start
    assert (await client.service.Fetch(fetch_request(0))).partitions[0].error_code == (
        ErrorCode.OFFSET_OUT_OF_RANGE
    )


async def test_only_the_first_data_of_a_response_may_exceed_max_bytes(leader: Any) -> None:
    await make_leader(leader.channel, TOPIC, 1, leader=1, leader_epoch=1, replicas=[1])
    for partition in (0, 1):
        request = produce_request(batch_of([bytes(500)] * 4), partition=partition)
        assert (await leader.service.Produce(request)).partitions[0].error_code == ErrorCode.NONE
    request = fetch_request(0, max_bytes=100)
    request.partitions.add().CopyFrom(request.partitions[0])
    request.partitions[1].partition = 1
    response = await leader.service.Fetch(request)
    first, second = response.partitions
    assert (first.error_code, second.error_code) == (ErrorCode.NONE, ErrorCode.NONE)
    assert len(list(decode_batches(first.record_batches))) == 4  # one whole batch, over the limit
    assert second.record_batches == b""
    assert second.high_watermark == 4


async def test_incremental_fetch_session_answers_only_partitions_with_news(leader: Any) -> None:
    await make_leader(leader.channel, TOPIC, 1, leader=1, leader_epoch=1, replicas=[1])
    full = fetch_request(0)
    full.partitions.add(topic=TOPIC, partition=1, current_leader_epoch=-1, log_start_offset=-1)
    full.session.SetInParent()  # id 0, epoch 0: open a session
    response = await leader.service.Fetch(full)
    assert response.error_code == ErrorCode.NONE
    assert [p.partition for p in response.partitions] == [0, 1]
    session_id = response.session_id
    assert session_id != 0

    def incremental(epoch: int) -> pb.FetchRequest:
        return pb.FetchRequest(
            replica_id=-1, max_bytes=1 << 20, session=pb.FetchSession(id=session_id, epoch=epoch)
        )

    response = await leader.service.Fetch(incremental(1))
    assert (response.error_code, response.session_id, list(response.partitions)) == (
        ErrorCode.NONE,
        session_id,
        [],
    )
    await produce_ok(leader, batch_of([b"news"]))
    response = await leader.service.Fetch(incremental(2))
    assert [p.partition for p in response.partitions] == [0]
    assert [r.value for r in decode_batches(response.partitions[0].record_batches)] == [b"news"]

    response = await leader.service.Fetch(incremental(2))
    assert response.error_code == ErrorCode.INVALID_FETCH_SESSION_EPOCH
    assert list(response.partitions) == []
    response = await leader.service.Fetch(
        pb.FetchRequest(replica_id=-1, session=pb.FetchSession(id=session_id + 1, epoch=1))
    )
    assert response.error_code == ErrorCode.FETCH_SESSION_ID_NOT_FOUND
    # Without a session, every partition is answered, as before.
    response = await leader.service.Fetch(fetch_request(1))
    assert response.session_id == 0
    assert [p.high_watermark for p in response.partitions] == [1]


async def test_a_fetch_overtaken_by_a_later_one_of_its_session_is_refused_alone(
    start_broker: Callable[..., Any],
) -> None:
    """A client with two fetches of one session out at once: the later one forgets
    partition 0. The earlier one, parked, answers INVALID_FETCH_SESSION_EPOCH as Kafka's
    would; the append that wakes it, and a consumer parked on the same partition, are
    answered as if nothing happened."""
    server, client = await start_broker(1)
    purgatory = server.replica_manager.fetch_purgatory
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    await make_leader(client.channel, TOPIC, 1, leader=1, leader_epoch=1, replicas=[1])

    def in_session(session_id: int, epoch: int, max_wait_ms: int = 0) -> pb.FetchRequest:
        return pb.FetchRequest(
            replica_id=-1,
            max_wait_ms=max_wait_ms,
            min_bytes=1,
            max_bytes=1 << 20,
            session=pb.FetchSession(id=session_id, epoch=epoch),
        )

    full = in_session(0, 0)
    for partition in (0, 1):
        full.partitions.add(topic=TOPIC, partition=partition, current_leader_epoch=-1)
    session_id = (await client.service.Fetch(full)).session_id
    earlier = asyncio.ensure_future(client.service.Fetch(in_session(session_id, 1, 30_000)))
    await eventually(lambda: purgatory.watched == 1, 20, 0.01)
    later = in_session(session_id, 2)
    later.forgotten.add(topic=TOPIC, partition=0)
    assert (await client.service.Fetch(later)).error_code == ErrorCode.NONE
    consumer_fetch = fetch_request(0, max_wait_ms=30_000)
    consumer_fetch.partitions[0].partition = 1
    consumer = asyncio.ensure_future(client.service.Fetch(consumer_fetch))
    await eventually(lambda: purgatory.watched == 2, 20, 0.01)

    response = await client.service.Produce(produce_request(batch_of([b"v"]), partition=1))
    assert (response.partitions[0].error_code, response.partitions[0].base_offset) == (0, 0)
    answered = await asyncio.wait_for(earlier, 20)
    assert answered.error_code == ErrorCode.INVALID_FETCH_SESSION_EPOCH
    assert list(answered.partitions) == []
    records = (await asyncio.wait_for(consumer, 20)).partitions[0].record_batches
    assert [r.value for r in decode_batches(records)] == [b"v"]
    assert purgatory.watched == 0


def garbled_batch(codec: Compression, count: int = 1) -> bytes:
    """A compressed batch of `count` records whose body is garbage under a good CRC:
    undecodable when read."""
    data = bytearray(batch_of([b"v" * 100] * count, compression=codec))
    data[HEADER_SIZE:] = b"\x5a" * (len(data) - HEADER_SIZE)
    struct.pack_into(">I", data, CRC_OFFSET, compute_crc(data))
    return bytes(data)


@pytest.mark.parametrize("count", [1, 2000], ids=["on-the-loop", "in-a-worker"])
@pytest.mark.parametrize(
    "codec", [Compression.GZIP, Compression.LZ4, Compression.ZSTD], ids=["gzip", "lz4", "zstd"]
)
async def test_a_compressed_batch_whose_records_do_not_decode_is_refused(
    leader: Any, monkeypatch: pytest.MonkeyPatch, codec: Compression, count: int
) -> None:
    """The leader decompresses a compressed batch and checks its records before storing it,
    as Kafka's LogValidator does: garbage under a good CRC answers CORRUPT_MESSAGE for its
    partition, nothing appended. Before, it was stored, and every consumer failed on it. A
    batch of more than 1,024 records is checked in a worker thread, off the event loop."""
    checked_on_loop, checked = [], replica_manager.check_compressed_records

    def check(*args: Any) -> None:
        checked_on_loop.append(threading.current_thread() is threading.main_thread())
        checked(*args)

    monkeypatch.setattr(replica_manager, "check_compressed_records", check)
    kept = batch_of([b"kept"] * count, compression=codec)
    assert await produce_ok(leader, kept) == 0
    code, message = await produce_error(leader, produce_request(garbled_batch(codec, count)))
    assert (code, codec.name in message) == (ErrorCode.CORRUPT_MESSAGE, True)
    assert await produce_ok(leader, batch_of([b"after"], compression=codec)) == count
    assert checked_on_loop == [count == 1, count == 1, True]
    response = await leader.service.Fetch(fetch_request(0, fmt=pb.RECORD_FORMAT_RECORDS))
    [result] = response.partitions
    assert result.error_code == ErrorCode.NONE
    assert [r.value for r in result.records] == [b"kept"] * count + [b"after"]


class HeldChecks:
    """check_compressed_records stood in for: each check records the thread it ran in and how
    many ran at once, and the first waits until release() (the others do not wait)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[str] = []
        self.most_at_once = 0
        self._running = 0
        self._lock = threading.Lock()
        self._go = threading.Event()
        self._check = replica_manager.check_compressed_records
        monkeypatch.setattr(replica_manager, "check_compressed_records", self._held)

    def _held(self, *args: Any) -> None:
        with self._lock:
            self.threads.append(threading.current_thread().name)
            self._running += 1
            self.most_at_once = max(self.most_at_once, self._running)
            first = len(self.threads) == 1
        try:
            if first:
                self._go.wait(WAIT_S)
            self._check(*args)
        finally:
            with self._lock:
                self._running -= 1

    def release(self) -> None:
        self._go.set()


def appends_entered(monkeypatch: pytest.MonkeyPatch, partition: Any) -> list[int]:
    """The record counts of the batches that reached the partition's append_as_leader, in
    order (appended or waiting for their turn)."""
    entered: list[int] = []
    append_as_leader = partition.append_as_leader

    async def counted(batch: bytearray, *args: Any) -> Any:
        entered.append(read_header(batch).record_count)
        return await append_as_leader(batch, *args)

    monkeypatch.setattr(partition, "append_as_leader", counted)
    return entered


@pytest.mark.parametrize("idempotent", [False, True], ids=["plain", "idempotent"])
async def test_unary_produces_append_in_arrival_order_while_a_compressed_one_is_checked(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, idempotent: bool
) -> None:
    """Unary produce A, a compressed batch checked in a worker thread, then B, a small
    uncompressed batch, to one partition: B waits for A's turn, as before the leader checked
    compressed records. Before, B was appended while A's records were checked (B at offset
    0, A after it; with one idempotent producer B, sequence 2,000, was refused, the
    partition not having A's sequences 0..1,999 yet)."""
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    ids: dict[str, Any] = {}
    if idempotent:
        init = await client.service.InitProducerId(pb.InitProducerIdRequest())
        ids = {"producer_id": init.producer_id, "producer_epoch": init.producer_epoch}
    checks = HeldChecks(monkeypatch)
    entered = appends_entered(monkeypatch, server.replica_manager.partitions[(TOPIC, 0)])
    a = batch_of([b"A"] * 2000, compression=Compression.ZSTD, base_sequence=0, **ids)
    call_a = asyncio.ensure_future(client.service.Produce(produce_request(a)))
    await eventually(lambda: len(checks.threads) == 1, WAIT_S, 0.01)
    b = batch_of([b"B"], base_sequence=2000, **ids)
    call_b = asyncio.ensure_future(client.service.Produce(produce_request(b)))
    # B reached the partition: appended, or waiting for its turn.
    await eventually(lambda: 1 in entered, WAIT_S, 0.01)
    checks.release()
    answers = [(await call).partitions[0] for call in (call_a, call_b)]
    assert [(p.error_code, p.base_offset) for p in answers] == [(0, 0), (0, 2000)]
    assert entered == [2000, 1]
    response = await client.service.Fetch(fetch_request(0, fmt=pb.RECORD_FORMAT_RECORDS))
    assert [r.value for r in response.partitions[0].records] == [b"A"] * 2000 + [b"B"]


async def test_compressed_batches_are_checked_one_at_a_time_off_the_default_executor(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three large compressed batches to three partitions at once are checked in the
    broker's own checking thread, one at a time, and the checkpoints (on the default
    executor, here of one thread) do not wait behind them. Before, the checks ran on the
    default executor: with the first one held, the recovery-point and log-start checkpoint
    waited for it."""
    loop = asyncio.get_running_loop()
    default = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(default)
    server, client = await start_broker(1)
    rm = server.replica_manager
    for partition in range(3):
        await make_leader(client.channel, TOPIC, partition, leader=1, leader_epoch=1, replicas=[1])
    checks = HeldChecks(monkeypatch)
    batch = batch_of([b"v"] * 2000, compression=Compression.LZ4)
    calls = [
        asyncio.ensure_future(client.service.Produce(produce_request(batch, partition=p)))
        for p in range(3)
    ]
    try:
        await eventually(lambda: len(checks.threads) == 1, WAIT_S, 0.01)
        async with asyncio.timeout(WAIT_S):
            await rm.log_manager._checkpoint_offsets_off_loop()
            await rm.checkpoint_high_watermarks_off_loop()
    finally:
        checks.release()
    answers = [(await call).partitions[0] for call in calls]
    assert [(p.error_code, p.base_offset) for p in answers] == [(0, 0)] * 3
    assert len(checks.threads) == 3 and checks.most_at_once == 1
    assert all(name.startswith("batch-check") for name in checks.threads), checks.threads


async def test_a_batch_whose_records_decompress_past_the_bound_is_refused_saying_so(
    leader: Any,
) -> None:
    """A 2 KiB zstd batch whose record decompresses to 64 MiB and more is refused
    CORRUPT_MESSAGE, the answer naming the broker's 64 MiB bound rather than a bare size."""
    bomb = build_batch([Record(key=None, value=bytes(64 << 20))], compression=Compression.ZSTD)
    assert len(bomb) < 16 * 1024
    code, message = await produce_error(leader, produce_request(bomb))
    assert code == ErrorCode.CORRUPT_MESSAGE
    assert "decompress to more than 64 MiB, the most the broker decompresses" in message


async def test_a_batch_that_does_not_decode_fails_only_its_partition_of_a_records_fetch(
    start_broker: Callable[..., Any],
) -> None:
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    await make_leader(client.channel, TOPIC, 1, leader=1, leader_epoch=1, replicas=[1])
    await client.service.Produce(produce_request(batch_of([b"fine"]), partition=1))
    request = fetch_request(0, max_wait_ms=30_000, fmt=pb.RECORD_FORMAT_RECORDS)
    request.partitions.add(topic=TOPIC, partition=1, fetch_offset=1, current_leader_epoch=-1)
    parked = asyncio.ensure_future(client.service.Fetch(request))
    await eventually(lambda: server.replica_manager.fetch_purgatory.watched == 1, 20, 0.01)

    # A batch stored before the leader checked compressed records (produce refuses it now),
    # appended as produce would. The append that wakes the parked fetch is not failed with
    # the fetch's error.
    partition = server.replica_manager.partitions[(TOPIC, 0)]
    garbled = bytearray(garbled_batch(Compression.GZIP))
    info, _ = await partition.append_as_leader(garbled, 1, 0)
    assert info.first_offset == 0
    server.replica_manager._partition_changed((TOPIC, 0))
    garbled, fine = (await asyncio.wait_for(parked, 20)).partitions
    assert garbled.error_code == ErrorCode.CORRUPT_MESSAGE and not garbled.records
    assert (fine.error_code, fine.high_watermark) == (ErrorCode.NONE, 1)
    request.partitions[1].fetch_offset = 0
    answered = await client.service.Fetch(request)
    assert [p.error_code for p in answered.partitions] == [ErrorCode.CORRUPT_MESSAGE, 0]
    assert [r.value for r in answered.partitions[1].records] == [b"fine"]


async def test_a_produce_whose_completion_check_fails_answers_alone_on_its_stream(
    start_broker: Callable[..., Any],
) -> None:
    """Three acks=all produces wait on one ProduceStream; checking the first raises (a bug).
    It answers UNKNOWN_SERVER_ERROR; the others are answered as usual and the stream goes
    on, rather than the error failing the stream and every request waiting on it."""
    server, client = await start_broker(1)
    rm = server.replica_manager
    for partition in (0, 1):
        await make_leader(
            client.channel, TOPIC, partition, leader=1, leader_epoch=1, replicas=[1, 2]
        )
    call = client.service.ProduceStream()
    for correlation_id, value, partition in ((1, b"A", 0), (2, b"B", 0), (3, b"C", 1)):
        request = produce_request(
            batch_of([value]), acks=-1, partition=partition, timeout_ms=int(WAIT_S * 1000)
        )
        request.correlation_id = correlation_id
        await call.write(request)
    await eventually(lambda: rm.produce_purgatory.watched == 3, WAIT_S, 0.01)

    def enough_replicas_for(required_offset: int) -> bool:
        if required_offset == 1:
            raise RuntimeError("a bug in A's check")
        return True  # B, at offset 1, is committed

    rm.partitions[(TOPIC, 0)].state.enough_replicas_for = enough_replicas_for  # type: ignore[method-assign]
    rm._partition_changed((TOPIC, 0))
    answers = {}
    async with asyncio.timeout(WAIT_S):
        for _ in range(2):
            answer = await call.read()
            answers[answer.correlation_id] = answer.partitions[0]
    assert answers[1].error_code == ErrorCode.UNKNOWN_SERVER_ERROR
    assert "a bug in A's check" in answers[1].error_message and answers[1].base_offset == -1
    assert (answers[2].error_code, answers[2].base_offset) == (ErrorCode.NONE, 1)

    rm.partitions[(TOPIC, 1)].state.enough_replicas_for = lambda _: True  # type: ignore[method-assign]
    rm._partition_changed((TOPIC, 1))
    answer = await asyncio.wait_for(call.read(), WAIT_S)
    assert answer.correlation_id == 3
    assert (answer.partitions[0].error_code, answer.partitions[0].base_offset) == (0, 0)
    await call.done_writing()
    assert await asyncio.wait_for(call.code(), WAIT_S) == grpc.StatusCode.OK
    assert rm.produce_purgatory.watched == 0


async def test_a_fetch_whose_completion_check_fails_answers_alone_on_its_stream(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two long polls wait on one FetchStream; checking the first, woken by an append,
    raises (a bug). Its partition answers UNKNOWN_SERVER_ERROR; the other poll is answered
    as usual and the stream goes on."""
    server, client = await start_broker(1)
    rm = server.replica_manager
    for partition in (0, 1):
        await make_leader(client.channel, TOPIC, partition, leader=1, leader_epoch=1, replicas=[1])
    call = client.service.FetchStream()
    for correlation_id, partition in ((1, 0), (2, 1)):
        request = fetch_request(0, max_wait_ms=int(WAIT_S * 1000))
        request.correlation_id, request.partitions[0].partition = correlation_id, partition
        await call.write(request)
    await eventually(lambda: rm.fetch_purgatory.watched == 2, WAIT_S, 0.01)
    readable = rm._readable

    def broken(partitions: list[pb.FetchPartition], for_follower: bool) -> bool:
        if partitions[0].partition == 0:
            raise RuntimeError("a bug in checking partition 0")
        return readable(partitions, for_follower)

    monkeypatch.setattr(rm, "_readable", broken)
    assert await produce_ok(client, batch_of([b"p0"])) == 0  # wakes the first poll
    answer = await asyncio.wait_for(call.read(), WAIT_S)
    assert answer.correlation_id == 1
    [failed] = answer.partitions
    assert failed.error_code == ErrorCode.UNKNOWN_SERVER_ERROR and not failed.record_batches
    assert "a bug in checking partition 0" in failed.error_message

    await client.service.Produce(produce_request(batch_of([b"p1"]), partition=1))
    answer = await asyncio.wait_for(call.read(), WAIT_S)
    assert answer.correlation_id == 2
    assert [r.value for r in decode_batches(answer.partitions[0].record_batches)] == [b"p1"]
    await call.done_writing()
    assert await asyncio.wait_for(call.code(), WAIT_S) == grpc.StatusCode.OK


def fail_for_topic(monkeypatch: pytest.MonkeyPatch, rm: Any, topic: str) -> None:
    """A bug in looking up the partitions of `topic`: an exception that is not an answer,
    raised by the produce or fetch handler itself, outside the purgatory."""
    leader_partition = rm._leader_partition

    def broken(tp: tuple[str, int], *args: Any) -> Any:
        if tp[0] == topic:
            raise RuntimeError(f"a bug in looking up {tp[0]}-{tp[1]}")
        return leader_partition(tp, *args)

    monkeypatch.setattr(rm, "_leader_partition", broken)


async def stream_answers(call: Any) -> dict[int, list[pb.PartitionProduceResponse]]:
    """Each answer's partitions by correlation id, once the written ProduceStream ends (OK)."""
    await call.done_writing()
    async with asyncio.timeout(WAIT_S):
        answers = {answer.correlation_id: list(answer.partitions) async for answer in call}
        assert await call.code() == grpc.StatusCode.OK
    return answers


async def test_a_partition_whose_append_raises_answers_alone_on_its_stream(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, logged: Logged
) -> None:
    """Request 2 of three on one ProduceStream raises in its handler (a bug) for its first
    partition. That partition answers UNKNOWN_SERVER_ERROR; its other partition is appended
    and answered as usual, as Kafka's appendToLocalLog fails only the partition that threw;
    requests 1 and 3 are answered as usual and the stream ends cleanly. Before, the whole
    request answered UNKNOWN_SERVER_ERROR, its appended batch included (a retry would have
    stored it twice)."""
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    fail_for_topic(monkeypatch, server.replica_manager, "broken")
    call = client.service.ProduceStream()
    for correlation_id, topics in ((1, [TOPIC]), (2, ["broken", TOPIC]), (3, [TOPIC])):
        request = pb.ProduceRequest(
            acks=1,
            correlation_id=correlation_id,
            partitions=[
                pb.PartitionProduceData(
                    topic=topic, partition=0, record_batch=batch_of([b"v%d" % correlation_id])
                )
                for topic in topics
            ],
        )
        await call.write(request)
    answers = await stream_answers(call)
    assert [(p.error_code, p.base_offset) for p in answers[1]] == [(ErrorCode.NONE, 0)]
    assert [(p.topic, p.error_code, p.base_offset) for p in answers[2]] == [
        ("broken", ErrorCode.UNKNOWN_SERVER_ERROR, -1),
        (TOPIC, ErrorCode.NONE, 1),
    ]
    assert "a bug in looking up broken-0" in answers[2][0].error_message
    assert [(p.error_code, p.base_offset) for p in answers[3]] == [(ErrorCode.NONE, 2)]
    response = await client.service.Fetch(fetch_request(0, fmt=pb.RECORD_FORMAT_RECORDS))
    assert [r.value for r in response.partitions[0].records] == [b"v1", b"v2", b"v3"]
    assert logged(logging.ERROR, "produce to broken-0 failed")


async def test_a_produce_whose_handler_raises_answers_alone_on_its_stream(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, logged: Logged
) -> None:
    """Request 2 of three on one ProduceStream raises in its handler outside the appends (a
    bug). It answers UNKNOWN_SERVER_ERROR for each of its partitions, saying its batches may
    be in the log; requests 1 and 3 are answered as usual and the stream ends cleanly.
    Before, the error ended the stream with gRPC UNKNOWN and request 3 went unanswered."""
    server, client = await start_broker(1)
    rm = server.replica_manager
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    append_all = rm._append_all

    async def broken(request: pb.ProduceRequest, *args: Any) -> Any:
        answer = await append_all(request, *args)
        if request.correlation_id == 2:
            raise RuntimeError("a bug after appending")
        return answer

    monkeypatch.setattr(rm, "_append_all", broken)
    call = client.service.ProduceStream()
    for correlation_id in (1, 2, 3):
        request = produce_request(batch_of([b"v"]))
        request.correlation_id = correlation_id
        await call.write(request)
    answers = await stream_answers(call)
    assert [(p.error_code, p.base_offset) for p in answers[1]] == [(ErrorCode.NONE, 0)]
    [failed] = answers[2]
    assert (failed.error_code, failed.base_offset) == (ErrorCode.UNKNOWN_SERVER_ERROR, -1)
    assert "a bug after appending" in failed.error_message
    assert "may be in the log" in failed.error_message
    assert [(p.error_code, p.base_offset) for p in answers[3]] == [(ErrorCode.NONE, 2)]
    assert logged(logging.ERROR, "stream request failed")


async def test_a_fetch_whose_handler_raises_answers_alone_on_its_stream(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, logged: Logged
) -> None:
    """Request 2 of three on one FetchStream raises in its handler (a bug). It answers
    UNKNOWN_SERVER_ERROR, as a whole and for each of its partitions; requests 1 and 3 get
    their records and the stream ends cleanly. Before, the error ended the stream with gRPC
    UNKNOWN and request 3 went unanswered."""
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    for value in (b"a", b"b"):
        await produce_ok(client, batch_of([value]))
    fail_for_topic(monkeypatch, server.replica_manager, "broken")
    call = client.service.FetchStream()
    for correlation_id, offset, topics in (
        (1, 0, [TOPIC]),
        (2, 0, [TOPIC, "broken"]),
        (3, 1, [TOPIC]),
    ):
        request = fetch_request(offset)
        request.correlation_id = correlation_id
        for topic in topics[1:]:
            request.partitions.add(topic=topic, partition=0, current_leader_epoch=-1)
        await call.write(request)
    await call.done_writing()
    async with asyncio.timeout(WAIT_S):
        answers = {answer.correlation_id: answer async for answer in call}
        assert await call.code() == grpc.StatusCode.OK
    for correlation_id, values in ((1, [b"a", b"b"]), (3, [b"b"])):
        [result] = answers[correlation_id].partitions
        assert [r.value for r in decode_batches(result.record_batches)] == values
    failed = answers[2]
    assert failed.error_code == ErrorCode.UNKNOWN_SERVER_ERROR
    assert "a bug in looking up broken-0" in failed.error_message
    assert [(p.topic, p.error_code) for p in failed.partitions] == [
        (TOPIC, ErrorCode.UNKNOWN_SERVER_ERROR),
        ("broken", ErrorCode.UNKNOWN_SERVER_ERROR),
    ]
    assert not any(p.record_batches for p in failed.partitions)
    assert logged(logging.ERROR, "stream request failed")


async def test_high_watermark_checkpoint_is_rewritten_only_when_a_hw_moved(
    start_broker: Callable[..., Any],
) -> None:
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    await produce_ok(client, batch_of([b"a", b"b"]))
    rm = server.replica_manager
    path = rm.config.log_dirs[0] / "replication-offset-checkpoint"
    await rm.checkpoint_high_watermarks_off_loop()  # the periodic task's way
    assert OffsetCheckpoint(path).read() == {(TOPIC, 0): 2}
    written = path.stat().st_ino
    rm.checkpoint_high_watermarks()  # shutdown's way
    assert path.stat().st_ino == written  # nothing moved: the file was left alone
    await produce_ok(client, batch_of([b"c"]))
    rm.checkpoint_high_watermarks()
    assert OffsetCheckpoint(path).read() == {(TOPIC, 0): 3}


async def test_stop_replica_with_delete_rewrites_the_high_watermark_checkpoint(
    start_broker: Callable[..., Any],
) -> None:
    """At once, not at the next periodic checkpoint: a new log of the partition starts at
    min(checkpointed HW, LEO), and the deleted log's HW would let consumers read past the
    new one's."""
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    await produce_ok(client, batch_of([b"a", b"b"]))
    rm = server.replica_manager
    path = rm.config.log_dirs[0] / "replication-offset-checkpoint"
    rm.checkpoint_high_watermarks()
    assert OffsetCheckpoint(path).read() == {(TOPIC, 0): 2}
    stopped = await rm.stop_replica(
        pb.StopReplicaRequest(
            controller_epoch=1,
            partitions=[pb.StopReplicaPartition(topic=TOPIC, partition=0, delete_partition=True)],
        )
    )
    assert stopped.error_code == ErrorCode.NONE, stopped.error_message
    assert OffsetCheckpoint(path).read() == {}


async def test_fetch_max_bytes_bounds_every_answer(start_broker: Callable[..., Any]) -> None:
    """Review 19 #2: max_bytes 0 (the proto default) asked for no bound, and one partition's
    read was the rest of its segment (up to 1 GiB): an answer past gRPC's message limit failed
    the call, and the same fetch failed on every retry. fetch.max.bytes (Kafka's, 55 MiB)
    bounds every answer; one batch still comes whole (KIP-74)."""
    _, client = await start_broker(1, **{"fetch.max.bytes": 2048})
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    for value in (b"a", b"b", b"c"):
        await produce_ok(client, batch_of([value * 1500]))
    for max_bytes in (0, 1 << 30):
        response = await client.service.Fetch(fetch_request(0, max_bytes=max_bytes))
        assert [r.value for r in decode_batches(response.partitions[0].record_batches)] == [
            b"a" * 1500
        ]


async def test_a_records_answer_is_bounded_by_max_bytes_decoded(leader: Any) -> None:
    """Review 19 #3: max_bytes counted the stored (compressed) bytes, and the answer carried
    the decoded records: 16 MB for 64 KiB asked. The records count now, at least one."""
    batch = build_batch(
        [Record(value=bytes(16 * 1024)) for _ in range(100)], compression=Compression.GZIP
    )
    await produce_ok(leader, batch)
    request = fetch_request(0, fmt=pb.RECORD_FORMAT_RECORDS, max_bytes=64 * 1024)
    records = (await leader.service.Fetch(request)).partitions[0].records
    assert [r.offset for r in records] == [0, 1, 2]  # 16 KiB each: the fourth is past 64
    request = fetch_request(0, fmt=pb.RECORD_FORMAT_RECORDS, max_bytes=1)
    assert len((await leader.service.Fetch(request)).partitions[0].records) == 1


async def test_a_fetch_asking_for_no_bytes_is_answered_at_once(leader: Any) -> None:
    """Review 19 #5: min_bytes 0 was taken for 1, and an empty partition's fetch waited its
    max_wait_ms. Nothing meets 0 bytes: answered at once, as Kafka does."""
    request = fetch_request(0, max_wait_ms=60_000)
    request.min_bytes = 0
    response = await asyncio.wait_for(leader.service.Fetch(request), 20)
    assert response.partitions[0].record_batches == b""


async def test_a_fetch_at_a_segments_tail_is_answered_though_short_of_min_bytes(
    start_broker: Callable[..., Any],
) -> None:
    """Review 19 #4: a read stops at its segment's end, so a fetch at the last batch of an
    older segment, short of its min_bytes, waited its max_wait with records readable after
    it. Answered at once, as Kafka's DelayedFetch case F."""
    _, client = await start_broker(1)
    await make_leader(
        client.channel,
        TOPIC,
        0,
        leader=1,
        leader_epoch=1,
        replicas=[1],
        configs={"segment.bytes": "1500"},
    )
    for value in (b"a", b"b", b"c", b"d", b"e", b"f"):
        await produce_ok(client, batch_of([value * 400]))
    request = fetch_request(2, max_wait_ms=60_000)
    request.min_bytes = 1 << 20
    response = await asyncio.wait_for(client.service.Fetch(request), 20)
    values = [r.value for r in decode_batches(response.partitions[0].record_batches)]
    assert values and values[0] == b"c" * 400


@pytest.mark.parametrize(
    ("fmt", "compression"),
    [
        (pb.RECORD_FORMAT_BATCHES, Compression.NONE),
        # Stored small, decoded larger than the limit: the records stop inside the batches.
        (pb.RECORD_FORMAT_RECORDS, Compression.ZSTD),
    ],
)
async def test_a_fetch_whose_partition_limit_cuts_the_read_meets_min_bytes_at_that_limit(
    leader: Any, fmt: int, compression: int
) -> None:
    """Review 30 #1: whole batches fall short of a partition's limit, so a min_bytes of
    partition_max_bytes (the consumer's default 1 MiB) was never met, and the fetch waited
    its max_wait with far more readable. As Kafka's DelayedFetch, a partition with more to
    read than its limit let in counts as that limit; plain records too, which may stop
    inside the batches read (review 33 #7)."""
    for _ in range(40):
        # ~10 KB of records a batch
        await produce_ok(leader, batch_of([b"x" * 1000] * 10, compression=compression))
    request = fetch_request(0, max_wait_ms=120_000, fmt=fmt)
    request.min_bytes = request.partitions[0].partition_max_bytes = 100_000
    response = await asyncio.wait_for(leader.service.Fetch(request), 30)
    result = response.partitions[0]
    if fmt == pb.RECORD_FORMAT_RECORDS:
        assert 0 < len(result.records) < 400
    else:
        assert 0 < len(result.record_batches) <= 100_000
        assert len(list(decode_batches(result.record_batches))) < 400


async def test_a_request_that_does_not_decode_is_invalid_argument(leader: Any) -> None:
    """Review 32 #8: every RPC answered UNKNOWN "Unexpected DecodeError" (a traceback in the
    broker's log each time)."""
    raw = leader.channel.unary_unary(
        "/tidewater.v1.BrokerService/Produce",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw(b"\x08\xff", timeout=10)  # field 1 (acks) cut off mid-varint
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode" in (info.value.details() or "")


async def test_a_stream_answers_what_it_read_before_a_request_that_does_not_decode(
    leader: Any,
) -> None:
    """Review 32 #8: the undecodable message ended the ProduceStream at once, cancelling the
    requests read before it: an acks=all batch was committed with its answer lost."""
    stream = leader.channel.stream_stream(
        "/tidewater.v1.BrokerService/ProduceStream",
        request_serializer=lambda b: b,
        response_deserializer=pb.ProduceResponse.FromString,
    )

    async def requests() -> Any:
        good = produce_request(batch_of([b"kept"]), acks=-1)
        good.correlation_id = 7
        yield good.SerializeToString()
        yield b"\x08\xff"

    call = stream(requests(), timeout=30)
    answers = [answer async for answer in _until_status(call)]
    assert [(a.correlation_id, a.partitions[0].error_code) for a in answers] == [
        (7, ErrorCode.NONE)
    ]
    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT


async def _until_status(call: Any) -> Any:
    """A stream call's answers, stopping (not raising) at the status it ends with."""
    try:
        async for answer in call:
            yield answer
    except grpc.aio.AioRpcError:
        return


async def test_a_produce_whose_write_fails_answers_storage_error(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, off_loop_writes: None
) -> None:
    """The code a client sees when the leader's disk fails under its batch (the broker then
    stops: here its failure handler only records it)."""
    failed: list[object] = []
    _, client = await start_broker(1, on_log_dir_failure=lambda d, e: failed.append(d))
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])

    def no_space(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_module.LogSegment, "write", no_space)
    response = await client.service.Produce(produce_request(batch_of([b"lost"])))
    assert response.partitions[0].error_code == ErrorCode.STORAGE_ERROR
    assert failed


async def test_plain_records_of_a_partition_after_the_first_data_keep_within_its_limit(
    start_broker: Callable[..., Any],
) -> None:
    """Review 30 #4: a partition after the answer's first data got one record whatever its
    size (a small stored batch could decode to 64 MiB), and the size counted the record left
    out. As with batches, only the answer's first data may overshoot its limit."""
    _, client = await start_broker(1)
    for partition in (0, 1):
        await make_leader(client.channel, TOPIC, partition, leader=1, leader_epoch=1, replicas=[1])
        # Stored small (zstd), decoded larger than the limit.
        batch = batch_of([b"x" * 1000] * 3, compression=Compression.ZSTD)
        request = produce_request(batch, partition=partition)
        assert (await client.service.Produce(request)).partitions[0].error_code == 0
    fetch = fetch_request(0, fmt=pb.RECORD_FORMAT_RECORDS)
    fetch.partitions.add(topic=TOPIC, partition=1, fetch_offset=0, current_leader_epoch=-1)
    for fp in fetch.partitions:
        fp.partition_max_bytes = 500
    first, second = (await client.service.Fetch(fetch)).partitions
    assert len(first.records) == 1  # the answer's first data: one record, over the limit
    assert len(second.records) == 0


async def test_a_new_leader_answers_offset_not_available_until_its_hw_reaches_its_epoch(
    start_broker: Callable[..., Any],
) -> None:
    """Review 26 L5: right after a leader change the new leader's HW may be behind the one
    its predecessor answered, so LATEST could go backwards for a consumer. Kafka answers
    OFFSET_NOT_AVAILABLE (retriable) until the HW reaches the leader epoch's start; a
    replica's ListOffsets and EARLIEST are answered."""
    _, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1, 2])
    await produce_ok(client, batch_of([b"a", b"b"]))  # acks=1: LEO 2, HW 0 (2 has not fetched)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=2, replicas=[1, 2])

    async def answer(spec: int, replica_id: int = -1) -> tuple[int, int]:
        request = list_offsets(TOPIC, 0, spec)
        request.replica_id = replica_id
        result = (await client.service.ListOffsets(request)).partitions[0]
        return result.error_code, result.offset

    assert (await answer(pb.OFFSET_SPEC_LATEST))[0] == ErrorCode.OFFSET_NOT_AVAILABLE
    assert await answer(pb.OFFSET_SPEC_EARLIEST) == (ErrorCode.NONE, 0)
    assert await answer(pb.OFFSET_SPEC_LATEST, replica_id=2) == (ErrorCode.NONE, 2)
    fetch = pb.FetchRequest(replica_id=2, max_bytes=1 << 20)
    fetch.partitions.add(
        topic=TOPIC, partition=0, fetch_offset=2, current_leader_epoch=2, last_fetched_epoch=1
    )
    await client.service.Fetch(fetch)  # follower 2 has everything: the HW reaches 2
    assert await answer(pb.OFFSET_SPEC_LATEST) == (ErrorCode.NONE, 2)


async def test_a_long_poll_short_of_min_bytes_reads_its_log_once_there_may_be_enough(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 30 #2: each append to a partition a long poll waited on read it again from the
    fetch offset while short of min_bytes: N appends cost ~N^2/2 batches read (128 MB for a
    512 KiB answer of 1 KB appends). As Kafka's DelayedFetch, the bytes are counted from log
    positions, and the log is read once there may be enough."""
    server, leader = await start_broker(1)
    await make_leader(leader.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    read_bytes: list[int] = []
    read = HostedPartition.read

    def counted(self: HostedPartition, *args: Any, **kwargs: Any) -> Any:
        result = read(self, *args, **kwargs)
        read_bytes.append(len(result.data))
        return result

    monkeypatch.setattr(HostedPartition, "read", counted)
    request = fetch_request(0, max_wait_ms=120_000)
    request.min_bytes = 64 * 1024
    waiting = asyncio.ensure_future(leader.service.Fetch(request))
    await eventually(lambda: server.replica_manager.fetch_purgatory.watched == 1, 10)
    appended = 0
    while not waiting.done() and appended < 200:
        await produce_ok(leader, batch_of([b"x" * 1000]))
        appended += 1
    answer = await asyncio.wait_for(waiting, 30)
    served = len(answer.partitions[0].record_batches)
    assert served >= 64 * 1024
    assert sum(read_bytes) < 2 * served, (len(read_bytes), sum(read_bytes), served)


async def test_a_new_fetch_session_whose_first_answer_never_went_is_removed(
    start_broker: Callable[..., Any],
) -> None:
    """Review 30 #5: the session was made as the request came in; a long poll cancelled (its
    client gone) before answering left a session its client never learned of, holding a
    slot until evicted."""
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
    request = fetch_request(0, max_wait_ms=120_000)
    request.session.id, request.session.epoch = 0, 0  # a new session
    sessions = server.replica_manager.fetch_sessions.sessions
    call = client.service.Fetch(request)
    await eventually(lambda: server.replica_manager.fetch_purgatory.watched == 1, 10)
    assert len(sessions) == 1
    call.cancel()
    await eventually(lambda: not sessions, 10)
