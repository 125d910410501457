"""The broker process: storage, replica manager and gRPC server, started and stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tidewater.broker import background
from tidewater.broker.config import BrokerConfig
from tidewater.broker.lifecycle import BrokerLifecycle
from tidewater.broker.limits import raise_open_file_limit
from tidewater.broker.log.dir_failure import LogDirFailureChannel, OnFailure, halt
from tidewater.broker.log.manager import LogManager
from tidewater.broker.replica_manager import ReplicaManager
from tidewater.broker.service import BrokerControl, BrokerService, add_broker_service
from tidewater.broker.topic_config import TopicConfig
from tidewater.rpc.allocator import tune_for_large_messages
from tidewater.rpc.handlers import add_service
from tidewater.rpc.server import ServiceHost, announce, wait_for_stop_signal
from tidewater.v1 import broker_pb2, broker_pb2_grpc

if TYPE_CHECKING:
    from tidewater.telemetry.metrics import MetricsEndpoint

log = logging.getLogger(__name__)
# How long a stopping broker lets requests in progress finish (after its controlled shutdown).
STOP_GRACE_S = 5.0


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class BrokerServer:
    def __init__(
        self,
        config: BrokerConfig,
        metrics_port: int | None = None,
        on_log_dir_failure: OnFailure = halt,
    ) -> None:
        """`on_log_dir_failure`: what an I/O error in a log dir does (stops the process)."""
        self.config = config
        self.metrics_port = metrics_port
        self.metrics: MetricsEndpoint | None = None
        defaults = self.topic_defaults = TopicConfig.from_properties(dict(config.topic_defaults))
        self.log_manager = LogManager(
            list(config.log_dirs),
            defaults.log,
            dir_failures=LogDirFailureChannel(on_log_dir_failure),
            file_delete_delay_ms=config.file_delete_delay_ms,
        )
        loop = asyncio.get_running_loop()
        self.replica_manager = ReplicaManager(config, self.log_manager, loop, wall_clock_ms)
        names = [
            broker_pb2.DESCRIPTOR.services_by_name[name].full_name
            for name in ("BrokerService", "BrokerControl")
        ]
        self.host = ServiceHost(names)
        add_broker_service(BrokerService(self.replica_manager), self.host.server)
        add_service(
            broker_pb2_grpc.add_BrokerControlServicer_to_server,
            BrokerControl(self.replica_manager),
            self.host.server,
        )
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.host.port}"

    async def start(self) -> None:
        port = self.host.bind(self.config.host, self.config.port)
        if self.metrics_port is not None:
            self._start_metrics()
        self.advertised = self.config.advertised_address(port)
        self.lifecycle = BrokerLifecycle(
            self.replica_manager.controller,
            self.config.broker_id,
            self.advertised,
            self.config.rack,
            self.config.broker_heartbeat_interval_ms,
            self.log_manager.clean_shutdown_broker_epoch,
            self.topic_defaults.min_insync_replicas,
        )
        self.replica_manager.broker_epoch = lambda: self.lifecycle.broker_epoch
        await self.host.start()
        self._tasks = [
            background.start(
                self.log_manager.run_background_tasks(
                    retention_check_interval_ms=self.config.log_retention_check_interval_ms,
                    flush_check_interval_ms=self.config.log_flush_scheduler_interval_ms,
                    recovery_point_checkpoint_interval_ms=(
                        self.config.log_flush_offset_checkpoint_interval_ms
                    ),
                ),
                "log-manager",
            ),
            background.start_every(
                self.config.replica_high_watermark_checkpoint_interval_ms / 1000,
                self.replica_manager.checkpoint_high_watermarks_off_loop,
                "highwatermark-checkpoint",
            ),
            background.start_every(
                self.config.replica_lag_time_max_ms / 2000,
                self.replica_manager.maybe_shrink_isrs,
                "isr-expiration",
            ),
            background.start_every(
                self.config.producer_id_expiration_check_interval_ms / 1000,
                self.replica_manager.expire_producers,
                "producer-expiration",
            ),
            background.start(self.replica_manager.isr_channel.run(), "alter-isr-channel"),
        ]
        if self.replica_manager.controller.configured:
            self._tasks.append(background.start(self.lifecycle.run(), "broker-lifecycle"))
        await self.host.set_serving()
        log.info(
            "broker %d listening on %s, advertised as %s",
            self.config.broker_id,
            self.address,
            self.advertised,
        )

    def _start_metrics(self) -> None:
        # Imported here: with metrics off the process never loads OpenTelemetry.
        from tidewater.broker.metrics import register_broker_metrics
        from tidewater.telemetry.metrics import MetricsEndpoint

        self.metrics = MetricsEndpoint(
            "tidewater-broker",
            self.config.host,
            self.metrics_port or 0,
            {"tidewater.broker.id": self.config.broker_id},
        )
        self.replica_manager.request_metrics = register_broker_metrics(
            self.metrics, self.replica_manager
        )

    async def controlled_shutdown(self) -> None:
        """Move leadership elsewhere first, so producers see only retriable
        NOT_LEADER_OR_FOLLOWER, never a dead leader."""
        if self.replica_manager.controller.configured:
            await self.lifecycle.controlled_shutdown(
                self.config.controlled_shutdown_timeout_ms / 1000
            )

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Clean shutdown: stop serving, answer waiting requests, flush and checkpoint."""
        await self.host.stop(grace_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.replica_manager.shutdown()
        await self.log_manager.background_flushes_done()
        self.log_manager.shutdown(self._clean_shutdown_epoch())
        if self.metrics is not None:
            self.metrics.close()
        if self.lifecycle.refusal is not None:
            # The process exits with the refusal (status 1), at registration or at a
            # heartbeat: not the clean stop it did not ask for, though a registered broker's
            # flushed logs prove a clean shutdown to the controller.
            log.info(
                "broker %d stopped: the controller refused its configuration",
                self.config.broker_id,
            )
        else:
            log.info("broker %d stopped cleanly", self.config.broker_id)

    def _clean_shutdown_epoch(self) -> int:
        """The broker epoch the clean-shutdown files name: this run's registration's, else
        (never registered: refused, or stopped before) the one the last run's files named,
        so that a refused start does not use up the proof (0: none, no files). Nothing can
        have been appended in a run that never registered: LeaderAndIsr checks the epoch."""
        if self.lifecycle.registered.is_set():
            return self.lifecycle.registered_epoch
        return self.log_manager.clean_shutdown_broker_epoch


async def run_broker(
    config: BrokerConfig, ready_file: Path | None = None, metrics_port: int | None = None
) -> None:
    """Run until SIGTERM or SIGINT, then shut down cleanly; until the controller refuses the
    broker's configuration (a controller older than the ELR in LeaderAndIsr, with a higher
    --min-insync-replicas: at registration, or at a heartbeat), then stop and raise its
    refusal (InvalidConfig)."""
    tune_for_large_messages()
    raise_open_file_limit()
    server = BrokerServer(config, metrics_port)
    await server.start()
    announce(f"broker {config.broker_id}", server.address, ready_file, server.metrics)
    signalled = asyncio.create_task(wait_for_stop_signal())
    refused = asyncio.create_task(server.lifecycle.refused.wait())
    await asyncio.wait([signalled, refused], return_when=asyncio.FIRST_COMPLETED)
    for task in (signalled, refused):
        task.cancel()
    if server.lifecycle.refusal is not None:
        # Never registered, or fenced by the controller: no controlled shutdown, it stops at
        # once. A registered broker's flushed logs prove a clean shutdown, as on SIGTERM.
        await server.stop()
        raise server.lifecycle.refusal
    await server.controlled_shutdown()
    await server.stop()
