"""A server started on a port another one serves fails to start, named, instead of sharing the
port (gRPC's default SO_REUSEPORT let both bind it, and the kernel split the connections
between them); a restart at a fixed address waits its turn while another process holds it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tidewater.local.process import (
    ListenRefused,
    ManagedProcess,
    broker_args,
    metadata_args,
)
from tidewater.local.wait import eventually
from tidewater.rpc.address import ListenFailed
from tidewater.rpc.server import ServiceHost

START_TIMEOUT_S = 30.0


def broker(root: Path, name: str, listen: str) -> ManagedProcess:
    return ManagedProcess(name, broker_args(1, root / name, listen, {}), root)


def metadata(root: Path, name: str, listen: str) -> ManagedProcess:
    return ManagedProcess(name, metadata_args(listen), root)


@pytest.fixture
def processes() -> Iterator[list[ManagedProcess]]:
    started: list[ManagedProcess] = []
    yield started
    for process in started:
        process.kill()


async def answers_health(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return True


async def test_a_second_server_in_one_process_cannot_bind_a_taken_port() -> None:
    first, second = ServiceHost([]), ServiceHost([])
    port = first.bind("127.0.0.1", 0)
    try:
        with pytest.raises(ListenFailed, match=f"127.0.0.1:{port}: Address already in use"):
            second.bind("127.0.0.1", port)
    finally:
        await asyncio.gather(first.server.stop(None), second.server.stop(None))


@pytest.mark.parametrize("role", [metadata, broker], ids=["metadata", "broker"])
async def test_a_second_process_on_a_taken_port_exits_named_and_the_first_keeps_serving(
    role: Callable[[Path, str, str], ManagedProcess],
    tmp_path: Path,
    processes: list[ManagedProcess],
) -> None:
    """Before, the second one started too, on the same port."""
    first = role(tmp_path, "first", "127.0.0.1:0")
    processes.append(first)
    address = await asyncio.to_thread(first.start, START_TIMEOUT_S)
    second = role(tmp_path, "second", address)
    processes.append(second)
    with pytest.raises(ListenRefused) as refused:
        await asyncio.to_thread(second.start, START_TIMEOUT_S)
    assert f"tidewater: cannot listen on {address}: Address already in use" in str(refused.value)
    assert not second.running
    assert first.running
    assert await answers_health(address)


async def test_a_start_on_a_held_address_binds_once_the_holder_lets_go(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    """A restart at its old address that another process took meanwhile (a plain listener
    here) is started again until it binds."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        process = metadata(tmp_path, "restarted", address)
        processes.append(process)
        started = asyncio.ensure_future(asyncio.to_thread(process.start_when_free, 60))
        # Refused at least once while the address is held.
        await eventually(lambda: "cannot listen on" in process.log_tail(), 30)
    assert await started == address
    assert await answers_health(address)


async def test_a_taken_metrics_port_fails_the_start_named(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    """Before, the process exited with status 1 and "[Errno 98] Address already in use",
    naming no address."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        process = ManagedProcess("metadata", metadata_args("127.0.0.1:0", port), tmp_path)
        processes.append(process)
        with pytest.raises(ListenRefused) as refused:
            await asyncio.to_thread(process.start, START_TIMEOUT_S)
    assert f"tidewater: cannot listen on 127.0.0.1:{port}: Address already in use" in str(
        refused.value
    )
