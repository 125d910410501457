"""Idle partitions cost an idle fetch round nothing per partition: the leader's end of a fetch
session and the follower's fetcher touch only partitions that changed (issue 3's idle CPU).
Counted calls and a clock the tests move, not timings."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tidewater.broker import fetcher as fetcher_module
from tidewater.broker.partition import HostedPartition
from tidewater.broker.replica_manager import ReplicaManager
from tidewater.broker.server import BrokerServer
from tidewater.local.standin_controller import leader_and_isr_request
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch
from tidewater.replication.partition import Partition
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "idle"
PARTITIONS = 200
WAIT_S = 20.0


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """How often the per-partition work of a fetch ran: the leader recording a follower's
    fetch, reading a partition, the follower working out a position; and leader fetches."""
    counted: Counter[str] = Counter()

    def count(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            counted[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)

    count(Partition, "on_follower_fetch")
    count(HostedPartition, "read")
    count(fetcher_module, "next_fetch")
    count(ReplicaManager, "fetch")
    yield counted


async def lead(server: BrokerServer, client: Any, replicas: list[int], **leaders: str) -> None:
    """Broker 1 leads every partition, in one LeaderAndIsr."""
    request = leader_and_isr_request(
        TOPIC,
        0,
        leader=1,
        leader_epoch=1,
        replicas=replicas,
        leaders={int(b): a for b, a in leaders.items()} or None,
    )
    state = request.partition_states[0]
    for p in range(1, PARTITIONS):
        added = request.partition_states.add()
        added.CopyFrom(state)
        added.partition = p
    response = await client.control.LeaderAndIsr(request)
    assert not any(e.error_code for e in response.partition_errors), response


def batch(value: bytes) -> bytes:
    return build_batch([Record(key=None, value=value)])


async def produce(client: Any, partition: int, value: bytes) -> None:
    request = pb.ProduceRequest(
        acks=1,
        partitions=[
            pb.PartitionProduceData(topic=TOPIC, partition=partition, record_batch=batch(value))
        ],
    )
    response = await client.service.Produce(request)
    assert response.partitions[0].error_code == ErrorCode.NONE


def manual_time(server: BrokerServer) -> list[int]:
    """The leader's clock from here on: its one value, which only the test moves."""
    now = [server.replica_manager.time_ms()]
    server.replica_manager.time_ms = lambda: now[0]
    return now


async def follower_fetch(
    client: Any,
    session: tuple[int, int],
    offsets: dict[int, int] | None = None,
    max_wait_ms: int = 0,
) -> pb.FetchResponse:
    """A fetch of follower 2 in `session` (id, epoch), naming partitions at their offsets."""
    request = pb.FetchRequest(replica_id=2, max_wait_ms=max_wait_ms, min_bytes=1, max_bytes=1 << 20)
    request.session.id, request.session.epoch = session
    for p, offset in (offsets or {}).items():
        request.partitions.add(
            topic=TOPIC,
            partition=p,
            fetch_offset=offset,
            current_leader_epoch=1,
            last_fetched_epoch=1 if offset else -1,
        )
    response = await client.service.Fetch(request, timeout=WAIT_S)
    assert response.error_code == ErrorCode.NONE, response.error_message
    return response


