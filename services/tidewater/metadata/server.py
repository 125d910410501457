"""The metadata service process: MetadataService and MetadataControl over one cache."""

from __future__ import annotations

import logging
from pathlib import Path

from tidewater.errors import InvalidConfig
from tidewater.metadata.cache import MetadataCache
from tidewater.metadata.service import MetadataControl, MetadataService
from tidewater.rpc.server import ServiceHost, announce, wait_for_stop_signal
from tidewater.v1 import metadata_pb2, metadata_pb2_grpc

log = logging.getLogger(__name__)


def parse_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT (port 0 picks a free one)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidConfig(f"listen address must be HOST:PORT, got {listen!r}")
    return host, int(port)


class MetadataServer:
    """Listens at once; health turns SERVING when the first FULL view has been applied."""

    def __init__(self, listen: str) -> None:
        self.listen_host, self.listen_port = parse_listen(listen)
        self.cache = MetadataCache()
        names = [
            metadata_pb2.DESCRIPTOR.services_by_name[name].full_name
            for name in ("MetadataService", "MetadataControl")
        ]
        self.host = ServiceHost(names)
        metadata_pb2_grpc.add_MetadataServiceServicer_to_server(
            MetadataService(self.cache), self.host.server
        )
        metadata_pb2_grpc.add_MetadataControlServicer_to_server(
            MetadataControl(self.cache, self.host.set_serving), self.host.server
        )

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.host.port}"

    async def start(self) -> None:
        self.host.bind(self.listen_host, self.listen_port)
        await self.host.start()

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.host.stop(grace_s)


async def run_metadata(listen: str, ready_file: Path | None = None) -> None:
    """Serve until SIGTERM or SIGINT. The ready file (the bound address) means "listening";
    health SERVING means "has a cluster view"."""
    server = MetadataServer(listen)
    await server.start()
    announce("metadata", server.address, ready_file)
    await wait_for_stop_signal()
    await server.stop()
    log.info("metadata service on %s stopped", server.address)
