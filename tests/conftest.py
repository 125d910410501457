"""Fixtures shared by the whole suite: real brokers, in-process or as child processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tidewater.broker.config import BrokerConfig
from tidewater.broker.log import log as log_module
from tidewater.broker.server import BrokerServer
from tidewater.local.process import ManagedProcess, broker_args
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2_grpc


class BrokerClient:
    """Stubs for one broker over one channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.service = broker_pb2_grpc.BrokerServiceStub(channel)
        self.control = broker_pb2_grpc.BrokerControlStub(channel)


@pytest.fixture
async def start_broker(tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    """Start in-process brokers (real gRPC server on 127.0.0.1, real files) on demand."""
    servers: list[BrokerServer] = []
    channels: list[grpc.aio.Channel] = []

    async def start(broker_id: int = 1, **props: object) -> tuple[BrokerServer, BrokerClient]:
        config = BrokerConfig.from_properties(
            {
                "broker.id": broker_id,
                "listeners": "127.0.0.1:0",
                "log.dirs": str(tmp_path / f"broker-{broker_id}"),
                **props,
            }
        )
        server = BrokerServer(config)
        await server.start()
        servers.append(server)
        channel = grpc.aio.insecure_channel(server.address, options=CHANNEL_OPTIONS)
        channels.append(channel)
        return server, BrokerClient(channel)

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(grace_s=0)


@pytest.fixture
def broker_processes(tmp_path: Path) -> Iterator[Callable[..., ManagedProcess]]:
    """Broker child processes; every one is killed at teardown, even when the test fails."""
    started: list[ManagedProcess] = []

    def make(
        broker_id: int = 1,
        listen: str = "127.0.0.1:0",
        config: Path | None = None,
        **settings: str,
    ) -> ManagedProcess:
        proc = ManagedProcess(
            f"broker-{broker_id}",
            broker_args(
                broker_id, tmp_path / f"broker-{broker_id}", listen, settings, config=config
            ),
            tmp_path,
        )
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.kill()


@pytest.fixture
def off_loop_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Produced batches go to a writer thread however small (normally only large ones do)."""
    monkeypatch.setattr(log_module, "OFF_LOOP_WRITE_BYTES", 0)
