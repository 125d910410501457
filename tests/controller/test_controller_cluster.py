"""A real cluster: etcd, two controller processes, three broker processes, on loopback."""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tidewater.broker.controller_client import ControllerClient
from tidewater.controller.store import ControllerStore
from tidewater.local.etcd import EtcdProcess
from tidewater.local.process import ManagedProcess, broker_args, controller_args
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

LEASE_TTL_S = 2
SESSION_TIMEOUT_MS = 1500
BROKER_SETTINGS = {
    "broker.heartbeat.interval.ms": "200",
    "replica.lag.time.max.ms": "1500",
    "replica.fetch.backoff.ms": "100",
    "replica.fetch.wait.max.ms": "200",
}


async def eventually(condition: Callable[[], Any], timeout_s: float) -> None:
    async def poll() -> None:
        while not (await result if inspect.isawaitable(result := condition()) else result):
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), timeout_s)


class Cluster:
    def __init__(self, root: Path, etcd: EtcdProcess) -> None:
        self.root = root
        self.etcd = etcd
        self.name = f"test-{uuid.uuid4().hex[:8]}"
        self.controllers: dict[int, ManagedProcess] = {}
        self.brokers: dict[int, ManagedProcess] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.store: ControllerStore | None = None
        self.admin: ControllerClient | None = None

    def start_controller(self, controller_id: int) -> str:
        proc = ManagedProcess(
            f"controller-{controller_id}",
            controller_args(
                controller_id,
                self.etcd.endpoint,
                self.name,
                "127.0.0.1:0",
                LEASE_TTL_S,
                SESSION_TIMEOUT_MS,
            ),
            self.root,
        )
        self.controllers[controller_id] = proc
        return proc.start()

    def start_broker(self, broker_id: int, listen: str = "127.0.0.1:0") -> str:
        addresses = ",".join(p.address for p in self.controllers.values())
        proc = ManagedProcess(
            f"broker-{broker_id}",
            broker_args(
                broker_id,
                self.root / f"broker-{broker_id}",
                listen,
                {"controllers": addresses, **BROKER_SETTINGS},
            ),
            self.root,
        )
        self.brokers[broker_id] = proc
        return proc.start()

    def broker_stub(self, broker_id: int) -> broker_pb2_grpc.BrokerServiceStub:
        address = self.brokers[broker_id].address
        if address not in self.channels:
            self.channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return broker_pb2_grpc.BrokerServiceStub(self.channels[address])

    async def partitions(self, topic: str) -> dict[int, dict[str, Any]]:
        assert self.store is not None
        found = await self.store.load_partitions()
        return {p: value for (t, p), (value, _) in found.items() if t == topic}

    async def alive_brokers(self) -> set[int]:
        assert self.admin is not None
        response = await self.admin.call("DescribeCluster", cpb.DescribeClusterRequest())
        return {b.broker.broker_id for b in response.brokers if b.status == cpb.BROKER_STATUS_ALIVE}

    def kill_all(self) -> None:
        for proc in [*self.brokers.values(), *self.controllers.values()]:
            proc.kill()


@pytest.fixture
async def cluster(etcd: EtcdProcess, tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path, etcd)
    try:
        for controller_id in (1, 2):
            cluster.start_controller(controller_id)
        cluster.store = await ControllerStore.connect([etcd.endpoint], cluster.name)
        cluster.admin = ControllerClient([p.address for p in cluster.controllers.values()])
        for broker_id in (1, 2, 3):
            cluster.start_broker(broker_id)
        await eventually(lambda: _eq(cluster.alive_brokers(), {1, 2, 3}), 30)
        yield cluster
    finally:
        cluster.kill_all()
        if cluster.admin is not None:
            await cluster.admin.close()
        for channel in cluster.channels.values():
            await channel.close()
        if cluster.store is not None:
            await cluster.store.close()


async def _eq(value: Any, expected: Any) -> bool:
    try:
        return await value == expected
    except Exception:
        return False


async def create_topic(
    cluster: Cluster, name: str, partitions: int, rf: int, **configs: str
) -> None:
    assert cluster.admin is not None
    response = await cluster.admin.call(
        "CreateTopics",
        cpb.CreateTopicsRequest(
            topics=[
                cpb.CreatableTopic(
                    name=name, num_partitions=partitions, replication_factor=rf, configs=configs
                )
            ]
        ),
    )
    result = response.topics[0]
    assert result.error_code == ErrorCode.NONE, result.error_message


async def produce(cluster: Cluster, topic: str, partition: int, value: bytes) -> int | None:
    """acks=all to the partition's leader per etcd; the offset, or None if not acknowledged."""
    leader = (await cluster.partitions(topic))[partition]["leader"]
    if leader not in cluster.brokers:
        return None
    try:
        response = await cluster.broker_stub(leader).Produce(
            pb.ProduceRequest(
                acks=-1,
                timeout_ms=5000,
                partitions=[
                    pb.PartitionProduceData(
                        topic=topic,
                        partition=partition,
                        record_batch=build_batch([Record(value=value)]),
                    )
                ],
            ),
            timeout=8,
        )
    except grpc.aio.AioRpcError:
        return None
    result = response.partitions[0]
    return result.base_offset if result.error_code == ErrorCode.NONE else None


