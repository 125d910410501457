"""Fixtures of the client tests: a real cluster (tests/client/cluster.py) of three brokers,
in-process or, for fault tests, child processes; producers whose sender the test drives by
hand."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tests.client.cluster import Cluster
from tidewater.broker.server import BrokerServer
from tidewater.client import producer as producer_mod
from tidewater.client.accumulator import ProducerBatch, RecordAccumulator
from tidewater.client.partitioner import StickyPartitioner
from tidewater.local.process import ManagedProcess
from tidewater.local.standin_controller import StandinController
from tidewater.metadata.server import MetadataServer

# The leader a hand-driven producer sends to: (broker id, address, leader epoch).
OLD_LEADER = (1, "old-leader:1", 5)

# Child-process brokers: quick replication, and retention checked often.
PROCESS_SETTINGS = {
    "replica.lag.time.max.ms": "2000",
    "replica.fetch.backoff.ms": "50",
    "replica.fetch.wait.max.ms": "200",
    "log.retention.check.interval.ms": "100",
}


@pytest.fixture
async def cluster(start_broker: Callable[..., Awaitable[Any]]) -> AsyncIterator[Cluster]:
    controller = StandinController(brokers={})
    address = await controller.start()
    brokers: dict[int, BrokerServer] = {}
    for broker_id in (1, 2, 3):
        server, _ = await start_broker(
            broker_id,
            controllers=address,
            **{"replica.lag.time.max.ms": 1000, "replica.fetch.backoff.ms": 50},
        )
        brokers[broker_id] = server
        controller.brokers[broker_id] = server.address
    meta = MetadataServer("127.0.0.1:0")
    await meta.start()
    cluster = Cluster(controller, brokers, meta)
    await cluster.publish()
    yield cluster
    await meta.stop(0)
    await controller.stop()


@pytest.fixture
def process_settings() -> dict[str, str]:
    """The process brokers' settings; a test parametrizes it to change them."""
    return PROCESS_SETTINGS


@pytest.fixture
async def process_cluster(
    broker_processes: Callable[..., ManagedProcess], process_settings: dict[str, str]
) -> AsyncIterator[Cluster]:
    """The same cluster with broker processes (killed at teardown by broker_processes)."""
    controller = StandinController(brokers={})
    address = await controller.start()
    meta = MetadataServer("127.0.0.1:0")
    await meta.start()
    try:
        procs = {
            broker_id: broker_processes(broker_id, controllers=address, **process_settings)
            for broker_id in (1, 2, 3)
        }
        addresses = await asyncio.gather(
            *(asyncio.to_thread(proc.start) for proc in procs.values())
        )
        controller.brokers.update(zip(procs, addresses, strict=True))
        cluster = Cluster(controller, procs, meta)
        await cluster.publish()
        yield cluster
    finally:
        await meta.stop(0)
        await controller.stop()


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[ProducerBatch]:
    """The batches producers send, through a fake link that never answers: the test does."""
    batches: list[ProducerBatch] = []

    class FakeLink:
        full = False

        def __init__(self, producer: Any, address: str) -> None:
            pass

        def send(self, sending: list[ProducerBatch]) -> None:
            batches.extend(sending)

        async def close(self) -> None:
            pass

    monkeypatch.setattr(producer_mod, "_BrokerLink", FakeLink)
    return batches


@pytest.fixture
def hand_driven_producer(sent: list[ProducerBatch]) -> Callable[..., producer_mod.Producer]:
    """Producers whose sender is driven by hand (_drain, _completed, settle) against the fake
    link, with producer id 4242 epoch 0, one record a batch, and OLD_LEADER leading."""

    def make(**config: Any) -> producer_mod.Producer:
        producer = producer_mod.Producer(["127.0.0.1:1"], batch_size=1, linger_ms=0, **config)
        producer._accumulator = RecordAccumulator(1, asyncio.get_running_loop())
        producer._partitioner = StickyPartitioner(lambda *a: 0, lambda *a: True)
        producer._sequences.set_producer_id(4242, 0)
        producer.metadata.leader = lambda tp: OLD_LEADER  # type: ignore[method-assign]
        producer.metadata.request_refresh = lambda: None  # type: ignore[method-assign]
        return producer

    return make
