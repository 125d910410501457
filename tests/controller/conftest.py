"""A real etcd for the controller tests: one server per test module; each test keeps to its own
cluster name, so tests sharing the server never see each other's keys."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from tidewater.controller.store import ControllerStore
from tidewater.local.etcd import EtcdProcess


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    with EtcdProcess(tmp_path_factory.mktemp("etcd") / "data") as process:
        yield process


@pytest.fixture
def cluster_name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def connect_store(
    etcd: EtcdProcess, cluster_name: str
) -> AsyncIterator[Callable[..., Awaitable[ControllerStore]]]:
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
