"""A real cluster: etcd, two controller processes, three broker processes, on loopback (the
`cluster` fixture of conftest.py)."""

from __future__ import annotations

import asyncio

from tests.controller.cluster import Cluster, Eventually
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode


async def test_create_topic_then_produce_and_consume(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("orders", 3, 3, **{"min.insync.replicas": "2"})
    states = await cluster.partitions("orders")
    assert sorted(states) == [0, 1, 2]
    assert {s["leader"] for s in states.values()} == {1, 2, 3}  # leaders spread
    await eventually(lambda: cluster.produced("orders", 0, b"first"), 20)


async def test_kill_9_of_a_leading_broker_moves_leadership_and_loses_nothing(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("payments", 3, 3, **{"min.insync.replicas": "2"})
    await eventually(lambda: cluster.produced("payments", 0, b"warm-up"), 20)
    acked = await cluster.produce_all("payments", 0, [f"before-{i}".encode() for i in range(30)])
    victim = (await cluster.partitions("payments"))[0]["leader"]
    led = {p for p, s in (await cluster.partitions("payments")).items() if s["leader"] == victim}
    cluster.brokers[victim].kill()

    async def moved() -> bool:
        states = await cluster.partitions("payments")
        return all(states[p]["leader"] not in (victim, -1) for p in led)

    await eventually(moved, cluster.session_timeout_ms / 1000 + 1 + 1)
    for p, state in (await cluster.partitions("payments")).items():
        assert victim not in state["isr"], (p, state)
    del cluster.brokers[victim]
    for i in range(30):
        value = f"after-{i}".encode()
        offset = None
        for _ in range(50):
            offset = await cluster.produce("payments", 0, value)
            if offset is not None:
                break
            await asyncio.sleep(0.1)
        assert offset is not None
        acked[value] = offset
    leader = (await cluster.partitions("payments"))[0]["leader"]
    seen = await cluster.read(leader, "payments", 0)
    for value, offset in acked.items():
        assert seen.get(value) == offset


async def test_kill_9_of_the_active_controller_fails_over(
    cluster: Cluster, eventually: Eventually
) -> None:
    active = await cluster.store.active_controller()
    assert active is not None
    old_id, _, old_epoch = active
    cluster.controllers[old_id].kill()

    async def new_controller() -> bool:
        now = await cluster.store.active_controller()
        return now is not None and now[0] != old_id

    await eventually(new_controller, cluster.lease_ttl_s + 1 + 1)
    new_id, _, new_epoch = await cluster.store.active_controller()
    assert new_id != old_id
    assert new_epoch > old_epoch
    # The new controller runs the cluster once the brokers heartbeat to it: a topic, then a
    # broker failure, both handled.
    await eventually(lambda: cluster.has_alive_brokers({1, 2, 3}), 10)
    await cluster.create_topic("after-failover", 1, 3)
    await eventually(lambda: cluster.produced("after-failover", 0, b"x"), 20)
    victim = (await cluster.partitions("after-failover"))[0]["leader"]
    cluster.brokers[victim].kill()

    async def moved() -> bool:
        return (await cluster.partitions("after-failover"))[0]["leader"] not in (victim, -1)

    await eventually(moved, cluster.session_timeout_ms / 1000 + 2)


async def test_sigterm_moves_leadership_first_and_loses_nothing(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("orderly", 1, 3, **{"min.insync.replicas": "2"})
    await eventually(lambda: cluster.produced("orderly", 0, b"warm-up"), 20)
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
            result = await cluster.send(current, "orderly", 0, f"r{i}".encode())
            if result is None:
                continue
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
    seen = await cluster.read(new_leader, "orderly", 0)
    for value, offset in acked.items():
        assert seen.get(value) == offset


async def test_reassignment_under_load_moves_every_acknowledged_record(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.start_broker(4)
    await eventually(lambda: cluster.has_alive_brokers({1, 2, 3, 4}), 20)
    await cluster.create_topic("moving", assignments=[(1, 2, 3)], **{"min.insync.replicas": "2"})
    await eventually(lambda: cluster.produced("moving", 0, b"warm-up"), 20)
    acked: dict[bytes, int] = {}
    stop = asyncio.Event()

    async def producer() -> None:
        for i in range(3000):
            if stop.is_set():
                return
            value = f"m{i}".encode()
            offset = await cluster.produce("moving", 0, value)
            if offset is not None:
                acked[value] = offset

    task = asyncio.create_task(producer())
    await eventually(lambda: len(acked) >= 20, 20)
    response = await cluster.call_controller(
        "AlterPartitionReassignments",
        cpb.AlterPartitionReassignmentsRequest(
            partitions=[cpb.ReassignablePartition(topic="moving", partition=0, replicas=[2, 3, 4])]
        ),
    )
    assert response.partitions[0].error_code == ErrorCode.NONE, response.partitions[0]

    async def done() -> bool:
        listed = await cluster.call_controller(
            "ListPartitionReassignments", cpb.ListPartitionReassignmentsRequest()
        )
        state = (await cluster.partitions("moving"))[0]
        return not listed.reassignments and sorted(state["isr"]) == [2, 3, 4]

    await eventually(done, 30)
    count = len(acked)
    await eventually(lambda: len(acked) >= count + 20, 20)
    stop.set()
    await asyncio.wait_for(task, 30)
    topics = await cluster.store.load_topics()
    assert topics["moving"]["assignment"]["0"] == [2, 3, 4]
    leader = (await cluster.partitions("moving"))[0]["leader"]
    assert leader in (2, 3, 4)
    seen = await cluster.read(leader, "moving", 0)
    for value, offset in acked.items():
        assert seen.get(value) == offset
    # Broker 1 no longer holds the partition.
    await eventually(lambda: not (cluster.root / "broker-1" / "moving-0").exists(), 10)
