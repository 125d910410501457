"""A leader's ISR change proposals on their way to the controller (the stand-in, on real gRPC on
loopback), delivered to a real Partition over a real log."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tidewater.broker.controller_client import ControllerClient
from tidewater.broker.isr_channel import AlterIsrChannel
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.log import Log
from tidewater.errors import TidewaterError
from tidewater.local.standin_controller import PartitionState, StandinController
from tidewater.local.wait import eventually
from tidewater.replication.partition import (
    NO_EPOCH,
    AlterIsrProposal,
    FollowerFetch,
    LeaderAndIsr,
    Partition,
    ReplicationConfig,
)

TOPIC = "isr"
TP = (TOPIC, 0)
NOW_MS = 1_000_000
WAIT_S = 20.0


@pytest.fixture
async def controller() -> AsyncIterator[tuple[StandinController, str]]:
    standin = StandinController(brokers={})
    address = await standin.start()
    yield standin, address
    await standin.stop()


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[Partition]:
    """Broker 1 leads TP at leader epoch 1 with ISR {1}; 2 is a replica."""
    log = Log.open(tmp_path / f"{TOPIC}-0", LogConfig())
    partition = Partition(TOPIC, 0, 1, log, ReplicationConfig(), 0)
    partition.make_leader(LeaderAndIsr(1, 1, (1,), (1, 2), partition_epoch=1), NOW_MS)
    yield partition
    log.close()


async def test_a_lost_answer_is_asked_for_again_until_the_leader_has_the_committed_isr(
    controller: tuple[StandinController, str], leader: Partition
) -> None:
    standin, address = controller
    standin.states[TP] = PartitionState(
        leader=1, leader_epoch=1, isr=[1], replicas=[1, 2], partition_epoch=1
    )

    def on_result(
        proposal: AlterIsrProposal,
        committed: LeaderAndIsr | None,
        error: TidewaterError | None,
    ) -> bool:
        leader.on_alter_isr_result(proposal, committed, error, NOW_MS)
        return leader.awaits_answer(proposal)

    client = ControllerClient([address])
    channel = AlterIsrChannel(1, client, on_result, lambda: 1, window_ms=1)
    task = asyncio.create_task(channel.run())
    try:
        # The stand-in commits, then every attempt of the client's first call loses its answer.
        standin.lose_alter_isr_answers = 3
        fetch = FollowerFetch(2, 0, 0, NO_EPOCH, 1)
        proposal = leader.on_follower_fetch(fetch, NOW_MS).isr_proposal
        assert proposal is not None and proposal.new_isr == (1, 2)
        channel.propose(proposal)
        await eventually(lambda: not leader.isr_state.in_flight, WAIT_S)
        committed = standin.states[TP]
        assert (sorted(leader.isr), leader.partition_epoch) == ([1, 2], 2)
        assert (committed.isr, committed.partition_epoch) == ([1, 2], 2)
        assert standin.isr_changes == [(TOPIC, 0, [1, 2])]
        assert standin.lose_alter_isr_answers == 0, "the answer came on a later call"
    finally:
        task.cancel()
        await client.close()
