"""A leader's ISR change proposals on their way to the controller (the stand-in, on real gRPC on
loopback), delivered to real Partitions over real logs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from tests.broker.logged import Logged
from tidewater.broker.controller_client import ControllerClient
from tidewater.broker.isr_channel import AlterIsrChannel, AlterIsrResultHandler
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.log import Log
from tidewater.errors import TidewaterError
from tidewater.local.standin_controller import PartitionState, StandinController, make_leader
from tidewater.local.wait import eventually
from tidewater.replication.partition import (
    NO_BROKER_EPOCH,
    NO_EPOCH,
    AlterIsrProposal,
    FollowerFetch,
    LeaderAndIsr,
    Partition,
    ReplicationConfig,
)
from tidewater.v1 import controller_pb2 as cpb

TOPIC = "isr"
NOW_MS = 1_000_000
WAIT_S = 20.0

Lead = Callable[[int], Partition]


@pytest.fixture
def lead(tmp_path: Path, standin: tuple[StandinController, str]) -> Iterator[Lead]:
    """Broker 1 leads a partition at leader epoch 1 with ISR {1}, 2 being a replica too, as the
    stand-in has it."""
    logs: list[Log] = []

    def make(partition: int) -> Partition:
        log = Log.open(tmp_path / f"{TOPIC}-{partition}", LogConfig())
        logs.append(log)
        leader = Partition(TOPIC, partition, 1, log, ReplicationConfig(), 0)
        leader.make_leader(LeaderAndIsr(1, 1, (1,), (1, 2), partition_epoch=1), NOW_MS)
        standin[0].states[TOPIC, partition] = PartitionState(
            leader=1, leader_epoch=1, isr=[1], replicas=[1, 2], partition_epoch=1
        )
        return leader

    yield make
    for log in logs:
        log.close()


def deliver_to(leaders: dict[int, Partition]) -> AlterIsrResultHandler:
    """What the replica manager does with an answer."""

    def on_result(
        proposal: AlterIsrProposal,
        committed: LeaderAndIsr | None,
        error: TidewaterError | None,
    ) -> bool:
        leader = leaders[proposal.partition]
        leader.on_alter_isr_result(proposal, committed, error, NOW_MS)
        return leader.awaits_answer(proposal)

    return on_result


@contextlib.asynccontextmanager
async def running(address: str, on_result: AlterIsrResultHandler) -> AsyncIterator[AlterIsrChannel]:
    client = ControllerClient([address])
    channel = AlterIsrChannel(1, client, on_result, lambda: 1, window_ms=1)
    task = asyncio.create_task(channel.run())
    try:
        yield channel
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


def propose_expansion(channel: AlterIsrChannel, leader: Partition) -> None:
    """Follower 2 fetches at the leader's LEO: the leader proposes ISR {1, 2}."""
    proposal = leader.on_follower_fetch(FollowerFetch(2, 0, 0, NO_EPOCH, 1), NOW_MS).isr_proposal
    assert proposal is not None and proposal.new_isr == (1, 2)
    channel.propose(proposal)


async def test_a_lost_answer_is_asked_for_again_until_the_leader_has_the_committed_isr(
    standin: tuple[StandinController, str], lead: Lead
) -> None:
    controller, address = standin
    leader = lead(0)
    async with running(address, deliver_to({0: leader})) as channel:
        # The stand-in commits, then every attempt of the client's first call loses its answer.
        controller.lose_alter_isr_answers = 3
        propose_expansion(channel, leader)
        await eventually(lambda: not leader.isr_state.in_flight, WAIT_S)
    committed = controller.states[TOPIC, 0]
    assert (sorted(leader.isr), leader.partition_epoch) == ([1, 2], 2)
    assert (committed.isr, committed.partition_epoch) == ([1, 2], 2)
    assert controller.isr_changes == [(TOPIC, 0, [1, 2])]
    assert controller.lose_alter_isr_answers == 0, "the answer came on a later call"