async def test_an_idle_session_fetch_processes_no_partition(
    start_broker: Callable[..., Any], calls: Counter[str]
) -> None:
    """A follower (broker 2, played here) fetches 200 idle partitions in a session: once all
    are quiet, a fetch records, reads and answers none of them. A produce to one wakes the
    waiting fetch, which answers that partition alone; the next fetch records only it."""
    server, client = await start_broker(1)
    await lead(server, client, [1, 2])
    now = manual_time(server)
    fetch = functools.partial(follower_fetch, client)

    quiet_since = now[0]
    full = await fetch((0, 0), dict.fromkeys(range(PARTITIONS), 0))
    assert len(full.partitions) == PARTITIONS
    session_id = full.session_id
    await fetch((session_id, 1))  # finds every partition as last answered: all quiet now
    calls.clear()
    for epoch in (2, 3, 4):
        now[0] += 100
        idle = await fetch((session_id, epoch))
        assert list(idle.partitions) == []
    assert calls["on_follower_fetch"] == calls["read"] == 0, calls
    replica = server.replica_manager.partitions[(TOPIC, 7)].state.remote_replicas[2]
    assert replica.last_fetch_time_ms == quiet_since  # not told of each fetch
    # A long poll; a produce to a quiet partition answers it with the records.
    now[0] += 100
    waiting = asyncio.ensure_future(fetch((session_id, 5), max_wait_ms=int(WAIT_S * 1000)))
    await eventually(lambda: server.replica_manager.fetch_purgatory.watched, WAIT_S)
    await produce(client, 7, b"news")
    answer = await waiting
    assert [(p.partition, p.high_watermark) for p in answer.partitions] == [(7, 0)]
    assert answer.partitions[0].record_batches
    # Every fetch of the session counted for the quiet partitions, though none was recorded
    # one by one: the append woke 7's follower with the time of the last, which found it
    # caught up.
    assert (replica.last_fetch_time_ms, replica.last_caught_up_time_ms) == (now[0], now[0])
    calls.clear()
    moved = await fetch((session_id, 6), {7: 1})
    assert [(p.partition, p.high_watermark) for p in moved.partitions] == [(7, 1)]
    assert calls["on_follower_fetch"] == 1, calls
    assert server.replica_manager.partitions[(TOPIC, 7)].state.isr == {1, 2}


async def test_a_quiet_follower_named_behind_was_caught_up_at_the_sessions_last_fetch(
    start_broker: Callable[..., Any],
) -> None:
    """Follower 2 fetches partition 7 at its LEO (2) in a session at T, T+500 and T+1000, quiet
    from the first; at T+1500 it names 7 at offset 1, behind. Processing every fetch, as
    Kafka does, it was last caught up at T+1000, the last fetch at the LEO: not at T+1500,
    the fetch that found it behind."""
    server, client = await start_broker(1)
    await lead(server, client, [1, 2])
    for value in (b"a", b"b"):
        await produce(client, 7, value)
    now = manual_time(server)
    start = now[0]
    session_id = (await follower_fetch(client, (0, 0), {7: 2})).session_id
    state = server.replica_manager.partitions[(TOPIC, 7)].state
    for epoch in (1, 2):
        now[0] += 500
        await follower_fetch(client, (session_id, epoch))
    assert state.quiet_in(2, server.replica_manager.fetch_sessions.sessions[session_id].clock)
    now[0] += 500
    await follower_fetch(client, (session_id, 3), {7: 1})
    replica = state.remote_replicas[2]
    assert (replica.log_end_offset, replica.last_fetch_time_ms) == (1, start + 1500)
    assert replica.last_caught_up_time_ms == start + 1000


async def test_an_idle_fetcher_round_works_out_no_position(
    start_broker: Callable[..., Any], calls: Counter[str]
) -> None:
    """Broker 2 follows 200 idle partitions of broker 1. Once replication has settled, rounds
    of its fetcher work out no partition's position, and the leader records none of its
    fetches one by one; a produce to one partition is replicated with work for that one."""
    props = {"replica.fetch.wait.max.ms": 50}
    leader, leader_client = await start_broker(1, **props)
    follower, follower_client = await start_broker(2, **props)
    leaders = {"1": leader.address, "2": follower.address}
    await lead(leader, leader_client, [1, 2], **leaders)
    await lead(follower, follower_client, [1, 2], **leaders)
    # A round or two take in the partitions and find them quiet.
    calls.clear()
    await eventually(lambda: calls["fetch"] >= 5, WAIT_S)
    calls.clear()
    await eventually(lambda: calls["fetch"] >= 4, WAIT_S)
    assert calls["next_fetch"] == calls["on_follower_fetch"] == calls["read"] == 0, calls
    await produce(leader_client, 7, b"news")
    followed = follower.replica_manager.partitions[(TOPIC, 7)]
    await eventually(lambda: followed.log.log_end_offset == 1, WAIT_S)
    await eventually(lambda: followed.state.high_watermark == 1, WAIT_S)
    assert calls["next_fetch"] <= 3, calls
    assert calls["on_follower_fetch"] <= 3, calls
