"""A grpc.aio server with what every Tidewater service serves besides its own API:
grpc.health.v1 (NOT_SERVING until the service says it is ready) and server reflection."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from tidewater.rpc.address import ListenFailed, bind_error
from tidewater.telemetry import tracing

if TYPE_CHECKING:  # the SDK client imports CHANNEL_OPTIONS, and needs no metrics stack
    from tidewater.telemetry.metrics import MetricsEndpoint

# Record batches of a few MiB must pass in one message.
MAX_MESSAGE_BYTES = 128 * 1024 * 1024
# A peer that restarts is reached again within a second, as Kafka's clients do
# (reconnect.backoff.ms 50, reconnect.backoff.max.ms 1000); gRPC's own backoff grows to 120 s.
RECONNECT_BACKOFF_MS = (50, 1000)
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Not grpc.min_reconnect_backoff_ms: it is also how long a connection attempt may take.
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
]
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    # gRPC binds with SO_REUSEPORT by default: a second server started on a taken port (an
    # operator's typo) would bind it too, and the kernel would split the connections between
    # the two. Without it the second one fails to bind, as Kafka's broker does.
    ("grpc.so_reuseport", 0),
]


class ServiceHost:
    """Owns a grpc.aio server, its health servicer and the bound port."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self.server = grpc.aio.server(
            options=SERVER_OPTIONS, interceptors=tracing.server_interceptors()
        )
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [
                *self.service_names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        self.port = 0

    def bind(self, host: str, port: int) -> int:
        """Bind host:port (port 0: any free one) and return the port; ListenFailed, naming
        the address and the cause, when it is taken (or not an address of this host)."""
        address = f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # gRPC's "Failed to bind", which gives no cause
            cause = bind_error(host, port)
            why = (cause.strerror or str(cause)) if cause else "gRPC could not bind it"
            raise ListenFailed(f"cannot listen on {address}: {why}") from None
        return self.port

    async def start(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def set_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)

    async def _set_all(self, status: int) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)


def announce(
    what: str, address: str, ready_file: Path | None, metrics: MetricsEndpoint | None = None
) -> None:
    """Tell whoever started this process that it listens: the address in the ready file
    (written atomically, so a reader never sees half of it) and a line on stdout. With
    metrics, their bound address is the file's second line: a starter that asked for port 0
    learns it there, where choosing a free port for the process would race other processes."""
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(address if metrics is None else f"{address}\n{metrics.address}")
        tmp.rename(ready_file)
    print(f"tidewater {what} listening on {address}", flush=True)


async def wait_for_stop_signal() -> None:
    """Return on SIGTERM or SIGINT (Ctrl-C)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
