"""The controller process: ControllerService on gRPC, campaigning for leadership through etcd."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from tidewater.controller.controller import Controller, ControllerConfig
from tidewater.controller.service import ControllerService
from tidewater.controller.store import ControllerStore
from tidewater.rpc.address import listen_and_advertised, published
from tidewater.rpc.handlers import add_service
from tidewater.rpc.server import ServiceHost, announce, wait_for_stop_signal
from tidewater.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)


def monotonic_ms() -> int:
    """The controller's clock: sessions, the grace period and the checks that expire them
    measure intervals, which a stepped wall clock (NTP, a resumed VM) would cut short, fencing
    every broker at once, or stretch (review 20 M3)."""
    return time.monotonic_ns() // 1_000_000


async def run_controller(
    controller_id: int,
    listen: str,
    etcd_endpoints: list[str],
    cluster: str,
    lease_ttl_s: int,
    session_timeout_ms: int,
    ready_file: Path | None = None,
    leader_imbalance_check_interval_s: float = 300,
    metadata_addresses: tuple[str, ...] = (),
    metrics_port: int | None = None,
    advertised_address: str = "",
    min_insync_replicas: int = 1,
    default_replication_factor: int | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT; campaign in the background all along. The advertised
    address (default: the bound one) is what the controller writes to etcd when active."""
    bind, advertised = listen_and_advertised(
        listen, advertised_address, "--listen", "--advertised-address"
    )
    host = ServiceHost([controller_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name])
    port = host.bind(bind.host, bind.port)
    endpoint = published(bind, port, advertised)
    store = await ControllerStore.connect(etcd_endpoints, cluster)
    controller = Controller(
        ControllerConfig(
            controller_id=controller_id,
            host=endpoint.host,
            port=endpoint.port,
            lease_ttl_s=lease_ttl_s,
            broker_session_timeout_ms=session_timeout_ms,
            leader_imbalance_check_interval_s=leader_imbalance_check_interval_s,
            metadata_addresses=metadata_addresses,
            min_insync_replicas=min_insync_replicas,
            default_replication_factor=default_replication_factor,
        ),
        store,
        monotonic_ms,
    )
    add_service(
        controller_pb2_grpc.add_ControllerServiceServicer_to_server,
        ControllerService(controller),
        host.server,
    )
    metrics = None
    if metrics_port is not None:
        # Imported here: with metrics off the process never loads OpenTelemetry.
        from tidewater.controller.metrics import register_controller_metrics
        from tidewater.telemetry.metrics import MetricsEndpoint

        metrics = MetricsEndpoint(
            "tidewater-controller",
            bind.host,
            metrics_port,
            {"tidewater.controller.id": controller_id},
        )
        register_controller_metrics(metrics, controller)
    await host.start()
    await host.set_serving()
    announce(f"controller {controller_id}", f"{bind.host}:{port}", ready_file, metrics)
    log.info("controller %d advertised as %s", controller_id, endpoint)
    campaign = asyncio.create_task(controller.run())
    stopped = asyncio.create_task(wait_for_stop_signal())
    await asyncio.wait([campaign, stopped], return_when=asyncio.FIRST_COMPLETED)
    campaign.cancel()
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await campaign
    finally:
        # Even after a failure: resigning lets a standby take over without waiting out the
        # lease.
        await host.stop(1.0)
        await store.resign()
        await store.close()
        if metrics is not None:
            metrics.close()
    log.info("controller %d stopped", controller_id)
