"""The controller process: ControllerService on gRPC, campaigning for leadership through etcd."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path

from tidewater.controller.controller import Controller, ControllerConfig
from tidewater.controller.service import ControllerService
from tidewater.controller.store import ControllerStore
from tidewater.rpc.server import ServiceHost
from tidewater.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


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
) -> None:
    """Serve until SIGTERM or SIGINT; campaign in the background all along."""
    host_name, _, port_text = listen.rpartition(":")
    host = ServiceHost([controller_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name])
    port = host.bind(host_name, int(port_text))
    store = await ControllerStore.connect(etcd_endpoints, cluster)
    controller = Controller(
        ControllerConfig(
            controller_id=controller_id,
            host=host_name,
            port=port,
            lease_ttl_s=lease_ttl_s,
            broker_session_timeout_ms=session_timeout_ms,
            leader_imbalance_check_interval_s=leader_imbalance_check_interval_s,
            metadata_addresses=metadata_addresses,
        ),
        store,
        wall_clock_ms,
    )
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(
        ControllerService(controller), host.server
    )
    await host.start()
    await host.set_serving()
    address = f"{host_name}:{port}"
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(address)
        tmp.rename(ready_file)
    print(f"tidewater controller {controller_id} listening on {address}", flush=True)
    campaign = asyncio.create_task(controller.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([campaign, stopped], return_when=asyncio.FIRST_COMPLETED)
    campaign.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await campaign
    await host.stop(1.0)
    await store.resign()
    await store.close()
    log.info("controller %d stopped", controller_id)
