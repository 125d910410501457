"""The broker's background tasks survive a failing run, and say so when they end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.broker.logged import Logged
from tidewater.broker import background
from tidewater.broker.controller_client import ControllerClient
from tidewater.local.standin_controller import StandinController
from tidewater.local.wait import eventually
from tidewater.replication.partition import AlterIsrProposal, Partition

WAIT_S = 10.0
TOPIC = "upkeep"


async def test_a_periodic_job_runs_on_after_a_failed_run(logged: Logged) -> None:
    runs: list[int] = []

    def job() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise OSError("the disk is full")

    task = asyncio.create_task(background.every(0.001, job, "checkpoint"))
    try:
        await eventually(lambda: len(runs) >= 3, WAIT_S)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert logged(logging.ERROR, "checkpoint", "failed")


async def test_a_task_that_ends_before_the_broker_stops_is_logged_loudly(
    logged: Logged,
) -> None:
    async def broken() -> None:
        raise ValueError("a bug")

    task = background.start(broken(), "isr-channel")
    await eventually(task.done, WAIT_S)
    await eventually(lambda: logged(logging.CRITICAL, "isr-channel", "ended"), WAIT_S)


async def test_a_cancelled_task_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    task = background.start(asyncio.sleep(60), "isr-shrink")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_partition_whose_isr_check_fails_holds_up_no_other_partition(
    standin: tuple[StandinController, str],
    start_broker: Callable[..., Awaitable[Any]],
    monkeypatch: pytest.MonkeyPatch,
    logged: Logged,
) -> None:
    controller, address = standin
    check = Partition.maybe_shrink_isr

    def failing_for_partition_0(partition: Partition, now_ms: int) -> AlterIsrProposal | None:
        if partition.partition == 0:
            raise RuntimeError("a bug in one partition's ISR check")
        return check(partition, now_ms)

    monkeypatch.setattr(Partition, "maybe_shrink_isr", failing_for_partition_0)
    server, _ = await start_broker(1, controllers=address, **{"replica.lag.time.max.ms": 200})
    controller.brokers[1] = server.address
    # Broker 2 never starts: it falls out of every ISR after the lag time.
    for partition in (0, 1):
        await controller.elect(TOPIC, partition, leader=1, replicas=[1, 2])
    await eventually(lambda: (TOPIC, 1, [1]) in controller.isr_changes, WAIT_S)
    # Every check fails for partition 0, logged each time; the others' go on.
    await controller.elect(TOPIC, 2, leader=1, replicas=[1, 2])
    await eventually(lambda: (TOPIC, 2, [1]) in controller.isr_changes, WAIT_S)
    assert logged(logging.ERROR, f"{TOPIC}-0")
    assert controller.states[TOPIC, 0].isr == [1, 2]


async def test_the_heartbeats_go_on_after_one_fails_unexpectedly(
    standin: tuple[StandinController, str],
    start_broker: Callable[..., Awaitable[Any]],
    monkeypatch: pytest.MonkeyPatch,
    logged: Logged,
) -> None:
    controller, address = standin
    call = ControllerClient.call
    failed: list[str] = []

    async def failing_once(client: ControllerClient, method: str, *args: Any, **kw: Any) -> Any:
        # Once the broker is registered and heartbeating: an error no one planned for.
        if method == "BrokerHeartbeat" and controller.heartbeats and not failed:
            failed.append(method)
            raise RuntimeError("an answer nobody expected")
        return await call(client, method, *args, **kw)

    monkeypatch.setattr(ControllerClient, "call", failing_once)
    server, _ = await start_broker(1, controllers=address, **{"broker.heartbeat.interval.ms": 20})
    await eventually(lambda: failed, WAIT_S)
    after_failure = controller.heartbeats
    await eventually(lambda: controller.heartbeats >= after_failure + 5, WAIT_S)
    assert not server.lifecycle.fenced
    assert logged(logging.ERROR, "broker-heartbeat", "failed")
