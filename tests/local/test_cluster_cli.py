"""`tidewater cluster up --detach | status | down`, run as a user would, with a round trip
through the SDK in between, and a restart on the same data dir keeping the data."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tidewater.broker.controller_client import ControllerClient
from tidewater.client.consumer import Consumer
from tidewater.client.producer import Producer
from tidewater.local.scrape import scrape
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

pytestmark = pytest.mark.timeout(300)
COMMAND_TIMEOUT_S = 180
TOPIC = "events"


def tidewater(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tidewater", *args],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def recorded_pids(data_dir: Path) -> set[int]:
    """Every pid the cluster file has named (the supervisor's too)."""
    try:
        document = json.loads((data_dir / "cluster.json").read_text())
    except FileNotFoundError:
        return set()
    return {document["supervisor_pid"], *(p["pid"] for p in document["processes"])}


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """The cluster's data dir; whatever it runs is killed at teardown, even after a failure."""
    data_dir = tmp_path / "cluster"
    yield data_dir
    for pid in recorded_pids(data_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def status(data_dir: Path) -> list[dict[str, Any]]:
    result = tidewater("cluster", "status", "--data-dir", str(data_dir), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)["processes"]


def up(data_dir: Path) -> list[dict[str, Any]]:
    result = tidewater("cluster", "up", "--detach", "--data-dir", str(data_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    processes = status(data_dir)
    for process in processes:
        assert process["address"] in result.stdout
        assert f"127.0.0.1:{process['metrics_port']}" in result.stdout
    metadata = [p["address"] for p in processes if p["role"] == "metadata"]
    assert f"Bootstrap (metadata service): {metadata[0]}" in result.stdout
    return processes


def down(data_dir: Path, pids: set[int]) -> None:
    result = tidewater("cluster", "down", "--data-dir", str(data_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (data_dir / "cluster.json").exists()
    # `down` waits for each process; the children are reaped by the supervisor as it exits.
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {pid for pid in pids if alive(pid)}


async def create_topic(controllers: list[str]) -> None:
    client = ControllerClient(controllers)
    try:
        response = await client.call(
            "CreateTopics",
            cpb.CreateTopicsRequest(
                topics=[cpb.CreatableTopic(name=TOPIC, num_partitions=2, replication_factor=3)]
            ),
        )
    finally:
        await client.close()
    assert response.topics[0].error_code == ErrorCode.NONE, response.topics[0].error_message


async def produce(bootstrap: list[str], values: list[bytes]) -> None:
    async with Producer(bootstrap, delivery_timeout_ms=60000) as producer:
        futures = [await producer.send(TOPIC, value, partition=0) for value in values]
        await asyncio.wait_for(producer.flush(), 60)
        offsets = [(await future).offset for future in futures]
    assert offsets == sorted(offsets)


async def consume(bootstrap: list[str], count: int) -> list[bytes]:
    async with Consumer(bootstrap, auto_offset_reset="earliest") as consumer:
        consumer.assign([(TOPIC, 0)])
        values: list[bytes] = []

        async def read() -> None:
            while len(values) < count:
                values.extend(r.value or b"" for r in await consumer.poll(500))

        await asyncio.wait_for(read(), 60)
    return values


def addresses(processes: list[dict[str, Any]], role: str) -> list[str]:
    return [p["address"] for p in processes if p["role"] == role]


async def check_metrics(processes: list[dict[str, Any]]) -> None:
    """Every process serves Prometheus metrics on the port `status` shows."""
    scrapes = {(p["role"], p["id"]): await scrape(p["metrics_port"]) for p in processes}
    assert scrapes["etcd", 1]("etcd_server_has_leader") == 1
    assert scrapes["metadata", 1]("tidewater_metadata_ready") == 1
    assert scrapes["metadata", 1]("tidewater_metadata_live_brokers") == 3
    active = [
        scrapes["controller", c]("tidewater_controller_active_controller_count") for c in (1, 2)
    ]
    assert sorted(active) == [0, 1]
    produces = [
        scrapes["broker", b]("tidewater_request_requests_total", request="Produce")
        for b in (1, 2, 3)
    ]
    assert sum(produces) >= 1


async def test_up_round_trip_down_and_restart_keeps_the_data(data_dir: Path) -> None:
    processes = await asyncio.to_thread(up, data_dir)
    roles = sorted((p["role"], p["id"]) for p in processes)
    assert roles == [
        ("broker", 1),
        ("broker", 2),
        ("broker", 3),
        ("controller", 1),
        ("controller", 2),
        ("etcd", 1),
        ("metadata", 1),
    ]
    assert {p["health"] for p in processes} == {"SERVING"}
    bootstrap = addresses(processes, "metadata")

    await create_topic(addresses(processes, "controller"))
    values = [f"record-{i}".encode() for i in range(20)]
    await produce(bootstrap, values)
    assert await consume(bootstrap, len(values)) == values
    await check_metrics(processes)

    first_pids = recorded_pids(data_dir)
    await asyncio.to_thread(down, data_dir, first_pids)

    # The same data dir brings the same cluster back: the topic and its records are there.
    processes = await asyncio.to_thread(up, data_dir)
    assert {p["health"] for p in processes} == {"SERVING"}
    more = [b"after-restart"]
    bootstrap = addresses(processes, "metadata")
    await produce(bootstrap, more)
    assert await consume(bootstrap, len(values) + 1) == values + more
    await asyncio.to_thread(down, data_dir, recorded_pids(data_dir))


def test_status_and_down_without_a_cluster(tmp_path: Path) -> None:
    result = tidewater("cluster", "status", "--data-dir", str(tmp_path))
    assert result.returncode == 1
    assert "no cluster recorded" in result.stderr
    result = tidewater("cluster", "down", "--data-dir", str(tmp_path))
    assert result.returncode == 0
    assert "no cluster recorded" in result.stdout
