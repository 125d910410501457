"""A follower whose leader stops answering gives its fetch up after replica.fetch.wait.max.ms
plus a grace period, and fetches again on a new stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from tidewater.broker import fetcher
from tidewater.local.standin_controller import make_leader
from tidewater.local.wait import eventually
from tidewater.rpc.server import SERVER_OPTIONS
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc


class SilentLeader(broker_pb2_grpc.BrokerServiceServicer):
    """Takes fetches and never answers them."""

    def __init__(self) -> None:
        self.streams = 0
        self.fetches = 0

    async def FetchStream(
        self, request_iterator: AsyncIterator[pb.FetchRequest], context: grpc.aio.ServicerContext
    ) -> None:
        self.streams += 1
        async for _ in request_iterator:
            self.fetches += 1


@pytest.fixture
async def silent_leader() -> AsyncIterator[tuple[SilentLeader, str]]:
    leader = SilentLeader()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    broker_pb2_grpc.add_BrokerServiceServicer_to_server(leader, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield leader, f"127.0.0.1:{port}"
    await server.stop(grace=0)


async def test_an_unanswered_fetch_is_given_up_and_sent_again_on_a_new_stream(
    start_broker: Callable[..., Any],
    silent_leader: tuple[SilentLeader, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fetcher, "RPC_GRACE_S", 0.2)
    leader, address = silent_leader
    _, client = await start_broker(
        2, **{"replica.fetch.wait.max.ms": 100, "replica.fetch.backoff.ms": 50}
    )
    await make_leader(
        client.channel, "t", 0, leader=1, leader_epoch=1, replicas=[1, 2], leaders={1: address}
    )
    await eventually(lambda: leader.streams >= 3, 20.0, 0.01)
    # Never a second fetch on a stream that did not answer the first.
    assert leader.fetches <= leader.streams
