"""What an acks=all produce answers: a batch is acknowledged only when the high watermark covers
it under the leader epoch, and in the hosted partition, it was appended to."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from tests.broker.fake_clock import FakeClock
from tidewater.broker.delayed import Appended, DelayedProduce
from tidewater.broker.purgatory import Purgatory
from tidewater.local.standin_controller import make_leader
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import cluster_pb2, common_pb2
from tidewater.v1.errors_pb2 import ErrorCode

TP = ("t", 0)
WAIT_S = 20.0


class State:
    """The replication state a DelayedProduce reads: a leader with an ISR of min.insync."""

    def __init__(self, leader_epoch: int) -> None:
        self.is_leader = True
        self.leader_epoch = leader_epoch
        self.high_watermark = 0
        self.effective_min_isr = 2
        self.isr = (1, 2)

    @property
    def under_min_isr(self) -> bool:
        return len(self.isr) < self.effective_min_isr

    @property
    def min_isr_shortfall(self) -> str:
        return f"ISR {list(self.isr)} is smaller than min.insync.replicas=2"

    def holds_append(self, leader_epoch: int, required_offset: int) -> bool:
        # What Partition.holds_append says where the epoch moved with the leader away and back.
        return leader_epoch == self.leader_epoch

    def enough_replicas_for(self, required_offset: int) -> bool | None:
        return True if self.high_watermark >= required_offset else None


class Hosted:
    def __init__(self, leader_epoch: int) -> None:
        self.state = State(leader_epoch)


def waiting_for(hosted: Hosted, required_offset: int, leader_epoch: int) -> DelayedProduce:
    hosts = {TP: hosted}
    appended = Appended(required_offset, leader_epoch, hosted)  # type: ignore[arg-type]
    return DelayedProduce(30_000, {TP: appended}, hosts.get)  # type: ignore[arg-type]


async def test_a_batch_committed_in_the_epoch_of_its_append_is_acknowledged() -> None:
    hosted = Hosted(leader_epoch=1)
    op = waiting_for(hosted, 2, leader_epoch=1)
    purgatory = Purgatory("Produce", asyncio.get_running_loop())
    assert not purgatory.try_complete_else_watch(op, [TP])
    hosted.state.high_watermark = 2
    assert purgatory.check_and_complete(TP) == 1
    assert await asyncio.wait_for(op.done, WAIT_S) == {TP: (ErrorCode.NONE, "")}


async def test_a_batch_appended_under_an_older_epoch_is_refused_whatever_the_hw() -> None:
    """The leader lost the partition after the append (and may have truncated the batch and
    copied another leader's records to its offsets), then led again: the high watermark past
    the batch's offsets says nothing of the batch. Seen when the produce starts waiting, and
    while it waits."""
    hosted = Hosted(leader_epoch=3)
    hosted.state.high_watermark = 5
    at_once = waiting_for(hosted, 2, leader_epoch=1)
    assert at_once.try_complete()
    code, message = (await asyncio.wait_for(at_once.done, WAIT_S))[TP]
    assert code == ErrorCode.NOT_LEADER_OR_FOLLOWER
    assert "epoch 1" in message

    hosted = Hosted(leader_epoch=1)
    parked = waiting_for(hosted, 2, leader_epoch=1)
    purgatory = Purgatory("Produce", asyncio.get_running_loop())
    assert not purgatory.try_complete_else_watch(parked, [TP])
    hosted.state.leader_epoch, hosted.state.high_watermark = 2, 5
    assert purgatory.check_and_complete(TP) == 1
    code, _ = (await asyncio.wait_for(parked.done, WAIT_S))[TP]
    assert code == ErrorCode.NOT_LEADER_OR_FOLLOWER


async def test_a_batch_appended_to_a_partition_since_recreated_is_refused() -> None:
    """The topic was deleted and created again: its new partition starts its epochs afresh,
    so the same epoch and a high watermark past the batch say nothing of it."""
    appended_to, recreated = Hosted(leader_epoch=1), Hosted(leader_epoch=1)
    recreated.state.high_watermark = 5
    hosts = {TP: recreated}
    op = DelayedProduce(30_000, {TP: Appended(2, 1, appended_to)}, hosts.get)  # type: ignore[arg-type]
    assert op.try_complete()
    code, _ = (await asyncio.wait_for(op.done, WAIT_S))[TP]
    assert code == ErrorCode.NOT_LEADER_OR_FOLLOWER


@pytest.mark.parametrize("isr", [(1,), (1, 2)])
async def test_a_batch_not_committed_in_time_is_not_enough_replicas_under_min_isr(
    isr: tuple[int, ...],
) -> None:
    """The ISR shrank below min.insync.replicas after the append: the HW waits for it to grow
    back (KIP-966), so the produce waits too, and at its timeout answers Kafka's
    NOT_ENOUGH_REPLICAS_AFTER_APPEND (in the leader's log, on too few replicas), where it
    answered REQUEST_TIMED_OUT before. An ISR at min ISR that did not replicate in time is
    still REQUEST_TIMED_OUT."""
    hosted = Hosted(leader_epoch=1)
    op = waiting_for(hosted, 2, leader_epoch=1)
    clock = FakeClock()
    purgatory = Purgatory("Produce", clock)
    assert not purgatory.try_complete_else_watch(op, [TP])
    hosted.state.isr = isr
    assert purgatory.check_and_complete(TP) == 0
    clock.advance(op.timeout_ms / 1000)
    code, message = op.outcomes[TP]
    if isr == (1,):
        assert code == ErrorCode.NOT_ENOUGH_REPLICAS_AFTER_APPEND
        assert "in the leader's log" in message and "min.insync.replicas=2" in message
    else:
        assert code == ErrorCode.REQUEST_TIMED_OUT


def produce_request(acks: int, *batches: tuple[int, bytes]) -> pb.ProduceRequest:
    request = pb.ProduceRequest(acks=acks, timeout_ms=int(WAIT_S * 1000))
    for partition, value in batches:
        request.partitions.add(
            topic=TP[0], partition=partition, record_batch=build_batch([Record(value=value)])
        )
    return request


async def test_a_leadership_flap_between_two_appends_of_a_produce_is_not_acknowledged(
    start_broker: Callable[..., Any],
) -> None:
    """A produce appends its partitions one at a time and may wait between them (behind other
    produces of a partition, or a write off the loop). Here its batch for partition 0 is in
    broker 1's log at offset 1 while it waits on partition 1; meanwhile broker 1 follows
    broker 2 in epoch 2, truncates the batch and copies broker 2's record to offset 1, then
    leads again in epoch 3 with the high watermark past it. The produce's answer for
    partition 0 is NOT_LEADER_OR_FOLLOWER: its batch is not in the log."""
    servers, channels = {}, {}
    for broker_id in (1, 2):
        server, client = await start_broker(broker_id, **{"replica.fetch.backoff.ms": 50})
        servers[broker_id], channels[broker_id] = server, client.channel
    addresses = {b: s.address for b, s in servers.items()}
    b1 = servers[1].replica_manager

    async def elect(broker_id: int, partition: int, leader: int, epoch: int) -> None:
        await make_leader(
            channels[broker_id],
            TP[0],
            partition,
            leader=leader,
            leader_epoch=epoch,
            replicas=[1, 2],
            leaders={leader: addresses[leader]},
        )

    for partition in (0, 1):
        for broker_id in (1, 2):
            await elect(broker_id, partition, leader=1, epoch=1)
    warm_up = await b1.produce(produce_request(-1, (0, b"a0"), (1, b"b0")))
    assert [p.error_code for p in warm_up.partitions] == [ErrorCode.NONE] * 2
    log_0 = b1.partitions[TP].log

    def values() -> list[bytes | None]:
        return [r.value for r in decode_batches(log_0.read(0, 1 << 20))]

    # Stands in for the produces queued on partition 1 ahead of this one.
    queued = b1.partitions[(TP[0], 1)]._leader_appends
    await queued.acquire()
    try:
        await elect(2, 0, leader=2, epoch=2)  # broker 1 has not heard yet
        produce = asyncio.create_task(b1.produce(produce_request(-1, (0, b"lost"), (1, b"b1"))))
        await eventually(lambda: log_0.log_end_offset == 2, WAIT_S)
        await elect(1, 0, leader=2, epoch=2)
        other = await servers[2].replica_manager.produce(produce_request(1, (0, b"other")))
        assert other.partitions[0].base_offset == 1
        await eventually(lambda: values() == [b"a0", b"other"], WAIT_S)
        for broker_id in (1, 2):
            await elect(broker_id, 0, leader=1, epoch=3)
        await eventually(lambda: b1.partitions[TP].state.high_watermark >= 2, WAIT_S)
    finally:
        queued.release()
    answer = await asyncio.wait_for(produce, WAIT_S)
    results = {p.partition: p for p in answer.partitions}
    assert results[0].error_code == ErrorCode.NOT_LEADER_OR_FOLLOWER, results[0]
    assert results[0].base_offset == -1
    assert (results[1].error_code, results[1].base_offset) == (ErrorCode.NONE, 1)
    assert values() == [b"a0", b"other"]


async def test_a_produce_completed_without_an_outcome_is_never_acknowledged() -> None:
    """The purgatory completes what still waits when the broker shuts down: a batch with no
    outcome then is neither committed nor refused, and answers REQUEST_TIMED_OUT."""
    op = waiting_for(Hosted(leader_epoch=1), 2, leader_epoch=1)
    purgatory = Purgatory("Produce", asyncio.get_running_loop())
    assert not purgatory.try_complete_else_watch(op, [TP])
    purgatory.cancel_all()
    code, message = (await asyncio.wait_for(op.done, WAIT_S))[TP]
    assert code == ErrorCode.REQUEST_TIMED_OUT
    assert "stopped waiting" in message


async def test_the_answer_of_a_produce_cancelled_in_the_purgatory_is_an_error(
    start_broker: Callable[..., Any],
) -> None:
    server, client = await start_broker(1)
    # Broker 2 never fetches: the batch is never committed.
    await make_leader(client.channel, TP[0], 0, leader=1, leader_epoch=1, replicas=[1, 2])
    rm = server.replica_manager
    produce = asyncio.create_task(rm.produce(produce_request(-1, (0, b"uncommitted"))))
    await eventually(lambda: rm.produce_purgatory.watched == 1, WAIT_S)
    rm.produce_purgatory.cancel_all()
    [result] = (await asyncio.wait_for(produce, WAIT_S)).partitions
    assert (result.error_code, result.base_offset) == (ErrorCode.REQUEST_TIMED_OUT, -1)


async def test_a_produce_whose_client_has_gone_waits_no_more(
    start_broker: Callable[..., Any],
) -> None:
    """A disconnect or a deadline cancels the waiting request: its operation leaves the
    purgatory then, not at its timeout."""
    server, client = await start_broker(1)
    await make_leader(client.channel, TP[0], 0, leader=1, leader_epoch=1, replicas=[1, 2])
    rm = server.replica_manager
    produce = asyncio.create_task(rm.produce(produce_request(-1, (0, b"uncommitted"))))
    await eventually(lambda: rm.produce_purgatory.watched == 1, WAIT_S)
    produce.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(produce, WAIT_S)
    assert rm.produce_purgatory.watched == 0


async def test_a_batch_waiting_through_an_epoch_bump_that_kept_its_leader_is_acknowledged(
    start_broker: Callable[..., Any],
) -> None:
    """The controller fences follower 2, which never fetched the batch, and shrinks the ISR
    to the leader in a new leader epoch. The batch is still at its offset in the leader's
    log, and the ISR left commits it: acknowledged, not refused as if leadership had moved
    (a producer without idempotence would write it twice on its retry)."""
    server, client = await start_broker(1)
    await make_leader(client.channel, TP[0], 0, leader=1, leader_epoch=1, replicas=[1, 2])
    rm = server.replica_manager
    produce = asyncio.create_task(rm.produce(produce_request(-1, (0, b"kept"))))
    await eventually(lambda: rm.produce_purgatory.watched == 1, WAIT_S)
    await make_leader(client.channel, TP[0], 0, leader=1, leader_epoch=2, replicas=[1, 2], isr=[1])
    [result] = (await asyncio.wait_for(produce, WAIT_S)).partitions
    assert (result.error_code, result.base_offset) == (ErrorCode.NONE, 0)
    assert [r.value for r in decode_batches(rm.partitions[TP].log.read(0, 1 << 20))] == [b"kept"]


async def test_a_lower_min_insync_in_update_metadata_commits_a_waiting_batch_at_once(
    start_broker: Callable[..., Any],
) -> None:
    """An acks=all batch appended with ISR {1, 2}; the ISR shrinks to {1}, below the topic's
    min.insync.replicas 2, so the HW holds (KIP-966) while broker 2 stays quiet. The topic
    lowers it to 1 (UpdateMetadata): the HW moves and the produce is answered at once, not
    at the next append or fetch that moves a LEO (before, review 12)."""
    server, client = await start_broker(1)
    min_2 = {"min.insync.replicas": "2"}
    await make_leader(
        client.channel, TP[0], 0, leader=1, leader_epoch=1, replicas=[1, 2], configs=min_2
    )
    rm = server.replica_manager
    produce = asyncio.create_task(rm.produce(produce_request(-1, (0, b"waiting"))))
    await eventually(lambda: rm.produce_purgatory.watched == 1, WAIT_S)
    await make_leader(
        client.channel, TP[0], 0, leader=1, leader_epoch=2, replicas=[1, 2], isr=[1], configs=min_2
    )
    state = rm.partitions[TP].state
    assert (state.high_watermark, rm.produce_purgatory.watched) == (0, 1)
    request = cluster_pb2.UpdateMetadataRequest(
        controller_epoch=1,
        type=cluster_pb2.UPDATE_METADATA_TYPE_DELTA,
        topic_configs=[common_pb2.TopicConfig(topic=TP[0], configs={"min.insync.replicas": "1"})],
    )
    assert (await client.control.UpdateMetadata(request)).error_code == ErrorCode.NONE
    assert state.high_watermark == 1
    [result] = (await asyncio.wait_for(produce, WAIT_S)).partitions
    assert (result.error_code, result.base_offset) == (ErrorCode.NONE, 0)


async def test_an_elr_in_leader_and_isr_holds_a_waiting_batch_until_it_is_cleared(
    start_broker: Callable[..., Any],
) -> None:
    """min.insync.replicas 1 here; the controller counts 2 (its own, or a topic's raise this
    broker has not applied). An acks=all batch appended with ISR {1, 2}; the controller takes
    2 out with ELR {2}: the HW holds though ISR {1} meets 1 here (before, it moved and the
    batch was acknowledged without 2, which may lead next), and a new acks=all produce is
    refused naming the ELR. The ELR cleared alone (a newer partition epoch in the same leader
    epoch): the HW moves and the waiting produce is answered at once."""
    server, client = await start_broker(1)
    rm = server.replica_manager
    await make_leader(client.channel, TP[0], 0, leader=1, leader_epoch=1, replicas=[1, 2])
    produce = asyncio.create_task(rm.produce(produce_request(-1, (0, b"waiting"))))
    await eventually(lambda: rm.produce_purgatory.watched == 1, WAIT_S)
    shrunk = {"leader": 1, "leader_epoch": 2, "replicas": [1, 2], "isr": [1]}
    await make_leader(client.channel, TP[0], 0, **shrunk, elr=[2])  # type: ignore[arg-type]
    state = rm.partitions[TP].state
    assert (state.elr, state.high_watermark, rm.produce_purgatory.watched) == ((2,), 0, 1)
    [refused] = (await rm.produce(produce_request(-1, (0, b"refused")))).partitions
    assert (refused.error_code, refused.error_message) == (
        ErrorCode.NOT_ENOUGH_REPLICAS,
        "t-0: ISR [1] is below min.insync.replicas as the controller counts it "
        "(eligible leader replicas [2])",
    )
    await make_leader(client.channel, TP[0], 0, **shrunk, partition_epoch=3)  # type: ignore[arg-type]
    assert (state.elr, state.high_watermark) == ((), 1)
    [result] = (await asyncio.wait_for(produce, WAIT_S)).partitions
    assert (result.error_code, result.base_offset) == (ErrorCode.NONE, 0)
