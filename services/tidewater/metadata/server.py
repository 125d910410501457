"""The metadata service process: MetadataService and MetadataControl over one cache."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tidewater.metadata.cache import MetadataCache
from tidewater.metadata.service import MetadataControl, MetadataService
from tidewater.rpc.address import parse_listener
from tidewater.rpc.handlers import add_service
from tidewater.rpc.server import ServiceHost, announce, wait_for_stop_signal
from tidewater.v1 import metadata_pb2, metadata_pb2_grpc

if TYPE_CHECKING:
    from tidewater.telemetry.metrics import MetricsEndpoint

log = logging.getLogger(__name__)


class MetadataServer:
    """Listens at once; health turns SERVING when the first FULL view has been applied."""

    def __init__(self, listen: str, metrics_port: int | None = None) -> None:
        # Nobody is told this address (clients and controllers are configured with it), so
        # any bind address will do, a wildcard one included.
        bind = parse_listener(listen, "--listen")
        self.listen_host, self.listen_port = bind.host, bind.port
        self.metrics_port = metrics_port
        self.metrics: MetricsEndpoint | None = None
        self.cache = MetadataCache()
        names = [
            metadata_pb2.DESCRIPTOR.services_by_name[name].full_name
            for name in ("MetadataService", "MetadataControl")
        ]
        self.host = ServiceHost(names)
        add_service(
            metadata_pb2_grpc.add_MetadataServiceServicer_to_server,
            MetadataService(self.cache),
            self.host.server,
        )
        add_service(
            metadata_pb2_grpc.add_MetadataControlServicer_to_server,
            MetadataControl(self.cache, self.host.set_serving),
            self.host.server,
        )

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.host.port}"

    async def start(self) -> None:
        self.host.bind(self.listen_host, self.listen_port)
        if self.metrics_port is not None:
            self._start_metrics()
        await self.host.start()

    def _start_metrics(self) -> None:
        # Imported here: with metrics off the process never loads OpenTelemetry.
        from tidewater.telemetry.metrics import MetricsEndpoint

        self.metrics = MetricsEndpoint(
            "tidewater-metadata", self.listen_host, self.metrics_port or 0
        )
        cache = self.cache
        self.metrics.gauge(
            "tidewater.metadata.ready",
            "1 once the controller has sent a FULL cluster view, else 0 (health NOT_SERVING)",
            lambda: int(cache.ready),
        )
        self.metrics.gauge(
            "tidewater.metadata.controller_epoch",
            "The newest controller epoch seen, -1 before any",
            lambda: cache.controller_epoch,
        )
        self.metrics.gauge(
            "tidewater.metadata.live_brokers",
            "Live brokers in the view",
            lambda: cache.broker_count,
        )
        self.metrics.gauge(
            "tidewater.metadata.partitions",
            "Partitions in the view",
            lambda: cache.partition_count,
        )

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.host.stop(grace_s)
        if self.metrics is not None:
            self.metrics.close()


async def run_metadata(
    listen: str, ready_file: Path | None = None, metrics_port: int | None = None
) -> None:
    """Serve until SIGTERM or SIGINT. The ready file (the bound address) means "listening";
    health SERVING means "has a cluster view"."""
    server = MetadataServer(listen, metrics_port)
    await server.start()
    announce("metadata", server.address, ready_file, server.metrics)
    await wait_for_stop_signal()
    await server.stop()
    log.info("metadata service on %s stopped", server.address)