async def test_create_topic_then_produce_and_consume(cluster: Cluster) -> None:
    await create_topic(cluster, "orders", 3, 3, **{"min.insync.replicas": "2"})
    states = await cluster.partitions("orders")
    assert sorted(states) == [0, 1, 2]
    assert {s["leader"] for s in states.values()} == {1, 2, 3}  # leaders spread
    await eventually(lambda: _produced(cluster, "orders", 0, b"first"), 20)


async def _produced(cluster: Cluster, topic: str, partition: int, value: bytes) -> bool:
    return await produce(cluster, topic, partition, value) is not None


async def test_kill_9_of_a_leading_broker_moves_leadership_and_loses_nothing(
    cluster: Cluster,
) -> None:
    await create_topic(cluster, "payments", 3, 3, **{"min.insync.replicas": "2"})
    await eventually(lambda: _produced(cluster, "payments", 0, b"warm-up"), 20)
    acked = {}
    for i in range(30):
        value = f"before-{i}".encode()
        offset = await produce(cluster, "payments", 0, value)
        assert offset is not None
        acked[value] = offset
    victim = (await cluster.partitions("payments"))[0]["leader"]
    led = {p for p, s in (await cluster.partitions("payments")).items() if s["leader"] == victim}
    cluster.brokers[victim].kill()

    async def moved() -> bool:
        states = await cluster.partitions("payments")
        return all(states[p]["leader"] not in (victim, -1) for p in led)

    await eventually(moved, SESSION_TIMEOUT_MS / 1000 + 1 + 1)
    for p, state in (await cluster.partitions("payments")).items():
        assert victim not in state["isr"], (p, state)
    del cluster.brokers[victim]
    for i in range(30):
        value = f"after-{i}".encode()
        offset = None
        for _ in range(50):
            offset = await produce(cluster, "payments", 0, value)
            if offset is not None:
                break
            await asyncio.sleep(0.1)
        assert offset is not None
        acked[value] = offset
    leader = (await cluster.partitions("payments"))[0]["leader"]
    response = await cluster.broker_stub(leader).Fetch(
        pb.FetchRequest(
            replica_id=-1,
            max_bytes=1 << 22,
            partitions=[
                pb.FetchPartition(
                    topic="payments",
                    partition=0,
                    fetch_offset=0,
                    current_leader_epoch=-1,
                    last_fetched_epoch=-1,
                    log_start_offset=-1,
                )
            ],
        )
    )
    seen = {r.value: r.offset for r in decode_batches(response.partitions[0].record_batches)}
    for value, offset in acked.items():
        assert seen.get(value) == offset


async def test_kill_9_of_the_active_controller_fails_over(cluster: Cluster) -> None:
    assert cluster.store is not None
    active = await cluster.store.active_controller()
    assert active is not None
    old_id, _, old_epoch = active
    cluster.controllers[old_id].kill()

    async def new_controller() -> bool:
        now = await cluster.store.active_controller()  # type: ignore[union-attr]
        return now is not None and now[0] != old_id

    await eventually(new_controller, LEASE_TTL_S + 1 + 1)
    new_id, _, new_epoch = await cluster.store.active_controller()  # type: ignore[misc]
    assert new_id != old_id
    assert new_epoch > old_epoch
    # The new controller runs the cluster once the brokers heartbeat to it: a topic, then a
    # broker failure, both handled.
    await eventually(lambda: _eq(cluster.alive_brokers(), {1, 2, 3}), 10)
    await create_topic(cluster, "after-failover", 1, 3)
    await eventually(lambda: _produced(cluster, "after-failover", 0, b"x"), 20)
    victim = (await cluster.partitions("after-failover"))[0]["leader"]
    cluster.brokers[victim].kill()

    async def moved() -> bool:
        return (await cluster.partitions("after-failover"))[0]["leader"] not in (victim, -1)

    await eventually(moved, SESSION_TIMEOUT_MS / 1000 + 2)


