"""The broker's side of its registration and heartbeats, against a fake controller client."""

from __future__ import annotations

from typing import Any

from tidewater.broker.lifecycle import BrokerLifecycle
from tidewater.rpc.address import HostPort
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode


class FakeController:
    """Answers as a controller that leads nothing to move; records the requests."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.answers: dict[str, Any] = {
            "RegisterBroker": cpb.RegisterBrokerResponse(broker_epoch=7),
            "BrokerHeartbeat": cpb.BrokerHeartbeatResponse(),
            "ControlledShutdown": cpb.ControlledShutdownResponse(),
        }

    async def call(self, method: str, request: Any, **_: Any) -> Any:
        self.requests.append((method, request))
        return self.answers[method]


def lifecycle_of(controller: FakeController) -> BrokerLifecycle:
    return BrokerLifecycle(
        controller,  # type: ignore[arg-type]
        broker_id=2,
        advertised=HostPort("127.0.0.1", 9092),
        rack="",
        heartbeat_interval_ms=500,
    )


async def test_heartbeats_after_a_controlled_shutdown_began_say_so() -> None:
    """Review 20 M2: a controller elected after the broker's ControlledShutdown took its
    heartbeats for a live broker's and unfenced it, just before it stopped."""
    controller = FakeController()
    lifecycle = lifecycle_of(controller)
    await lifecycle._round()
    assert await lifecycle.controlled_shutdown(timeout_s=5)
    await lifecycle._round()
    heartbeats = [r.want_shutdown for m, r in controller.requests if m == "BrokerHeartbeat"]
    assert heartbeats == [False, True]


async def test_a_stale_heartbeat_keeps_the_registered_epoch_for_the_shutdown_proof() -> None:
    """Review 20 L3: a heartbeat answered STALE_BROKER_EPOCH sets the broker epoch to 0 until
    it registers again; a clean shutdown in between wrote 0 as its proof, and the next start
    counted as unclean (it left every ELR)."""
    controller = FakeController()
    lifecycle = lifecycle_of(controller)
    await lifecycle._round()
    controller.answers["BrokerHeartbeat"] = cpb.BrokerHeartbeatResponse(
        error_code=ErrorCode.STALE_BROKER_EPOCH
    )
    await lifecycle._heartbeat()
    assert (lifecycle.broker_epoch, lifecycle.registered_epoch) == (0, 7)
