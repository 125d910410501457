"""Calls from a broker to the active controller, following NOT_CONTROLLER answers and trying
the configured controllers in turn when one does not answer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from tidewater.errors import ControllerUnavailable
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.telemetry import tracing
from tidewater.v1 import controller_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 10.0


class ControllerClient:
    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = list(addresses)
        self._active = 0
        self._channels: dict[str, grpc.aio.Channel] = {}

    @property
    def configured(self) -> bool:
        return bool(self.addresses)

    def prefer(self, address: str) -> None:
        """Try `address` first from now on (one the cluster named the active controller)."""
        if address not in self.addresses:
            self.addresses.append(address)
        self._active = self.addresses.index(address)

    async def call(
        self,
        method: str,
        request: Any,
        timeout_s: float = RPC_TIMEOUT_S,
        deadline: float | None = None,
        partial: Callable[[Any], bool] = lambda response: False,
    ) -> Any:
        """Send to the active controller; ControllerUnavailable when no controller answers
        as active after trying each known one, or by `deadline` (time.monotonic()); each
        attempt waits at most `timeout_s`. A NOT_CONTROLLER answer for which `partial` holds
        (it carries results of items applied before the controller stepped down) is returned,
        not resent whole: the caller resends what is left, and the next call goes to the
        controller it names."""
        if not self.addresses:
            raise ControllerUnavailable("no controller configured (broker config `controllers`)")
        last_error = "no answer"
        for _ in range(len(self.addresses) + 2):
            attempt_s = timeout_s
            if deadline is not None:
                attempt_s = min(timeout_s, deadline - time.monotonic())
                if attempt_s <= 0:
                    break
            address = self.addresses[self._active]
            try:
                response = await getattr(self._stub(address), method)(request, timeout=attempt_s)
            except grpc.aio.AioRpcError as e:
                last_error = f"{address}: {e.code().name} {e.details()}"
                self._active = (self._active + 1) % len(self.addresses)
                continue
            if response.error_code != ErrorCode.NOT_CONTROLLER:
                return response
            last_error = f"{address}: not the active controller"
            endpoint = response.controller.endpoint
            if response.controller.controller_id >= 0 and endpoint.host:
                self.prefer(f"{endpoint.host}:{endpoint.port}")
            else:
                self._active = (self._active + 1) % len(self.addresses)
            if partial(response):
                return response
        raise ControllerUnavailable(f"{method}: {last_error}")

    def _stub(self, address: str) -> controller_pb2_grpc.ControllerServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = tracing.insecure_channel(address, CHANNEL_OPTIONS)
        return controller_pb2_grpc.ControllerServiceStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
