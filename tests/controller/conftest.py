"""Fixtures of the controller tests: a real etcd, one server per test module; each test keeps
to its own cluster name, so tests sharing the server never see each other's keys.

`cluster` (and `make_cluster`, for other settings) runs a real cluster on loopback
(tests/controller/cluster.py); `connect_store` and `run_controller` put a controller in the
test's process (tests/controller/in_process.py)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.controller.cluster import Cluster, Eventually
from tests.controller.in_process import (
    IN_PROCESS_LEASE_TTL_S,
    IN_PROCESS_SESSION_TIMEOUT_MS,
    ConnectStore,
    RunController,
)
from tidewater.controller.controller import Controller, ControllerConfig
from tidewater.controller.server import monotonic_ms
from tidewater.controller.store import ControllerStore
from tidewater.local.etcd import EtcdProcess
from tidewater.local.wait import eventually


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    with EtcdProcess(tmp_path_factory.mktemp("etcd") / "data") as process:
        yield process


@pytest.fixture
def cluster_name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def connect_store(etcd: EtcdProcess, cluster_name: str) -> AsyncIterator[ConnectStore]:
    """Connect stores to this test's cluster (through `endpoint` if given); all are closed
    (and resign) at teardown."""
    stores: list[ControllerStore] = []

    async def connect(endpoint: str | None = None, **options: float) -> ControllerStore:
        store = await ControllerStore.connect([endpoint or etcd.endpoint], cluster_name, **options)
        stores.append(store)
        return store

    yield connect
    for store in stores:
        await store.close()


@pytest.fixture
async def run_controller() -> AsyncIterator[RunController]:
    """Run a controller (campaigning at once) on a store: the controller, once it is active, and
    the task that runs it, stopped at teardown."""
    running: list[tuple[Controller, asyncio.Task[None]]] = []

    async def run(
        store: ControllerStore,
        session_timeout_ms: int = IN_PROCESS_SESSION_TIMEOUT_MS,
        port: int = 1,
        min_insync_replicas: int = 1,
        metadata_addresses: Sequence[str] = (),
        default_replication_factor: int | None = None,
    ) -> tuple[Controller, asyncio.Task[None]]:
        controller = Controller(
            ControllerConfig(
                controller_id=1,
                host="127.0.0.1",
                port=port,
                lease_ttl_s=IN_PROCESS_LEASE_TTL_S,
                broker_session_timeout_ms=session_timeout_ms,
                session_check_interval_ms=50,
                min_insync_replicas=min_insync_replicas,
                metadata_addresses=tuple(metadata_addresses),
                default_replication_factor=default_replication_factor,
            ),
            store,
            monotonic_ms,
        )
        running.append((controller, asyncio.create_task(controller.run())))
        await eventually(lambda: controller.active, 10)
        return running[-1]

    yield run
    for controller, task in running:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        controller.sender.reset()


@pytest.fixture
async def make_cluster(
    etcd: EtcdProcess, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    """Start clusters (`Cluster`'s options, by name); every process and proxy is stopped at
    teardown, even when the test or the start fails."""
    clusters: list[Cluster] = []

    async def make(**options: Any) -> Cluster:
        cluster = Cluster(tmp_path, etcd, **options)
        clusters.append(cluster)
        await cluster.start()
        return cluster

    yield make
    for cluster in clusters:
        await cluster.close()


@pytest.fixture
async def cluster(make_cluster: Callable[..., Awaitable[Cluster]]) -> Cluster:
    """Two controllers and three brokers (ids 1, 2, 3), all alive."""
    return await make_cluster()


@pytest.fixture(name="eventually")
def eventually_fixture() -> Eventually:
    return eventually
