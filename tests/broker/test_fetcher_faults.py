"""A follower's fetcher goes on replicating every partition after an error in handling one
partition's answer, its manager replaces a fetcher whose task ended, a truncation decided on
the leader's offsets applies only in the epoch it was decided in, and the leader's retention
keeps what a follower has not fetched yet; a follower that led an epoch without writing
catches up in its fetch session, and a partition stopped while the others back off leaves
it. Two in-process brokers (real gRPC on 127.0.0.1, real files); the test plays the controller
(StandinController). Broker 2 follows every partition from broker 1 with one fetcher
(num.replica.fetchers=1)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from tidewater.broker import fetcher as fetcher_module
from tidewater.broker.fetcher import ReplicaFetcher
from tidewater.broker.server import BrokerServer
from tidewater.local.fetch import log_bytes
from tidewater.local.standin_controller import StandinController
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

# Retention keeps only the active segment of PRUNED on the leader: a new follower's first
# fetch, at offset 0, is below the leader's log start (OFFSET_OUT_OF_RANGE).
PRUNED = ("pruned", 0)
STEADY = ("steady", 0)
WAIT_S = 20.0


class Pair:
    def __init__(self, controller: StandinController, servers: dict[int, BrokerServer]) -> None:
        self.controller = controller
        self.servers = servers
        self.clients: dict[int, Any] = {}

    def hosted(self, broker_id: int, tp: tuple[str, int]) -> Any:
        return self.servers[broker_id].replica_manager.partitions[tp]

    def fetchers(self) -> list[ReplicaFetcher]:
        return list(self.servers[2].replica_manager.fetcher_manager.fetchers.values())

    async def produce(self, tp: tuple[str, int], count: int, acks: int = 1, leader: int = 1) -> int:
        """`count` batches to the leader; the base offset of the last."""
        base_offset = -1
        for i in range(count):
            response = await self.clients[leader].service.Produce(
                pb.ProduceRequest(
                    acks=acks,
                    timeout_ms=10_000,
                    partitions=[
                        pb.PartitionProduceData(
                            topic=tp[0],
                            partition=tp[1],
                            record_batch=build_batch([Record(value=b"%d" % i * 40)]),
                        )
                    ],
                )
            )
            assert response.partitions[0].error_code == ErrorCode.NONE
            base_offset = response.partitions[0].base_offset
        return base_offset

    def in_sync(self, tp: tuple[str, int]) -> bool:
        """Broker 2 holds broker 1's log of `tp`, byte for byte, from the leader's log start."""
        leader, follower = self.hosted(1, tp).log, self.hosted(2, tp).log
        return (
            follower.log_end_offset == leader.log_end_offset
            and follower.log_start_offset <= leader.log_start_offset
            and log_bytes(follower, leader.log_end_offset, leader.log_start_offset)
            == log_bytes(leader, leader.log_end_offset, leader.log_start_offset)
        )

    async def caught_up(self, *tps: tuple[str, int]) -> None:
        await eventually(lambda: all(self.in_sync(tp) for tp in tps), WAIT_S)


@pytest.fixture
async def make_pair(
    start_broker: Callable[..., Awaitable[Any]],
) -> AsyncIterator[Callable[..., Awaitable[Pair]]]:
    controller = StandinController(brokers={})
    address = await controller.start()

    async def make(backoff_ms: int = 50) -> Pair:
        servers = {}
        pair = Pair(controller, servers)
        for broker_id in (1, 2):
            servers[broker_id], pair.clients[broker_id] = await start_broker(
                broker_id,
                controllers=address,
                **{
                    "replica.fetch.backoff.ms": backoff_ms,
                    "replica.fetch.wait.max.ms": 100,
                    "num.replica.fetchers": 1,
                    "log.retention.check.interval.ms": 20,
                },
            )
            controller.brokers[broker_id] = servers[broker_id].address
        controller.configs[PRUNED[0]] = {"segment.bytes": "200", "retention.bytes": "0"}
        return pair

    yield make
    await controller.stop()


async def test_fetcher_survives_a_failed_list_offsets_of_one_partition(
    make_pair: Callable[..., Awaitable[Pair]],
) -> None:
    pair = await make_pair()
    await pair.controller.elect(*STEADY, leader=1, replicas=[1, 2])
    await pair.controller.elect(*PRUNED, leader=1, replicas=[1])
    await pair.produce(PRUNED, 10)
    await eventually(lambda: pair.hosted(1, PRUNED).log.log_start_offset > 0, WAIT_S)

    # The leader's next ListOffsets fails: the follower's call raises AioRpcError.
    leader = pair.servers[1].replica_manager
    answer = leader.list_offsets
    refused: list[pb.ListOffsetsRequest] = []

    def list_offsets_failing_once(request: pb.ListOffsetsRequest) -> pb.ListOffsetsResponse:
        if not refused:
            refused.append(request)
            raise RuntimeError("injected ListOffsets failure")
        return answer(request)

    leader.list_offsets = list_offsets_failing_once  # type: ignore[method-assign]
    await pair.controller.elect(*PRUNED, leader=1, replicas=[1, 2], isr=[1])
    await eventually(lambda: refused, WAIT_S)
    assert refused[0].replica_id == 2

    await pair.produce(STEADY, 5, acks=-1)
    await pair.caught_up(STEADY, PRUNED)


async def test_fetcher_survives_an_unexpected_error_appending_one_partition(
    make_pair: Callable[..., Awaitable[Pair]],
) -> None:
    pair = await make_pair()
    for tp in (STEADY, PRUNED):
        await pair.controller.elect(*tp, leader=1, replicas=[1, 2])
    follower = pair.hosted(2, PRUNED)
    append = follower.append_as_follower
    failed: list[int] = []

    async def append_failing_once(batches: Any) -> Any:
        if not failed:
            failed.append(len(batches))
            raise OSError(5, "injected I/O error")
        return await append(batches)

    follower.append_as_follower = append_failing_once
    await pair.produce(PRUNED, 1)
    await eventually(lambda: failed, WAIT_S)

    await pair.produce(STEADY, 5, acks=-1)
    await pair.produce(PRUNED, 5)
    await pair.caught_up(STEADY, PRUNED)


def _fail_next_fetch_answer(fetcher: ReplicaFetcher) -> list[str]:
    """Make `fetcher`'s task end with an error in its own loop (not a partition's handling),
    at its next fetch answer; returns a list that says when it did."""
    on_response = fetcher.session.on_response
    raised: list[str] = []

    def on_response_failing_once(*args: Any) -> None:
        if not raised:
            raised.append(fetcher.source.address)
            raise RuntimeError("injected fetcher bug")
        on_response(*args)

    fetcher.session.on_response = on_response_failing_once  # type: ignore[method-assign]
    return raised


async def test_a_fetcher_that_died_is_replaced_and_replicates_again(
    make_pair: Callable[..., Awaitable[Pair]], caplog: pytest.LogCaptureFixture
) -> None:
    pair = await make_pair()
    await pair.controller.elect(*STEADY, leader=1, replicas=[1, 2])
    (fetcher,) = pair.fetchers()
    raised = _fail_next_fetch_answer(fetcher)
    with caplog.at_level(logging.ERROR, logger="tidewater.broker.fetcher"):
        await pair.produce(STEADY, 3)
        await eventually(lambda: raised and fetcher.task and fetcher.task.done(), WAIT_S)
        await pair.produce(STEADY, 3, acks=-1)
        await pair.caught_up(STEADY)
    (replacement,) = pair.fetchers()
    assert replacement is not fetcher and replacement.alive
    (ended,) = [r for r in caplog.records if "ENDED" in r.getMessage()]
    assert ended.exc_info is not None and "injected fetcher bug" in str(ended.exc_info[1])


async def test_a_partition_is_never_handed_to_a_dead_fetcher(
    make_pair: Callable[..., Awaitable[Pair]],
) -> None:
    # A backoff far beyond the test's span: only adding a partition replaces the dead fetcher.
    pair = await make_pair(backoff_ms=600_000)
    await pair.controller.elect(*STEADY, leader=1, replicas=[1, 2])
    (fetcher,) = pair.fetchers()
    raised = _fail_next_fetch_answer(fetcher)
    await pair.produce(STEADY, 3)
    await eventually(lambda: raised and fetcher.task and fetcher.task.done(), WAIT_S)

    await pair.controller.elect(*PRUNED, leader=1, replicas=[1, 2])
    (replacement,) = pair.fetchers()
    assert replacement is not fetcher and replacement.alive
    await pair.produce(PRUNED, 3)
    await pair.caught_up(STEADY, PRUNED)


class HeldListOffsets:
    """The fetcher's stub of its leader, whose ListOffsets calls reach the leader only once
    the test releases them: a LeaderAndIsr can land while the fetcher awaits the answer."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.sent: list[pb.ListOffsetsRequest] = []
        self.answered: list[pb.ListOffsetsResponse] = []

    def stub(self, channel: grpc.aio.Channel) -> Any:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        call = stub.ListOffsets

        async def list_offsets(request: pb.ListOffsetsRequest, **kwargs: Any) -> Any:
            self.sent.append(request)
            await self.release.wait()
            response = await call(request, **kwargs)
            self.answered.append(response)
            return response

        stub.ListOffsets = list_offsets
        return stub


