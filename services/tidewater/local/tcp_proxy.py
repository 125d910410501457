"""A TCP proxy for fault-injection tests: one listener on 127.0.0.1 forwarding to one target,
whose link can be cut at run time.

Modes:
- PASS: forward bytes both ways.
- DROP: close every connection, and each new one as soon as it is accepted (a crashed peer or
  a reset link: the client notices at once).
- BLACKHOLE: accept, read and discard, answer nothing (a partitioned network: the client
  notices only through its own timeouts).
- ONE_WAY: forward the client's bytes, discard the target's (the target acts on requests whose
  answers are lost: a fault between a server's action and its response).

Switching to BLACKHOLE or ONE_WAY affects open connections too; switching back to PASS closes
those, since bytes were lost in them, and the client reconnects. Bounded: at most
`max_connections` at a time (more are closed on accept), reads of at most `chunk_bytes`, writes
wait for the receiver.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, field
from types import TracebackType

log = logging.getLogger(__name__)

LISTEN_HOST = "127.0.0.1"
# A target that refuses every connection (nothing can listen on port 0): for a proxy started
# before its target has a port.
NOWHERE = f"{LISTEN_HOST}:0"
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_CHUNK_BYTES = 64 * 1024
STOP_TIMEOUT_S = 5.0


class LinkMode(enum.Enum):
    PASS = "pass"
    DROP = "drop"
    BLACKHOLE = "blackhole"
    ONE_WAY = "one-way"


@dataclass(eq=False)
class _Connection:
    handler: asyncio.Task[None]
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    # Set once blackholed: from then on nothing more is forwarded either way.
    silenced: bool = False
    # Set once one-way: from then on nothing more is forwarded to the client.
    answers_lost: bool = False
    closed: bool = False

    def close(self) -> None:
        """Close both sides now; the handler then sees EOF or a reset and returns. (Cancelling
        a stream server's handler task would make asyncio log it as an error.)"""
        self.closed = True
        for writer in self.writers:
            writer.transport.abort()


class TcpProxy:
    """Use as `async with TcpProxy("127.0.0.1:9093") as proxy:`; `proxy.address` is where
    clients connect instead of the target."""

    def __init__(
        self,
        target: str,
        mode: LinkMode = LinkMode.PASS,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.retarget(target)
        self._mode = mode
        self._max_connections = max_connections
        self._chunk_bytes = chunk_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self.address = ""
        # Bytes swallowed so far (blackholed), for tests to wait on.
        self.discarded = 0

    def retarget(self, target: str) -> None:
        """Forward the connections accepted from now on to `target`: a target started after
        the proxy (its address advertised as the proxy's) on a port it bound itself."""
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"target must be host:port, got {target!r}")
        self.target = target
        self._target_host, self._target_port = host, int(port)

    @property
    def mode(self) -> LinkMode:
        return self._mode

    async def start(self) -> str:
        """Listen on a free port of 127.0.0.1; returns the address to connect to."""
        self._server = await asyncio.start_server(self._accept, LISTEN_HOST, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{LISTEN_HOST}:{port}"
        return self.address

    def set_mode(self, mode: LinkMode) -> None:
        self._mode = mode
        for connection in list(self._connections):
            lossy = connection.silenced or connection.answers_lost
            if mode is LinkMode.DROP or (mode is LinkMode.PASS and lossy):
                connection.close()
            elif mode is LinkMode.BLACKHOLE:
                connection.silenced = True
            elif mode is LinkMode.ONE_WAY:
                connection.answers_lost = True

    async def stop(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
        for connection in self._connections:
            connection.close()
        # Closed transports end their handlers at once (EOF or a reset); the bound is a guard.
        handlers = [c.handler for c in self._connections]
        if handlers:
            await asyncio.wait(handlers, timeout=STOP_TIMEOUT_S)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> TcpProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._mode is LinkMode.DROP or len(self._connections) >= self._max_connections:
            writer.close()
            return
        handler = asyncio.current_task()
        assert handler is not None
        connection = _Connection(
            handler,
            [writer],
            silenced=self._mode is LinkMode.BLACKHOLE,
            answers_lost=self._mode is LinkMode.ONE_WAY,
        )
        self._connections.add(connection)
        try:
            if connection.silenced:
                await self._pump(reader, None, connection, answers=False)
                return
            up_reader, up_writer = await asyncio.open_connection(
                self._target_host, self._target_port
            )
            connection.writers.append(up_writer)
            if connection.closed:  # dropped while connecting
                return
            await asyncio.gather(
                self._pump(reader, up_writer, connection, answers=False),
                self._pump(up_reader, writer, connection, answers=True),
            )
        except OSError as e:
            # The target is down or one side reset: close both sides.
            log.debug("proxy %s -> %s: %r", self.address, self.target, e)
        finally:
            self._connections.discard(connection)
            connection.close()

    async def _pump(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter | None,
        connection: _Connection,
        answers: bool,
    ) -> None:
        """Forward source to sink; `answers`: the target-to-client direction."""

        def lost() -> bool:
            return sink is None or connection.silenced or (answers and connection.answers_lost)

        while data := await source.read(self._chunk_bytes):
            if lost():
                self.discarded += len(data)
                continue
            assert sink is not None
            sink.write(data)
            await sink.drain()
        if sink is not None and not lost() and sink.can_write_eof():
            sink.write_eof()