async def test_sigterm_moves_leadership_first_and_loses_nothing(cluster: Cluster) -> None:
    await create_topic(cluster, "orderly", 1, 3, **{"min.insync.replicas": "2"})
    await eventually(lambda: _produced(cluster, "orderly", 0, b"warm-up"), 20)
    leader = (await cluster.partitions("orderly"))[0]["leader"]
    errors: list[int] = []
    acked: dict[bytes, int] = {}
    stop = asyncio.Event()

    async def producer() -> None:
        for i in range(2000):
            if stop.is_set():
                return
            current = (await cluster.partitions("orderly"))[0]["leader"]
            if current not in cluster.brokers or not cluster.brokers[current].running:
                await asyncio.sleep(0.02)
                continue
            try:
                response = await cluster.broker_stub(current).Produce(
                    pb.ProduceRequest(
                        acks=-1,
                        timeout_ms=5000,
                        partitions=[
                            pb.PartitionProduceData(
                                topic="orderly",
                                partition=0,
                                record_batch=build_batch([Record(value=f"r{i}".encode())]),
                            )
                        ],
                    ),
                    timeout=8,
                )
            except grpc.aio.AioRpcError:
                continue
            result = response.partitions[0]
            if result.error_code == ErrorCode.NONE:
                acked[f"r{i}".encode()] = result.base_offset
            else:
                errors.append(result.error_code)

    task = asyncio.create_task(producer())
    await eventually(lambda: len(acked) >= 20, 20)
    assert cluster.brokers[leader].stop() == 0  # SIGTERM: controlled shutdown, then exit
    await eventually(lambda: len(acked) >= 60, 30)
    stop.set()
    await asyncio.wait_for(task, 30)
    assert set(errors) <= {ErrorCode.NOT_LEADER_OR_FOLLOWER}, [ErrorCode.Name(e) for e in errors]
    assert "leadership moved off this broker" in cluster.brokers[leader].log_tail(200)
    new_leader = (await cluster.partitions("orderly"))[0]["leader"]
    assert new_leader not in (leader, -1)
    response = await cluster.broker_stub(new_leader).Fetch(
        pb.FetchRequest(
            replica_id=-1,
            max_bytes=1 << 22,
            partitions=[
                pb.FetchPartition(
                    topic="orderly",
                    partition=0,
                    fetch_offset=0,
                    current_leader_epoch=-1,
                    last_fetched_epoch=-1,
                    log_start_offset=-1,
                )
            ],
        )
    )
    seen = {r.value: r.offset for r in decode_batches(response.partitions[0].record_batches)}
    for value, offset in acked.items():
        assert seen.get(value) == offset


async def test_reassignment_under_load_moves_every_acknowledged_record(cluster: Cluster) -> None:
    assert cluster.admin is not None
    cluster.start_broker(4)
    await eventually(lambda: _eq(cluster.alive_brokers(), {1, 2, 3, 4}), 20)
    response = await cluster.admin.call(
        "CreateTopics",
        cpb.CreateTopicsRequest(
            topics=[
                cpb.CreatableTopic(
                    name="moving",
                    configs={"min.insync.replicas": "2"},
                    assignments=[cpb.CreatableReplicaAssignment(partition=0, broker_ids=[1, 2, 3])],
                )
            ]
        ),
    )
    assert response.topics[0].error_code == ErrorCode.NONE, response.topics[0].error_message
    await eventually(lambda: _produced(cluster, "moving", 0, b"warm-up"), 20)
    acked: dict[bytes, int] = {}
    stop = asyncio.Event()

    async def producer() -> None:
        for i in range(3000):
            if stop.is_set():
                return
            value = f"m{i}".encode()
            offset = await produce(cluster, "moving", 0, value)
            if offset is not None:
                acked[value] = offset

    task = asyncio.create_task(producer())
    await eventually(lambda: len(acked) >= 20, 20)
    response = await cluster.admin.call(
        "AlterPartitionReassignments",
        cpb.AlterPartitionReassignmentsRequest(
            partitions=[cpb.ReassignablePartition(topic="moving", partition=0, replicas=[2, 3, 4])]
        ),
    )
    assert response.partitions[0].error_code == ErrorCode.NONE, response.partitions[0]

    async def done() -> bool:
        listed = await cluster.admin.call(  # type: ignore[union-attr]
            "ListPartitionReassignments", cpb.ListPartitionReassignmentsRequest()
        )
        state = (await cluster.partitions("moving"))[0]
        return not listed.reassignments and sorted(state["isr"]) == [2, 3, 4]

    await eventually(done, 30)
    count = len(acked)
    await eventually(lambda: len(acked) >= count + 20, 20)
    stop.set()
    await asyncio.wait_for(task, 30)
    topics = await cluster.store.load_topics()  # type: ignore[union-attr]
    assert topics["moving"]["assignment"]["0"] == [2, 3, 4]
    leader = (await cluster.partitions("moving"))[0]["leader"]
    assert leader in (2, 3, 4)
    response = await cluster.broker_stub(leader).Fetch(
        pb.FetchRequest(
            replica_id=-1,
            max_bytes=1 << 22,
            partitions=[
                pb.FetchPartition(
                    topic="moving",
                    partition=0,
                    fetch_offset=0,
                    current_leader_epoch=-1,
                    last_fetched_epoch=-1,
                    log_start_offset=-1,
                )
            ],
        )
    )
    seen = {r.value: r.offset for r in decode_batches(response.partitions[0].record_batches)}
    for value, offset in acked.items():
        assert seen.get(value) == offset
    # Broker 1 no longer holds the partition.
    await eventually(lambda: not (cluster.root / "broker-1" / "moving-0").exists(), 10)