async def test_an_out_of_range_truncation_is_not_applied_after_the_follower_became_leader(
    make_pair: Callable[..., Awaitable[Pair]], monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldListOffsets()
    monkeypatch.setattr(
        fetcher_module, "broker_pb2_grpc", SimpleNamespace(BrokerServiceStub=held.stub)
    )
    pair = await make_pair()
    # STEADY keeps broker 2's fetcher running once PRUNED leaves it.
    await pair.controller.elect(*STEADY, leader=1, replicas=[1, 2])
    await pair.controller.elect(*PRUNED, leader=1, replicas=[1])
    await pair.produce(PRUNED, 10)
    await eventually(lambda: pair.hosted(1, PRUNED).log.log_start_offset > 0, WAIT_S)
    await pair.controller.elect(*PRUNED, leader=1, replicas=[1, 2], isr=[1])
    await eventually(lambda: held.sent, WAIT_S)

    # Broker 2 leads PRUNED (only broker 2 hears of it) while its fetcher awaits the offsets
    # that would have it truncate fully and start at the old leader's log start.
    del pair.controller.brokers[1]
    await pair.controller.elect(*PRUNED, leader=2, replicas=[1, 2], isr=[2])
    epoch = pair.controller.states[PRUNED].leader_epoch
    held.release.set()
    await eventually(lambda: held.answered, WAIT_S)

    leader = pair.hosted(2, PRUNED)
    assert leader.state.leader_epoch == epoch
    assert (leader.log.log_start_offset, leader.log.log_end_offset) == (0, 0)
    assert leader.log.leader_epoch_cache.latest_epoch == epoch
    assert await pair.produce(PRUNED, 1, leader=2) == 0


async def test_retention_keeps_what_a_follower_has_not_fetched_yet(
    make_pair: Callable[..., Awaitable[Pair]],
) -> None:
    """Broker 2 is in the ISR of PRUNED but has not fetched: the HW stays at 0, and retention,
    however small retention.bytes, deletes no segment the HW has not passed (Kafka's
    deletableSegments). Else broker 2 would start at the leader's new log start, and the HW
    would pass offsets that no replica holds."""
    pair = await make_pair()
    follower_address = pair.controller.brokers.pop(2)  # not told yet that it follows
    await pair.controller.elect(*PRUNED, leader=1, replicas=[1, 2])
    leader = pair.hosted(1, PRUNED)
    passes: list[tuple[int, ...]] = []
    delete = leader.log.delete_retention_segments

    def counted(*args: int) -> int:
        passes.append(args)
        return delete(*args)

    leader.log.delete_retention_segments = counted
    end = await pair.produce(PRUNED, 10) + 1
    ran = len(passes)
    await eventually(lambda: len(passes) > ran, WAIT_S)
    assert len(leader.log.segments) > 1
    assert (leader.state.high_watermark, leader.log.log_start_offset) == (0, 0)

    pair.controller.brokers[2] = follower_address
    await pair.controller.elect(*PRUNED, leader=1)
    await eventually(lambda: leader.state.high_watermark == end, WAIT_S)
    await eventually(lambda: leader.log.log_start_offset == leader.log.active_segment_base, WAIT_S)


async def test_a_follower_that_led_an_epoch_without_writing_catches_up_in_its_session(
    make_pair: Callable[..., Awaitable[Pair]],
) -> None:
    """The stall of a random-fault run: broker 2 led STEADY in an epoch without writing, then
    follows broker 1 in the same incremental fetch session as another partition. The other
    partition kept fetching while STEADY's divergence truncated nothing and was answered
    again at every fetch; both must catch up."""
    pair = await make_pair()
    other = (STEADY[0], 1)
    for tp in (STEADY, other):
        await pair.controller.elect(*tp, leader=1, replicas=[1, 2])
    await pair.produce(STEADY, 3)
    await pair.caught_up(STEADY)
    await pair.controller.elect(*STEADY, leader=2)
    await pair.controller.elect(*STEADY, leader=1)
    await pair.produce(STEADY, 3)
    await pair.produce(other, 3)
    await pair.caught_up(STEADY, other)


async def test_a_diverged_follower_writes_its_log_out_off_the_loop_before_it_truncates(
    make_pair: Callable[..., Awaitable[Pair]],
) -> None:
    """Broker 2 led an epoch broker 1 never heard of and wrote in it; broker 1 leads again.
    Broker 2's truncation fsyncs its log below the new end on the event loop: its unflushed
    data is written out on a worker thread first, so those fsyncs find little left."""
    pair = await make_pair()
    await pair.controller.elect(*STEADY, leader=1, replicas=[1, 2])
    await pair.produce(STEADY, 3)
    await pair.caught_up(STEADY)
    address = pair.controller.brokers.pop(1)
    await pair.controller.elect(*STEADY, leader=2, isr=[2])
    await pair.produce(STEADY, 2, leader=2)
    diverged = pair.hosted(2, STEADY).log
    events: list[str] = []
    write_out, truncate_to = diverged.write_out, diverged.truncate_to

    async def recorded_write_out() -> None:
        events.append("write_out")
        await write_out()

    def recorded_truncate_to(offset: int) -> None:
        events.append(f"truncate_to {offset}")
        truncate_to(offset)

    diverged.write_out = recorded_write_out  # type: ignore[method-assign]
    diverged.truncate_to = recorded_truncate_to  # type: ignore[method-assign]
    pair.controller.brokers[1] = address
    await pair.controller.elect(*STEADY, leader=1, isr=[1])
    await pair.caught_up(STEADY)
    assert events[:2] == ["write_out", "truncate_to 3"]


def _sessions_on(pair: Pair, leader: int) -> set[int]:
    return set(pair.servers[leader].replica_manager.fetch_sessions.sessions)


async def test_a_new_leader_epoch_for_a_lone_followed_partition_keeps_its_fetch_session(
    make_pair: Callable[..., Awaitable[Pair]],
) -> None:
    """A LeaderAndIsr that bumps the epoch of the only partition a fetcher fetches: the
    fetcher goes on, in its session, rather than a new fetcher opening another session and
    leaving the old one on the leader until evicted."""
    pair = await make_pair()
    await pair.controller.elect(*STEADY, leader=1, replicas=[1, 2])
    (fetcher,) = pair.fetchers()
    await eventually(lambda: fetcher.session.session_id != 0, WAIT_S)
    session_id = fetcher.session.session_id
    await pair.controller.elect(*STEADY, leader=1, replicas=[1, 2])
    await pair.produce(STEADY, 3, acks=-1)
    await pair.caught_up(STEADY)
    assert pair.fetchers() == [fetcher] and fetcher.session.session_id == session_id
    assert _sessions_on(pair, 1) == {session_id}


async def test_a_fetcher_replaced_after_it_died_closes_its_fetch_session(
    make_pair: Callable[..., Awaitable[Pair]],
) -> None:
    """The replacement's first full fetch names the dead fetcher's session, which the leader
    closes at once."""
    pair = await make_pair()
    await pair.controller.elect(*STEADY, leader=1, replicas=[1, 2])
    (fetcher,) = pair.fetchers()
    await eventually(lambda: fetcher.session.session_id != 0, WAIT_S)
    raised = _fail_next_fetch_answer(fetcher)
    await pair.produce(STEADY, 3)
    await eventually(lambda: raised and fetcher.task and fetcher.task.done(), WAIT_S)
    await eventually(lambda: pair.fetchers() != [fetcher], WAIT_S)
    (replacement,) = pair.fetchers()
    await eventually(
        lambda: replacement.session.session_id not in (0, fetcher.session.session_id), WAIT_S
    )
    await pair.produce(STEADY, 3, acks=-1)
    await pair.caught_up(STEADY)
    assert _sessions_on(pair, 1) == {replacement.session.session_id}


async def test_a_partition_stopped_while_the_others_back_off_leaves_the_fetch_session(
    make_pair: Callable[..., Awaitable[Pair]],
) -> None:
    """Broker 2 fetches STEADY and `other` in one session. `other`'s append fails, so it backs
    off; meanwhile a StopReplica takes STEADY off the fetcher, in a round that fetches
    nothing. The fetch once `other` is back forgets STEADY on the leader: kept there, it
    would stay quiet in the session, credited as caught up by every fetch of `other`."""
    pair = await make_pair(backoff_ms=3000)  # ample time for the StopReplica
    other = (STEADY[0], 1)
    for tp in (STEADY, other):
        await pair.controller.elect(*tp, leader=1, replicas=[1, 2])
    sessions = pair.servers[1].replica_manager.fetch_sessions
    await eventually(lambda: all(list(sessions.holding(tp)) for tp in (STEADY, other)), WAIT_S)
    (fetcher,) = pair.fetchers()
    session_id = fetcher.session.session_id
    follower = pair.hosted(2, other)
    failed: list[int] = []

    async def append_failing(batches: Any) -> Any:
        failed.append(len(batches))
        raise OSError(5, "injected I/O error")

    follower.append_as_follower = append_failing
    await pair.produce(other, 1)
    await eventually(lambda: failed, WAIT_S)
    stopped = await pair.clients[2].control.StopReplica(
        pb.StopReplicaRequest(
            controller_epoch=1,
            partitions=[pb.StopReplicaPartition(topic=STEADY[0], partition=0, leader_epoch=1)],
        )
    )
    assert stopped.error_code == ErrorCode.NONE, stopped.error_message
    await eventually(lambda: len(failed) > 1, WAIT_S)  # `other` is fetched again
    await eventually(lambda: not list(sessions.holding(STEADY)), WAIT_S)
    # Forgotten in the session, not dropped with it.
    assert pair.fetchers() == [fetcher] and fetcher.session.session_id == session_id
    assert [s.id for s in sessions.holding(other)] == [session_id]
