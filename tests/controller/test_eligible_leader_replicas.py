"""Eligible leader replicas (KIP-966) against a real cluster (etcd, two controller processes,
three broker processes): after a whole-cluster shutdown a partition whose last ISR member
never comes back is led again, cleanly, by a replica that left the ISR while it was below
min.insync.replicas, if that replica shut down cleanly; after kill -9 it stays offline. A
change of the ELR alone keeps the leader epoch.
min.insync.replicas=2 is the topic's own, or the cluster's: the controllers'
--min-insync-replicas and the brokers' default."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.controller.cluster import Cluster, Eventually
from tidewater.broker.log.checkpoints import LeaderEpochCheckpoint
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "elr"
# Broker 3, the last ISR member, cannot hand its leadership over: its controlled shutdown
# gives up after this and it stops cleanly all the same.
SETTINGS = {"controlled.shutdown.timeout.ms": "1000"}
# min.insync.replicas=2: a topic config, or the brokers' default (with the controllers').
MIN_ISR_2 = {"min.insync.replicas": "2"}


async def state(cluster: Cluster) -> dict[str, Any]:
    return (await cluster.partitions(TOPIC))[0]


async def three_brokers_shut_down_one_after_another(
    cluster: Cluster,
    eventually: Eventually,
    stop: Callable[[int], None],
    topic_configs: dict[str, str] = MIN_ISR_2,
    settings: dict[str, str] = SETTINGS,
) -> dict[bytes, int]:
    """Records acknowledged (acks=all, min.insync.replicas=2) with ISR {1, 2, 3}, then with
    {2, 3} once broker 1 is down (1 lacks those); then 2 and 3 go down. The ISR ends empty,
    2 and 3 eligible leader replicas, 3 the last known leader. The acknowledged records."""
    for b in (1, 2, 3):
        await cluster.start_broker(b, **settings)
    await eventually(lambda: cluster.has_alive_brokers({1, 2, 3}), 30)
    await cluster.create_topic(TOPIC, assignments=[(1, 2, 3)], **topic_configs)
    await eventually(lambda: cluster.settled([TOPIC]), 20)
    acked = await cluster.produce_all(TOPIC, 0, [b"all-%d" % i for i in range(10)])

    stop(1)

    async def isr(expected: list[int]) -> bool:
        return sorted((await state(cluster))["isr"]) == expected

    await eventually(lambda: isr([2, 3]), 20)
    for i in range(10):
        value = b"two-%d" % i
        acked[value] = await eventually(lambda v=value: cluster.produce(TOPIC, 0, v), 20)
    stop(2)
    await eventually(lambda: isr([3]), 20)
    assert (await state(cluster))["elr"] == [2]
    stop(3)

    async def offline() -> bool:
        s = await state(cluster)
        return (s["leader"], s["isr"], s["elr"], s["last_known_elr"]) == (-1, [], [2, 3], [3])

    await eventually(offline, 20)
    return acked


@pytest.mark.parametrize("min_isr_of", ["topic", "cluster"])
async def test_after_a_clean_whole_cluster_shutdown_an_eligible_leader_replica_leads(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually, min_isr_of: str
) -> None:
    """With the cluster's default, the topic sets nothing: before the controllers took
    --min-insync-replicas, they kept its ELR as for 1 (empty) and it stayed offline."""
    if min_isr_of == "topic":
        cluster = await make_cluster(broker_ids=())
        topic_configs, settings = MIN_ISR_2, SETTINGS
    else:
        cluster = await make_cluster(broker_ids=(), min_insync_replicas=2)
        topic_configs, settings = {}, SETTINGS | MIN_ISR_2

    def stop(b: int) -> None:
        assert cluster.brokers[b].stop() == 0

    acked = await three_brokers_shut_down_one_after_another(
        cluster, eventually, stop, topic_configs, settings
    )
    _, since = (await cluster.store.load_partitions())[TOPIC, 0]

    # 1 and 2 come back, 3 (the last ISR member) does not. 2 shut down cleanly: still
    # eligible, it leads, in a clean election.
    for b in (1, 2):
        await cluster.start_broker(b, **settings)

    async def led_by_2_with_1_in_sync() -> bool:
        s = await state(cluster)
        return (s["leader"], sorted(s["isr"]), s["elr"]) == (2, [1, 2], [])

    await eventually(led_by_2_with_1_in_sync, 30)
    history = await cluster.partition_history(TOPIC, 0, since)
    elected = next(s for s in history if s["leader"] != -1)
    assert (elected["leader"], elected["isr"], elected["elr"]) == (2, [2], [3]), history
    log = await cluster.active_controller_log()
    assert "registered again with a new incarnation after a clean shutdown" in log
    assert "UNCLEAN" not in log

    # No acknowledged record is lost: each is at its offset, on the new leader.
    async def served() -> bool:
        seen = await cluster.read(2, TOPIC, 0)
        return {v: seen.get(v) for v in acked} == acked

    await eventually(served, 20)


async def test_after_kill_9_of_the_whole_cluster_no_eligible_leader_replica_leads(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    cluster = await make_cluster(broker_ids=())
    acked = await three_brokers_shut_down_one_after_another(
        cluster, eventually, lambda b: cluster.brokers[b].kill()
    )

    # 1 and 2 come back after a crash: 2 may have lost an unflushed tail, so it is no longer
    # eligible, and without 3 the partition stays offline (no unclean election).
    for b in (1, 2):
        await cluster.start_broker(b, **SETTINGS)
    await eventually(lambda: cluster.has_alive_brokers({1, 2}), 30)
    s = await state(cluster)
    assert (s["leader"], s["isr"], s["elr"], s["last_known_elr"]) == (-1, [], [3], [3])
    log = await cluster.active_controller_log()
    assert "registered again with a new incarnation after an unclean shutdown" in log

    # 3, the last leader, comes back and leads, as before KIP-966, with every acknowledged
    # record.
    await cluster.start_broker(3, **SETTINGS)

    async def served() -> bool:
        if (await state(cluster))["leader"] != 3 or not await cluster.applied([TOPIC]):
            return False
        seen = await cluster.read(3, TOPIC, 0)
        return {v: seen.get(v) for v in acked} == acked

    await eventually(served, 30)


async def test_a_change_of_the_elr_alone_keeps_the_leader_epoch(
    cluster: Cluster, eventually: Eventually
) -> None:
    """min.insync.replicas=3 on three replicas: broker 3 stops cleanly, ISR {1, 2}, ELR {3}.
    The topic's value goes down to 2, which clears the ELR alone: the leader epoch stays (it
    moved before) and only the partition epoch does. Leader 1 starts no new epoch in its
    epoch cache; follower 2 applies the partition epoch without becoming a follower again
    (no fetch restart, no truncation), and the records it copies after it are still in the
    old epoch. 3 comes back and joins the ISR: the leader's AlterIsr names the new partition
    epoch, so the leader applied it."""
    topic = "elr-only"
    await cluster.create_topic(topic, assignments=[(1, 2, 3)], **{"min.insync.replicas": "3"})
    await eventually(lambda: cluster.settled([topic]), 20)
    await cluster.produce_all(topic, 0, [b"three-%d" % i for i in range(5)])
    assert cluster.brokers[3].stop() == 0

    async def current() -> dict[str, Any]:
        return (await cluster.partitions(topic))[0]

    async def followed_without_3() -> bool:
        s = await current()
        if (s["isr"], s["elr"]) != ([1, 2], [3]):
            return False
        return all([await cluster.replica_sees(b, topic, 0, 1, s["leader_epoch"]) for b in (1, 2)])

    await eventually(followed_without_3, 20)
    _, since = (await cluster.store.load_partitions())[topic, 0]
    leader_epoch = (await current())["leader_epoch"]
    epochs = {
        b: LeaderEpochCheckpoint(
            cluster.root / f"broker-{b}" / f"{topic}-0" / "leader-epoch-checkpoint"
        )
        for b in (1, 2)
    }
    leader_entries = epochs[1].read()
    follower_log = cluster.brokers[2].log_file
    became = f"became follower of {topic}-0"
    followed = follower_log.read_text(errors="replace").count(became)

    set_2 = cpb.AlterableConfig(
        name="min.insync.replicas", operation=cpb.CONFIG_OPERATION_SET, value="2"
    )
    response = await cluster.call_controller(
        "IncrementalAlterConfigs",
        cpb.IncrementalAlterConfigsRequest(
            topics=[cpb.AlterConfigsTopic(topic=topic, configs=[set_2])]
        ),
    )
    assert [t.error_code for t in response.topics] == [ErrorCode.NONE], response
    history = await cluster.partition_history(topic, 0, since)
    assert [(s["leader_epoch"], s["isr"], s["elr"]) for s in history] == [
        (leader_epoch, [1, 2], [])
    ]
    applied = f"{topic}-0: partition epoch"
    await eventually(lambda: applied in follower_log.read_text(errors="replace"), 20)
    # ISR {1, 2} meets 2: acks=all goes through, in the leader epoch it had.
    acked = await eventually(lambda: cluster.produce(topic, 0, b"two"), 20)
    assert epochs[1].read() == leader_entries
    assert max(e.epoch for e in epochs[2].read()) == leader_epoch
    assert follower_log.read_text(errors="replace").count(became) == followed

    await cluster.start_broker(3)
    await eventually(lambda: cluster.settled([topic]), 30)
    assert (await current())["leader_epoch"] == leader_epoch
    seen = await cluster.read(1, topic, 0)
    assert seen[b"two"] == acked
