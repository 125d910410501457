"""The broker's registration with the controller and its heartbeats.

Registration gives the broker its epoch; a restarted broker (a new incarnation) gets a newer
one, so requests meant for its previous life are refused. Heartbeats every
broker.heartbeat.interval.ms keep it unfenced; a broker the controller no longer knows (or
knows under a newer epoch) registers again. A round that fails, however it fails, is logged and
the next one comes an interval later, as Kafka's BrokerLifecycleManager goes on: a broker whose
heartbeats stopped would look alive yet stay fenced for good.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from tidewater.broker import background
from tidewater.broker.controller_client import ControllerClient
from tidewater.errors import ControllerUnavailable, InvalidConfig
from tidewater.rpc.address import HostPort
from tidewater.v1 import common_pb2
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

log = logging.getLogger(__name__)

REREGISTER = {ErrorCode.STALE_BROKER_EPOCH, ErrorCode.BROKER_NOT_AVAILABLE}
CONTROLLED_SHUTDOWN_RETRY_S = 0.5


class BrokerLifecycle:
    def __init__(
        self,
        controller: ControllerClient,
        broker_id: int,
        advertised: HostPort,
        rack: str,
        heartbeat_interval_ms: int,
        previous_broker_epoch: int = 0,
        min_insync_replicas: int = 1,
    ) -> None:
        """`min_insync_replicas`: the broker's default, reported at registration: a controller
        older than the ELR in LeaderAndIsr refuses it below its own (`refusal`)."""
        self._controller = controller
        self._info = common_pb2.BrokerInfo(
            broker_id=broker_id,
            endpoint=common_pb2.Endpoint(host=advertised.host, port=advertised.port),
            rack=rack,
        )
        self._incarnation_id = uuid.uuid4().hex
        # The epoch the previous run shut down cleanly in, else 0 (KIP-966): without it the
        # controller takes this start for one after a crash.
        self._previous_broker_epoch = previous_broker_epoch
        self._min_insync_replicas = min_insync_replicas
        self._interval_s = heartbeat_interval_ms / 1000
        self.broker_epoch = 0
        # The last registration's epoch, kept while registering again (broker_epoch is 0
        # then): what a clean shutdown's proof names (review 20 L3).
        self.registered_epoch = 0
        self.fenced = True
        # Once a controlled shutdown began: every heartbeat says so (want_shutdown), so a
        # controller elected since does not take this broker for a live one.
        self.shutting_down = False
        self.registered = asyncio.Event()
        # Set once the controller refused this broker's configuration (not retriable): the
        # broker stops with it (run_broker).
        self.refusal: InvalidConfig | None = None
        self.refused = asyncio.Event()
        # When the controller stopped answering, while it does not.
        self._unavailable_since: float | None = None

    async def run(self) -> None:
        await background.every(self._interval_s, self._round, "broker-heartbeat", at_once=True)

    async def _round(self) -> None:
        if self.refused.is_set():
            return
        try:
            if not self.broker_epoch:
                await self._register()
            await self._heartbeat()
        except ControllerUnavailable as e:
            # Once per outage at WARNING, as the controller logs etcd's (review 27 L5: two
            # INFO lines a second for as long as it lasted).
            if self._unavailable_since is None:
                self._unavailable_since = time.monotonic()
                # Its message names each address's gRPC error (review 37 #6: the code's name,
                # NOT_CONTROLLER, read as if a standby had answered).
                log.warning("controller unavailable: %s", e.message)
            else:
                log.debug("controller unavailable: %s", e.message)
            return
        if self._unavailable_since is not None:
            down_s = time.monotonic() - self._unavailable_since
            self._unavailable_since = None
            log.warning("controller answers again (after %.1f s)", down_s)

    async def _register(self) -> None:
        response = await self._controller.call(
            "RegisterBroker",
            cpb.RegisterBrokerRequest(
                broker=self._info,
                incarnation_id=self._incarnation_id,
                previous_broker_epoch=self._previous_broker_epoch,
                min_insync_replicas=self._min_insync_replicas,
            ),
        )
        if response.error_code == ErrorCode.INVALID_CONFIG:
            self._refuse("registration", response.error_message)
            return
        if response.error_code != ErrorCode.NONE:
            log.warning("registration refused: %s", response.error_message)
            return
        self.broker_epoch = self.registered_epoch = response.broker_epoch
        self.registered.set()
        log.info("registered with the controller: broker epoch %d", self.broker_epoch)

    async def _heartbeat(self) -> None:
        if not self.broker_epoch:
            return
        response = await self._controller.call(
            "BrokerHeartbeat",
            cpb.BrokerHeartbeatRequest(
                broker_id=self._info.broker_id,
                broker_epoch=self.broker_epoch,
                want_shutdown=self.shutting_down,
            ),
            # A heartbeat stuck on a paused controller must not outlast the session: give up
            # soon and try the next controller.
            timeout_s=max(4 * self._interval_s, 1.0),
        )
        if response.error_code in REREGISTER:
            log.warning("controller does not know this broker's epoch; registering again")
            self.broker_epoch = 0
            return
        if response.error_code == ErrorCode.INVALID_CONFIG:
            # An older controller started (or taken over) with a higher --min-insync-replicas
            # than this broker registered with: it keeps the broker fenced.
            self._refuse("heartbeat", response.error_message)
            return
        if response.error_code == ErrorCode.NONE:
            if self.fenced != response.is_fenced:
                log.info("broker is %s", "fenced" if response.is_fenced else "unfenced")
            self.fenced = response.is_fenced

    def _refuse(self, request: str, message: str) -> None:
        log.critical("%s refused: %s", request, message)
        self.refusal = InvalidConfig(message)
        self.refused.set()

    async def controlled_shutdown(self, timeout_s: float) -> bool:
        """Ask the controller to move leadership off this broker before it stops (Kafka's
        controlled shutdown); True once it leads nothing. Bounded by timeout_s."""
        if not self.broker_epoch:
            return False
        self.shutting_down = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            try:
                response = await self._controller.call(
                    "ControlledShutdown",
                    cpb.ControlledShutdownRequest(
                        broker_id=self._info.broker_id, broker_epoch=self.broker_epoch
                    ),
                )
            except ControllerUnavailable as e:
                log.warning("controlled shutdown: controller unavailable: %s", e.message)
            else:
                if response.error_code == ErrorCode.NONE and not response.remaining_partitions:
                    log.info("controlled shutdown: leadership moved off this broker")
                    return True
                log.info(
                    "controlled shutdown: still leading %d partitions",
                    len(response.remaining_partitions),
                )
            await asyncio.sleep(CONTROLLED_SHUTDOWN_RETRY_S)
        log.warning("controlled shutdown incomplete after %.0f s; stopping anyway", timeout_s)
        return False
