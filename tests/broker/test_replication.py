"""Three in-process brokers (real gRPC on loopback, real files) replicating RF=3, with the
stand-in controller answering ISR proposals."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tidewater.broker.log.log import OFF_LOOP_WRITE_BYTES
from tidewater.broker.server import BrokerServer
from tidewater.local.fetch import list_offsets
from tidewater.local.fetch import log_bytes as stored
from tidewater.local.standin_controller import StandinController
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.rpc.lifted import LIFT_MIN_BYTES
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import cluster_pb2
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "replicated"
TP = (TOPIC, 0)


WAIT_S = 20.0
POLL_S = 0.01


@pytest.fixture
async def cluster(start_broker: Callable[..., Awaitable[Any]]) -> AsyncIterator[Any]:
    controller = StandinController(brokers={})
    address = await controller.start()
    servers: dict[int, BrokerServer] = {}
    clients: dict[int, Any] = {}
    for broker_id in (1, 2, 3):
        server, client = await start_broker(
            broker_id,
            controllers=address,
            **{"replica.lag.time.max.ms": 1000, "replica.fetch.backoff.ms": 50},
        )
        servers[broker_id] = server
        clients[broker_id] = client
        controller.brokers[broker_id] = server.address
    controller.configs[TOPIC] = {"min.insync.replicas": "2"}
    await controller.elect(TOPIC, 0, leader=1, replicas=[1, 2, 3])
    yield controller, servers, clients
    await controller.stop()


def log_bytes(server: BrokerServer, up_to: int) -> bytes:
    return stored(server.replica_manager.partitions[TP].log, up_to)


async def produce(
    client: Any, value: bytes, acks: int = -1, partition: int = 0
) -> pb.PartitionProduceResponse:
    response = await client.service.Produce(
        pb.ProduceRequest(
            acks=acks,
            timeout_ms=10_000,
            partitions=[
                pb.PartitionProduceData(
                    topic=TOPIC,
                    partition=partition,
                    record_batch=build_batch([Record(value=value)] * 3),
                )
            ],
        )
    )
    return response.partitions[0]


async def test_acks_all_replicates_to_every_replica(cluster: Any) -> None:
    _, servers, clients = cluster
    for i in range(30):
        result = await produce(clients[1], f"v{i}".encode())
        assert result.error_code == ErrorCode.NONE, result.error_message
        assert result.base_offset == 3 * i
    leader = servers[1].replica_manager.partitions[TP]
    assert leader.state.high_watermark == 90
    followers = [servers[b].replica_manager.partitions[TP] for b in (2, 3)]
    await eventually(lambda: all(f.state.high_watermark == 90 for f in followers), WAIT_S, POLL_S)
    expected = log_bytes(servers[1], 90)
    assert all(log_bytes(servers[b], 90) == expected for b in (2, 3))


async def test_stopped_follower_leaves_and_rejoins_the_isr(
    cluster: Any, start_broker: Callable[..., Awaitable[Any]]
) -> None:
    controller, servers, clients = cluster
    assert (await produce(clients[1], b"before")).error_code == ErrorCode.NONE
    await servers[3].stop(grace_s=0)
    del controller.brokers[3]
    # The next acks=all write waits until broker 3, lagging, is proposed out of the ISR
    # (an idle follower at the leader's LEO is not lagging); then ISR {1, 2} commits it.
    assert (await produce(clients[1], b"first while down")).error_code == ErrorCode.NONE
    assert (TOPIC, 0, [1, 2]) in controller.isr_changes
    for i in range(5):
        assert (await produce(clients[1], f"while-down-{i}".encode())).error_code == ErrorCode.NONE

    server, _ = await start_broker(3, controllers=servers[1].replica_manager.config.controllers[0])
    controller.brokers[3] = server.address
    await controller.elect(TOPIC, 0, leader=1)
    await eventually(lambda: controller.states[TP].isr == [1, 2, 3], WAIT_S, POLL_S)
    hw = servers[1].replica_manager.partitions[TP].state.high_watermark
    await eventually(
        lambda: server.replica_manager.partitions[TP].log.log_end_offset == hw, WAIT_S, POLL_S
    )
    assert log_bytes(server, hw) == log_bytes(servers[1], hw)


async def test_a_stale_follower_incarnation_is_refused_until_it_registers_again(
    cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """KIP-903 end to end: followers fetch with their broker epochs (the stand-in registers
    every broker at epoch 1). Once the leader learns that broker 3 registered again (epoch 5),
    the running broker 3 is a stale incarnation: every fetch of it is refused and it gets
    nothing, until it registers again and fetches as epoch 5."""
    _, servers, clients = cluster
    leader = servers[1].replica_manager.partitions[TP]
    assert (await produce(clients[1], b"before")).error_code == ErrorCode.NONE
    epochs = {b: leader.state.remote_replicas[b] for b in (2, 3)}
    await eventually(lambda: all(r.broker_epoch == 1 for r in epochs.values()), WAIT_S, POLL_S)
    metadata = cluster_pb2.UpdateMetadataRequest(controller_epoch=1)
    for broker_id, broker_epoch in ((1, 1), (2, 1), (3, 5)):
        metadata.live_brokers.add(broker_id=broker_id, broker_epoch=broker_epoch)
    assert (await clients[1].control.UpdateMetadata(metadata)).error_code == ErrorCode.NONE

    def refused() -> bool:
        return any(
            "fetch from broker 3 at broker epoch 1; its current registration is at 5"
            in r.getMessage()
            for r in caplog.records
        )

    await eventually(refused, WAIT_S, POLL_S)
    # A fetcher waits for each answer before its next fetch: from the first refusal on, every
    # fetch of broker 3 is refused.
    assert (await produce(clients[1], b"after", acks=1)).error_code == ErrorCode.NONE
    end = leader.log.log_end_offset
    follower_2 = servers[2].replica_manager.partitions[TP]
    follower_3 = servers[3].replica_manager.partitions[TP]
    await eventually(lambda: follower_2.log.log_end_offset == end, WAIT_S, POLL_S)
    assert follower_3.log.log_end_offset < end
    servers[3].lifecycle.broker_epoch = 5  # as its heartbeats would have it register again
    await eventually(lambda: follower_3.log.log_end_offset == end, WAIT_S, POLL_S)
    assert leader.state.remote_replicas[3].broker_epoch == 5
    assert log_bytes(servers[3], end) == log_bytes(servers[1], end)


async def test_acks_all_refused_when_isr_below_min_insync(cluster: Any) -> None:
    controller, servers, clients = cluster
    for b in (2, 3):
        await servers[b].stop(grace_s=0)
        del controller.brokers[b]
    assert (await produce(clients[1], b"makes them lag", acks=1)).error_code == ErrorCode.NONE
    await eventually(lambda: controller.states[TP].isr == [1], WAIT_S, POLL_S)
    result = await produce(clients[1], b"refused")
    assert result.error_code == ErrorCode.NOT_ENOUGH_REPLICAS
    assert (await produce(clients[1], b"acks=1 still works", acks=1)).error_code == ErrorCode.NONE


async def test_followers_replicate_through_fetch_sessions_and_survive_losing_them(
    cluster: Any,
) -> None:
    _, servers, clients = cluster
    assert (await produce(clients[1], b"first")).error_code == ErrorCode.NONE
    sessions = servers[1].replica_manager.fetch_sessions.sessions
    await eventually(
        lambda: sorted(s.replica_id for s in sessions.values()) == [2, 3], WAIT_S, POLL_S
    )
    assert all(list(s.partitions) == [TP] for s in sessions.values())
    # The leader forgets them (a restart, an eviction): followers get
    # FETCH_SESSION_ID_NOT_FOUND, open new sessions and go on replicating.
    old = set(sessions)
    sessions.clear()
    for i in range(5):
        assert (await produce(clients[1], f"after-{i}".encode())).error_code == ErrorCode.NONE
    await eventually(lambda: len(sessions) == 2 and not old & set(sessions), WAIT_S, POLL_S)
    followers = [servers[b].replica_manager.partitions[TP] for b in (2, 3)]
    await eventually(lambda: all(f.state.high_watermark == 18 for f in followers), WAIT_S, POLL_S)
    assert all(log_bytes(servers[b], 18) == log_bytes(servers[1], 18) for b in (2, 3))


async def test_large_batches_replicate_whichever_way_they_are_produced(cluster: Any) -> None:
    """Batches above LIFT_MIN_BYTES reach the leader's log and the followers' without
    protobuf's copies (rpc.lifted), on Produce and ProduceStream; plain records too."""
    _, servers, clients = cluster
    value = bytes(range(256)) * (LIFT_MIN_BYTES // 256 + 1)

    def request(i: int, *, plain: bool = False) -> pb.ProduceRequest:
        data = pb.PartitionProduceData(topic=TOPIC, partition=0)
        if plain:
            data.records.add(value=value + bytes([i]))
        else:
            data.record_batch = build_batch([Record(value=value + bytes([i]))] * 2)
        return pb.ProduceRequest(acks=-1, timeout_ms=10_000, partitions=[data])

    unary = await clients[1].service.Produce(request(0))
    plain = await clients[1].service.Produce(request(1, plain=True))
    stream = clients[1].service.ProduceStream()
    for i in (2, 3):
        await stream.write(request(i))
    streamed = [await stream.read() for _ in range(2)]
    await stream.done_writing()
    answers = [unary, plain, *streamed]
    assert [a.partitions[0].error_code for a in answers] == [ErrorCode.NONE] * 4
    assert [a.partitions[0].base_offset for a in answers] == [0, 2, 3, 5]
    followers = [servers[b].replica_manager.partitions[TP] for b in (2, 3)]
    await eventually(lambda: all(f.state.high_watermark == 7 for f in followers), WAIT_S, POLL_S)
    expected = log_bytes(servers[1], 7)
    assert all(log_bytes(servers[b], 7) == expected for b in (2, 3))
    values = [r.value for r in decode_batches(expected)]
    assert values == [value + bytes([i]) for i in (0, 0, 1, 2, 2, 3, 3)]


async def test_a_followers_stalled_disk_write_holds_up_no_partition_its_broker_leads(
    cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower writes what it fetched on a worker thread: while its write waits for the
    disk (here: for a gate), its event loop goes on acknowledging acks=all produces of the
    partitions its broker leads. The three brokers share this test's event loop, so a write
    on the loop would stall all of them, and the test with them."""
    controller, servers, clients = cluster
    await controller.elect(TOPIC, 1, leader=2, replicas=[2, 1, 3])
    stalled = servers[2].replica_manager.partitions[TP].log
    segment = stalled.segments[-1]
    write = segment.write
    entered, gate = threading.Event(), threading.Event()

    def write_when_the_gate_opens(data: Any, drop_behind_bytes: int = -1) -> None:
        entered.set()
        gate.wait(WAIT_S)
        write(data, drop_behind_bytes)

    monkeypatch.setattr(segment, "write", write_when_the_gate_opens)
    value = b"x" * OFF_LOOP_WRITE_BYTES  # large enough for the worker thread
    assert (await produce(clients[1], value, acks=1)).error_code == ErrorCode.NONE
    await eventually(entered.is_set, WAIT_S, POLL_S)
    try:
        for i in range(3):
            result = await produce(clients[2], f"led-{i}".encode(), partition=1)
            assert result.error_code == ErrorCode.NONE, result.error_message
        assert stalled.log_end_offset == 0  # the stalled write is still under way
    finally:
        gate.set()
    leader_end = servers[1].replica_manager.partitions[TP].log.log_end_offset
    await eventually(lambda: stalled.log_end_offset == leader_end, WAIT_S, POLL_S)
    assert log_bytes(servers[2], leader_end) == log_bytes(servers[1], leader_end)


async def test_a_leader_that_wrote_nothing_in_its_epoch_catches_up_as_a_follower(
    cluster: Any,
) -> None:
    """Broker 2 leads epoch 2 without writing a record, then follows broker 1 in epoch 3. Its
    epoch history names epoch 2, which broker 1 never had: the truncation that answers the
    divergence lands on its LEO, and must still drop epoch 2 from the history (Kafka's
    Log.truncateTo), or every fetch names epoch 2 again and it never catches up."""
    controller, servers, clients = cluster
    for i in range(3):
        assert (await produce(clients[1], f"epoch 1: {i}".encode())).error_code == ErrorCode.NONE
    hw = servers[1].replica_manager.partitions[TP].state.high_watermark
    await eventually(
        lambda: all(
            servers[b].replica_manager.partitions[TP].log.log_end_offset == hw for b in (2, 3)
        ),
        WAIT_S,
        POLL_S,
    )
    await controller.elect(TOPIC, 0, leader=2)
    await controller.elect(TOPIC, 0, leader=1)
    for i in range(3):
        assert (await produce(clients[1], f"epoch 3: {i}".encode())).error_code == ErrorCode.NONE
    hw = servers[1].replica_manager.partitions[TP].state.high_watermark
    follower = servers[2].replica_manager.partitions[TP]
    await eventually(lambda: follower.log.log_end_offset == hw, WAIT_S, POLL_S)
    assert log_bytes(servers[2], hw) == log_bytes(servers[1], hw)
    assert follower.log.leader_epoch_cache.latest_epoch == 3


async def test_a_followers_log_start_follows_its_leaders(
    start_broker: Callable[..., Awaitable[Any]],
) -> None:
    """Retention runs on the leader only (by hand; the brokers' own checks are minutes away):
    the follower lets the same records go on the leader's word, and the earliest offset stays
    where it was when it takes over (Kafka's follower maybeIncrementLogStartOffset). The
    follower's segments roll at other offsets (as after a time roll): its log start falls
    inside a segment, exactly the leader's, not the base of the segment holding it."""
    controller = StandinController(brokers={})
    address = await controller.start()
    try:
        servers: dict[int, BrokerServer] = {}
        clients: dict[int, Any] = {}
        for broker_id in (1, 2):
            servers[broker_id], clients[broker_id] = await start_broker(
                broker_id, controllers=address
            )
            controller.brokers[broker_id] = servers[broker_id].address
        controller.configs[TOPIC] = {"segment.bytes": "2000", "retention.bytes": "4000"}
        await controller.elect(TOPIC, 0, leader=1, replicas=[1, 2])
        leader, follower = (servers[b].replica_manager.partitions[TP] for b in (1, 2))
        follower.log.config = dataclasses.replace(follower.log.config, segment_bytes=2900)
        for i in range(20):
            result = await produce(clients[1], bytes(100) + str(i).encode())
            assert result.error_code == ErrorCode.NONE, result.error_message
        await eventually(lambda: follower.state.high_watermark == 60, WAIT_S, POLL_S)
        assert leader.log.delete_retention_segments(time.time_ns() // 10**6, 60) > 0
        start = leader.log.log_start_offset
        assert start not in {s.base_offset for s in follower.log.segments}
        await eventually(lambda: follower.log.log_start_offset == start, WAIT_S, POLL_S)
        assert follower.log.segments[0].base_offset < start
        await controller.elect(TOPIC, 0, leader=2)
        earliest = await clients[2].service.ListOffsets(
            list_offsets(TOPIC, 0, pb.OFFSET_SPEC_EARLIEST)
        )
        assert earliest.partitions[0].offset == start
    finally:
        await controller.stop()
