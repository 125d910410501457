"""The fault-injection TCP proxy, in front of a real echo server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tidewater.local.tcp_proxy import NOWHERE, LinkMode, TcpProxy
from tidewater.local.wait import eventually

DEADLINE_S = 5.0
POLL_S = 0.01


class EchoServer:
    """Echoes every byte back; counts connections and bytes received."""

    def __init__(self) -> None:
        self.connections = 0
        self.received = 0
        self.address = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._echo, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while data := await reader.read(65536):
                self.received += len(data)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    server = EchoServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def proxy(echo: EchoServer) -> AsyncIterator[TcpProxy]:
    async with TcpProxy(echo.address) as proxy:
        yield proxy


async def connect(proxy: TcpProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, _, port = proxy.address.rpartition(":")
    return await asyncio.open_connection(host, int(port))


async def round_trip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> bytes:
    """Send and read back at the same time, so a payload larger than the socket buffers
    cannot stall either side."""

    async def send() -> None:
        writer.write(data)
        await writer.drain()

    _, echoed = await asyncio.wait_for(
        asyncio.gather(send(), reader.readexactly(len(data))), DEADLINE_S
    )
    return echoed


async def assert_closed_by_peer(reader: asyncio.StreamReader) -> None:
    """Return once the other side closed or reset the connection; fail if it does not."""
    try:
        while await asyncio.wait_for(reader.read(65536), DEADLINE_S):
            pass
    except ConnectionError:
        pass
    except TimeoutError:
        raise AssertionError(f"connection still open after {DEADLINE_S} s") from None


async def test_pass_forwards_both_ways_with_backpressure(proxy: TcpProxy) -> None:
    reader, writer = await connect(proxy)
    payload = bytes(range(256)) * 32768  # 8 MiB: more than the socket buffers hold
    assert await round_trip(reader, writer, payload) == payload
    assert await round_trip(reader, writer, b"again") == b"again"
    writer.close()


async def test_drop_closes_open_connections_and_every_new_one(
    proxy: TcpProxy, echo: EchoServer
) -> None:
    reader, writer = await connect(proxy)
    assert await round_trip(reader, writer, b"hello") == b"hello"

    proxy.set_mode(LinkMode.DROP)
    assert proxy.mode is LinkMode.DROP

    await assert_closed_by_peer(reader)
    reader, _ = await connect(proxy)
    await assert_closed_by_peer(reader)
    assert echo.connections == 1  # the dropped attempt never reached the target

    proxy.set_mode(LinkMode.PASS)
    reader, writer = await connect(proxy)
    assert await round_trip(reader, writer, b"back") == b"back"
    writer.close()


async def assert_healing_reconnects(proxy: TcpProxy, reader: asyncio.StreamReader) -> None:
    """Bytes were lost in the connection, so healing closes it; new ones pass."""
    proxy.set_mode(LinkMode.PASS)
    await assert_closed_by_peer(reader)
    reader, writer = await connect(proxy)
    assert await round_trip(reader, writer, b"heard") == b"heard"
    writer.close()


async def test_blackhole_accepts_swallows_and_answers_nothing(
    proxy: TcpProxy, echo: EchoServer
) -> None:
    proxy.set_mode(LinkMode.BLACKHOLE)
    reader, writer = await connect(proxy)
    writer.write(b"into the void")
    await writer.drain()
    await eventually(lambda: proxy.discarded == len(b"into the void"), DEADLINE_S, POLL_S)
    assert echo.connections == 0

    await assert_healing_reconnects(proxy, reader)


async def test_blackhole_silences_open_connections(proxy: TcpProxy, echo: EchoServer) -> None:
    reader, writer = await connect(proxy)
    assert await round_trip(reader, writer, b"first") == b"first"

    proxy.set_mode(LinkMode.BLACKHOLE)
    writer.write(b"second")
    await writer.drain()

    await eventually(lambda: proxy.discarded == len(b"second"), DEADLINE_S, POLL_S)
    assert echo.received == len(b"first")
    writer.close()


async def test_one_way_forwards_requests_and_loses_the_answers(
    proxy: TcpProxy, echo: EchoServer
) -> None:
    reader, writer = await connect(proxy)
    await round_trip(reader, writer, b"first")
    proxy.set_mode(LinkMode.ONE_WAY)
    writer.write(b"acted on")
    # The target gets the bytes and answers; the client hears nothing.
    await eventually(lambda: echo.received == len(b"firstacted on"), DEADLINE_S, POLL_S)
    await eventually(lambda: proxy.discarded == len(b"acted on"), DEADLINE_S, POLL_S)

    await assert_healing_reconnects(proxy, reader)


async def test_connections_beyond_the_bound_are_closed(echo: EchoServer) -> None:
    async with TcpProxy(echo.address, max_connections=2) as proxy:
        held = [await connect(proxy) for _ in range(2)]
        for reader, writer in held:
            assert await round_trip(reader, writer, b"in") == b"in"
        reader, _ = await connect(proxy)
        await assert_closed_by_peer(reader)
        assert echo.connections == 2
        for _, writer in held:
            writer.close()


async def test_a_target_that_is_down_closes_the_client() -> None:
    gone = EchoServer()
    await gone.start()
    await gone.stop()
    async with TcpProxy(gone.address) as proxy:
        reader, _ = await connect(proxy)
        await assert_closed_by_peer(reader)


async def test_a_proxy_started_before_its_target_leads_nowhere_until_retargeted(
    echo: EchoServer,
) -> None:
    """A proxy whose address is advertised before the target binds a port of its own."""
    async with TcpProxy(NOWHERE) as proxy:
        reader, _ = await connect(proxy)
        await assert_closed_by_peer(reader)
        proxy.retarget(echo.address)
        assert await round_trip(*await connect(proxy), b"x") == b"x"


async def test_stop_closes_every_connection_and_the_listener(echo: EchoServer) -> None:
    proxy = TcpProxy(echo.address)
    await proxy.start()
    passing = await connect(proxy)
    assert await round_trip(*passing, b"x") == b"x"
    proxy.set_mode(LinkMode.BLACKHOLE)
    swallowing = await connect(proxy)

    await proxy.stop()

    await assert_closed_by_peer(passing[0])
    await assert_closed_by_peer(swallowing[0])
    with pytest.raises(ConnectionRefusedError):
        await connect(proxy)


def test_target_must_be_host_and_port() -> None:
    with pytest.raises(ValueError, match="host:port"):
        TcpProxy("localhost")