async def test_a_partition_whose_answer_cannot_be_applied_holds_up_no_other(
    standin: tuple[StandinController, str], lead: Lead, logged: Logged
) -> None:
    _, address = standin
    leaders = {0: lead(0), 1: lead(1), 2: lead(2)}
    deliver = deliver_to(leaders)

    def on_result(
        proposal: AlterIsrProposal,
        committed: LeaderAndIsr | None,
        error: TidewaterError | None,
    ) -> bool:
        if proposal.partition == 0:
            raise RuntimeError("a bug in applying the answer")
        return deliver(proposal, committed, error)

    async with running(address, on_result) as channel:
        propose_expansion(channel, leaders[0])
        propose_expansion(channel, leaders[1])
        await eventually(lambda: leaders[1].isr == {1, 2}, WAIT_S)
        # The channel goes on with later proposals.
        propose_expansion(channel, leaders[2])
        await eventually(lambda: leaders[2].isr == {1, 2}, WAIT_S)
    assert logged(logging.ERROR, f"{TOPIC}-0", "applying the AlterIsr answer failed")


async def test_an_unexpected_failure_of_the_call_leaves_the_outcome_unknown(
    standin: tuple[StandinController, str],
    lead: Lead,
    monkeypatch: pytest.MonkeyPatch,
    logged: Logged,
) -> None:
    _, address = standin
    leader = lead(0)
    call = ControllerClient.call
    failures = [RuntimeError("a bug in the client")]

    async def failing_once(client: ControllerClient, method: str, request: Any) -> Any:
        if failures:
            raise failures.pop()
        return await call(client, method, request)

    monkeypatch.setattr(ControllerClient, "call", failing_once)
    async with running(address, deliver_to({0: leader})) as channel:
        propose_expansion(channel, leader)
        await eventually(lambda: leader.isr == {1, 2}, WAIT_S)
    assert not failures
    assert logged(logging.ERROR, "AlterIsr failed unexpectedly")


async def test_an_answer_a_newer_leader_and_isr_superseded_is_not_logged_as_the_isr(
    start_broker: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Only an answer the leader applies is logged `ISR is now ...` (before, review 12, any
    committed answer was, even one it ignored)."""
    server, client = await start_broker(1)
    await make_leader(client.channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1, 2])
    rm = server.replica_manager
    # Proposed in partition epoch 1, answered after the LeaderAndIsr above superseded it.
    stale = AlterIsrProposal(TOPIC, 0, 1, (1,), 1, (NO_BROKER_EPOCH,))
    committed = LeaderAndIsr(1, 1, (1,), (1, 2), 2)
    with caplog.at_level(logging.INFO):
        assert rm._on_alter_isr_result(stale, committed, None) is False
    assert rm.partitions[TOPIC, 0].state.isr == {1, 2}
    assert "ISR is now" not in caplog.text


async def test_a_committed_answer_brings_the_elr_committed_with_the_isr(tmp_path: Path) -> None:
    """The controller shrinks ISR {1, 2} to {1} with ELR {2} (its min ISR is 2): the leader
    gets the ELR with the ISR, and holds the HW by it (its own min.insync.replicas is 1).
    Before, the answer's ELR was not read."""

    class Controller:
        """Answers as the controller does once it has committed the proposal."""

        async def call(self, method: str, request: cpb.AlterIsrRequest, **_: Any) -> Any:
            [p] = request.partitions
            result = cpb.AlterIsrPartitionResponse(
                topic=p.topic,
                partition=p.partition,
                leader=1,
                leader_epoch=p.leader_epoch,
                isr=p.new_isr,
                partition_epoch=p.partition_epoch + 1,
                eligible_leader_replicas=[2],
            )
            return cpb.AlterIsrResponse(partitions=[result])

    log = Log.open(tmp_path / f"{TOPIC}-0", LogConfig())
    try:
        leader = Partition(TOPIC, 0, 1, log, ReplicationConfig(replica_lag_time_max_ms=10), 0)
        leader.make_leader(LeaderAndIsr(1, 1, (1, 2), (1, 2), partition_epoch=1), NOW_MS)
        shrink = leader.maybe_shrink_isr(NOW_MS + 11)
        assert shrink is not None and shrink.new_isr == (1,)
        controller = cast("ControllerClient", Controller())
        channel = AlterIsrChannel(1, controller, deliver_to({0: leader}), lambda: 1, window_ms=1)
        task = asyncio.create_task(channel.run())
        try:
            channel.propose(shrink)
            await eventually(lambda: not leader.isr_state.in_flight, WAIT_S)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert (leader.isr, leader.elr, leader.partition_epoch) == ({1}, (2,), 2)
        assert leader.under_min_isr
    finally:
        log.close()
