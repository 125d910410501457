"""A controller in the test's process, on the module's etcd: what an earlier controller left
there (`seed`), and the types of the `connect_store` and `run_controller` fixtures
(conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tidewater.controller.controller import Controller
from tidewater.controller.model import PartitionRecord, TopicState
from tidewater.controller.service import ControllerService
from tidewater.controller.store import ControllerStore
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

ConnectStore = Callable[..., Awaitable[ControllerStore]]
RunController = Callable[..., Awaitable[tuple[Controller, "asyncio.Task[None]"]]]
IN_PROCESS_LEASE_TTL_S = 3
# Also the grace period after election: a seeded broker that never heartbeats is fenced then.
IN_PROCESS_SESSION_TIMEOUT_MS = 300


async def seed(
    connect_store: ConnectStore,
    brokers: tuple[int, ...] = (1,),
    replicas: tuple[int, ...] = (1,),
    record: PartitionRecord | None = None,
) -> int:
    """What an earlier controller left in etcd: `brokers` registered, topic t with partition 0
    on `replicas` (`record`: its LeaderAndIsr, else led by broker 1 alone). Returns that
    controller's epoch."""
    store = await connect_store()
    epoch = await store.campaign(9, "127.0.0.1:9", IN_PROCESS_LEASE_TTL_S)
    for broker_id in brokers:
        registration = {
            "broker_id": broker_id,
            "host": "127.0.0.1",
            "port": 9,
            "rack": "",
            "incarnation_id": "a",
        }
        await store.put_broker(epoch, broker_id, registration)
    await store.put_topic(epoch, "t", TopicState("t", {}, {0: replicas}).to_json())
    record = record or PartitionRecord(1, 0, (1,), epoch)
    await store.write_partitions(epoch, [("t", 0, None, record.to_json())])
    await store.resign()
    return epoch


async def heartbeat(
    controller: Controller, broker_id: int, want_shutdown: bool = False
) -> cpb.BrokerHeartbeatResponse:
    """A heartbeat of the broker's registered incarnation, straight to a ControllerService."""
    request = cpb.BrokerHeartbeatRequest(
        broker_id=broker_id,
        broker_epoch=controller.model.brokers[broker_id].epoch,
        want_shutdown=want_shutdown,
    )
    response = await ControllerService(controller).BrokerHeartbeat(request, None)  # type: ignore[arg-type]
    assert response.error_code == ErrorCode.NONE, response.error_message
    return response
