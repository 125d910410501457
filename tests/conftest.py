"""Fixtures shared by the whole suite: real brokers, in-process or as child processes."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc._cython import cygrpc

from tidewater.broker.config import BrokerConfig
from tidewater.broker.log import log as log_module
from tidewater.broker.log.dir_failure import OnFailure, halt
from tidewater.broker.server import BrokerServer
from tidewater.local.process import ManagedProcess, broker_process
from tidewater.local.wait import eventually
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2_grpc

# The grpc.aio channels made during the current test, for `every_grpc_channel_closed` (held
# till its check: one dropped unclosed is otherwise closed whenever it is collected).
_channels_made: list[grpc.aio.Channel] = []
_insecure_channel = grpc.aio.insecure_channel


def _tracked_channel(*args: Any, **kwargs: Any) -> grpc.aio.Channel:
    channel = _insecure_channel(*args, **kwargs)
    _channels_made.append(channel)
    return channel


grpc.aio.insecure_channel = _tracked_channel


@pytest.fixture(autouse=True)
def every_grpc_channel_closed() -> Iterator[None]:
    """Fails a test that leaves a grpc.aio channel open (its fixtures' teardowns done). Closed
    only when collected, perhaps during a later test, such a channel completes its calls on
    its own test's event loop, closed by then, and grpc.aio logs "Event loop is closed" in the
    later test (whose check of its log then fails)."""
    _channels_made.clear()
    yield
    # grpc.aio has no public "closed": the channel's Cython core says.
    left_open = [c for c in _channels_made if not c._channel.closed()]
    _channels_made.clear()
    assert not left_open, f"grpc.aio channels left open: {left_open}"


# How long gRPC may take to deliver what is left of a test's calls once it is over.
GRPC_SETTLE_S = 10.0


def _grpc_operations_pending(loop: asyncio.AbstractEventLoop) -> list[asyncio.Future[Any]]:
    """The futures of gRPC core operations begun on `loop` whose completion has not run on it
    yet. grpc.aio's CallbackWrapper holds a reference to itself and its future from the start
    of an operation until its completion has run on the operation's loop (gRPC has no public
    way to ask). Left out: finished futures (their completion ran), and an unfinished one
    nobody awaits: the shutdown of a server never started, which never comes."""
    return [
        future
        for wrapper in gc.get_objects()
        if type(wrapper) is cygrpc.CallbackWrapper
        for future in gc.get_referents(wrapper)
        if isinstance(future, asyncio.Future)
        and future.get_loop() is loop
        and (future.cancelled() or (not future.done() and future._callbacks))  # type: ignore[attr-defined]
    ]


def _grpc_settled(loop: asyncio.AbstractEventLoop) -> bool:
    if not _grpc_operations_pending(loop):
        return True
    gc.collect()  # a cancelled operation's wrapper may be left in garbage once completed
    return not _grpc_operations_pending(loop)


@pytest.fixture(autouse=True)
async def every_grpc_operation_completed() -> AsyncIterator[None]:
    """Waits, once the test and its fixtures are done, until gRPC has run the completion of
    every operation begun on the test's event loop, and fails the test if one never comes (a
    server left running, a call left waiting). A call cancelled (aetcd's watch stream, when
    a store closes) is finished by gRPC's core after close() returns: on a loop closed by
    then, its completion reaches the next test's loop, where grpc.aio logs "Event loop is
    closed" (and that test's check of its log fails)."""
    yield
    loop = asyncio.get_running_loop()
    try:
        await eventually(lambda: _grpc_settled(loop), GRPC_SETTLE_S)
    except AssertionError:
        pending = _grpc_operations_pending(loop)
        raise AssertionError(f"gRPC operations never completed: {pending}") from None


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

    async def start(
        broker_id: int = 1, on_log_dir_failure: OnFailure = halt, **props: object
    ) -> tuple[BrokerServer, BrokerClient]:
        config = BrokerConfig.from_properties(
            {
                "broker.id": broker_id,
                "listeners": "127.0.0.1:0",
                "log.dirs": str(tmp_path / f"broker-{broker_id}"),
                **props,
            }
        )
        server = BrokerServer(config, on_log_dir_failure=on_log_dir_failure)
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
        proc = broker_process(broker_id, tmp_path, settings, listen=listen, config=config)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.kill()


@pytest.fixture
def off_loop_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Produced batches go to a writer thread however small (normally only large ones do)."""
    monkeypatch.setattr(log_module, "OFF_LOOP_WRITE_BYTES", 0)
