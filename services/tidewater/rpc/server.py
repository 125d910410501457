"""A grpc.aio server with what every Tidewater service serves besides its own API:
grpc.health.v1 (NOT_SERVING until the service says it is ready) and server reflection."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

# Record batches of a few MiB must pass in one message.
MAX_MESSAGE_BYTES = 128 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class ServiceHost:
    """Owns a grpc.aio server, its health servicer and the bound port."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
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
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
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
