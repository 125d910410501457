"""Faults against a real cluster (etcd, two controller processes, three broker processes):
a paused controller, partitioned replicas, a broker cut off from the controllers, a broker
restarted during a controller failover, unclean election, and AlterIsr batching when a
follower stops."""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tests.controller.cluster import Cluster, Eventually
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.log import Log
from tidewater.local.tcp_proxy import LinkMode
from tidewater.records.batch import Record, build_batch
from tidewater.records.header import read_header
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import common_pb2
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

UNREACHABLE_S = 5.0
# A new controller's grace period (one session timeout) that outlasts a broker's restart.
LONG_SESSION_TIMEOUT_MS = 15000
# One that outlasts a whole test: only every broker heartbeating can end it.
ENDLESS_SESSION_TIMEOUT_MS = 600_000


async def etcd_state(cluster: Cluster) -> dict[str, Any]:
    """Everything a controller writes: the controller key and epoch, brokers, topics and every
    partition's LeaderAndIsr with its partition epoch."""
    store = cluster.store
    return {
        "controller": await store.active_controller(),
        "brokers": await store.load_brokers(),
        "topics": await store.load_topics(),
        "partitions": await store.load_partitions(),
    }


async def assert_written_only_by(
    cluster: Cluster, before: dict[str, Any], controller: tuple[int, str, int]
) -> None:
    """Since `before`, etcd changed only by `controller`'s hand: the controller key and epoch
    are its own, brokers and topics untouched, and every partition rewritten since carries its
    controller epoch (the active one may still commit ISR changes meanwhile)."""
    now = await etcd_state(cluster)
    assert now["controller"] == before["controller"] == controller
    assert (now["brokers"], now["topics"]) == (before["brokers"], before["topics"])
    rewritten = {
        tp: value
        for tp, (value, revision) in now["partitions"].items()
        if before["partitions"].get(tp, (None, None))[1] != revision
    }
    assert all(v["controller_epoch"] == controller[2] for v in rewritten.values()), rewritten


async def test_a_paused_controller_is_deposed_and_can_neither_write_nor_command(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("fenced", 3, 3)
    await eventually(lambda: cluster.produced("fenced", 0, b"warm-up"), 20)
    active = await cluster.store.active_controller()
    assert active is not None
    old_id, _, old_epoch = active
    old = cluster.controllers[old_id]

    old.signal(signal.SIGSTOP)

    async def deposed() -> bool:
        now = await cluster.store.active_controller()
        return now is not None and now[0] != old_id

    await eventually(deposed, cluster.lease_ttl_s + 3)
    active = await cluster.store.active_controller()
    assert active is not None
    new_id, _, new_epoch = active
    assert new_epoch == old_epoch + 1
    new = (new_id, cluster.controllers[new_id].address, new_epoch)
    # The brokers move to the new controller (after their calls to the paused one time out),
    # and a topic created now reaches them all: each has seen the new controller epoch.
    await eventually(lambda: cluster.has_alive_brokers({1, 2, 3}), 20)
    await cluster.create_topic("after", 1, 3)
    await eventually(lambda: cluster.applied(["fenced", "after"]), 20)
    before = await etcd_state(cluster)

    old.signal(signal.SIGCONT)

    await eventually(lambda: "lost its lease" in old.log_file.read_text(), 10)
    await assert_written_only_by(cluster, before, new)
    # It stays up as a standby and sends callers to the new controller.
    answer = await cluster.controller_stub(old_id).DescribeCluster(
        cpb.DescribeClusterRequest(), timeout=5
    )
    assert answer.error_code == ErrorCode.NOT_CONTROLLER
    assert (answer.controller.controller_id, answer.controller.controller_epoch) == (
        new_id,
        new_epoch,
    )
    # A LeaderAndIsr in the old controller's name, as it could still have had queued: it
    # would make broker 1 leader of every partition of "fenced" in a newer leader epoch.
    brokers = await cluster.store.load_brokers()
    states = await cluster.partitions("fenced")
    for broker_id in (1, 2, 3):
        response = await cluster.control_stub(broker_id).LeaderAndIsr(
            pb.LeaderAndIsrRequest(
                controller_id=old_id,
                controller_epoch=old_epoch,
                broker_epoch=brokers[broker_id]["epoch"],
                partition_states=[
                    pb.LeaderAndIsrPartitionState(
                        topic="fenced",
                        partition=p,
                        controller_epoch=old_epoch,
                        leader=1,
                        leader_epoch=state["leader_epoch"] + 1,
                        isr=[1, 2, 3],
                        partition_epoch=0,
                        replicas=[1, 2, 3],
                    )
                    for p, state in states.items()
                ],
                live_leaders=[
                    common_pb2.BrokerInfo(
                        broker_id=1,
                        endpoint=common_pb2.Endpoint(
                            host=brokers[1]["host"], port=int(brokers[1]["port"])
                        ),
                    )
                ],
            )
        )
        assert response.error_code == ErrorCode.STALE_CONTROLLER_EPOCH, response
    assert await cluster.applied(["fenced", "after"])
    await assert_written_only_by(cluster, before, new)


async def test_jepsen_2013_an_isolated_leader_acknowledges_nothing_and_its_followers_lose_none(
    cluster: Cluster, eventually: Eventually
) -> None:
    """Jepsen's 2013 Kafka scenario: the followers are cut off from the leader, the ISR shrinks
    to the leader alone, then the leader dies. Kafka acknowledged acks=all writes with that
    ISR of one, and elected a follower that did not have them. Here min.insync.replicas=2
    refuses those writes, and the HW does not move while the ISR is the leader alone, so the
    followers hold every committed record: alive again, one leads (an eligible leader
    replica, KIP-966), and no acknowledged record is lost.

    Nothing routes only the followers' fetches through a proxy (their leader's address is its
    registered listener; there is no advertised listener to point elsewhere), so the followers
    are paused instead; they are resumed, alive and unfenced, before the election that matters.
    """
    leader, followers = 1, (2, 3)
    await cluster.create_topic("jepsen", assignments=[(1, 2, 3)], **{"min.insync.replicas": "2"})
    await eventually(lambda: cluster.produced("jepsen", 0, b"warm-up"), 20)
    acked = await cluster.produce_all("jepsen", 0, [f"acked-{i}".encode() for i in range(20)])

    for follower in followers:
        cluster.brokers[follower].signal(signal.SIGSTOP)

    async def isr_is_the_leader_alone() -> bool:
        return (await cluster.partitions("jepsen"))[0]["isr"] == [leader]

    await eventually(isr_is_the_leader_alone, 10)
    refusals: list[int] = []

    async def refuses_acks_all() -> bool:
        value = f"refused-{len(refusals)}".encode()
        result = await cluster.send(leader, "jepsen", 0, value, timeout_ms=2000)
        assert result is not None
        assert result.error_code != ErrorCode.NONE, f"{value!r} acknowledged by an ISR of one"
        refusals.append(result.error_code)
        return result.error_code == ErrorCode.NOT_ENOUGH_REPLICAS

    await eventually(refuses_acks_all, 15)
    # Sent before the leader applied the shrink, a write waits for the followers, then fails.
    assert set(refusals) <= {
        ErrorCode.NOT_ENOUGH_REPLICAS,
        ErrorCode.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        ErrorCode.REQUEST_TIMED_OUT,
    }, [ErrorCode.Name(code) for code in refusals]

    cluster.brokers[leader].kill()

    async def offline() -> bool:
        return (await cluster.partitions("jepsen"))[0]["leader"] == -1

    await eventually(offline, 10)
    for follower in followers:
        cluster.brokers[follower].signal(signal.SIGCONT)
    # Their heartbeats unfence them, and the first unfencing re-runs the election of
    # leaderless partitions: 2 and 3 left the ISR while it was below min.insync.replicas.
    await eventually(lambda: cluster.has_alive_brokers(set(followers)), 10)
    state = (await cluster.partitions("jepsen"))[0]
    assert state["isr"] == [state["leader"]] and state["leader"] in followers, state
    assert "UNCLEAN" not in await cluster.active_controller_log()

    async def served() -> bool:
        new_leader, epoch = state["leader"], state["leader_epoch"]
        if not await cluster.replica_sees(new_leader, "jepsen", 0, new_leader, epoch):
            return False
        seen = await cluster.read(state["leader"], "jepsen", 0)
        return {value: seen.get(value) for value in acked} == acked

    await eventually(served, 15)


async def test_a_broker_cut_off_from_the_controllers_is_fenced_and_cannot_change_isrs(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    cluster = await make_cluster(controller_proxies=[3])
    # Broker 3 leads partition 0 and follows partition 1.
    await cluster.create_topic("cut", assignments=[(3, 1, 2), (1, 2, 3)])
    for partition in (0, 1):
        await eventually(lambda p=partition: cluster.produced("cut", p, b"warm-up"), 20)
    before = await cluster.store.load_partitions()
    led_before, _ = before["cut", 0]
    broker_epoch = (await cluster.store.load_brokers())[3]["epoch"]

    cluster.cut_off(3, LinkMode.DROP)

    async def fenced_and_replaced() -> bool:
        states = await cluster.partitions("cut")
        return (
            (await cluster.broker_statuses())[3] == cpb.BROKER_STATUS_FENCED
            and states[0]["leader"] not in (3, -1)
            and all(3 not in state["isr"] for state in states.values())
        )

    await eventually(fenced_and_replaced, 10)
    # Nothing tells broker 3 (a fenced broker gets no LeaderAndIsr), so it still leads
    # partition 0 in its old epoch. It takes a write, which its followers, gone to the new
    # leader, never fetch: not acknowledged.
    zombie = await cluster.send(3, "cut", 0, b"zombie", timeout_ms=1000)
    assert zombie is not None
    assert zombie.error_code == ErrorCode.REQUEST_TIMED_OUT, ErrorCode.Name(zombie.error_code)
    # With its followers lagging, it proposes a smaller ISR (of itself alone, or with the
    # follower that lagged second if the check ran between the two: one proposal at a time
    # per partition, and this one stays pending): the proposal cannot reach the controller.
    broker_log = cluster.brokers[3]
    shrink = re.compile(r"cut-0: proposing ISR shrink \[1, 2, 3\] -> \[(1, |2, )?3\]")

    def proposed_and_failed() -> bool:
        tail = broker_log.log_tail(200)
        return shrink.search(tail) is not None and "not committed" in tail

    await eventually(proposed_and_failed, 10)
    # Were the proposal to get through, as broker 3 would send it: refused as a whole.
    response = await cluster.call_controller(
        "AlterIsr",
        cpb.AlterIsrRequest(
            broker_id=3,
            broker_epoch=broker_epoch,
            partitions=[
                cpb.AlterIsrPartition(
                    topic="cut",
                    partition=0,
                    leader_epoch=led_before["leader_epoch"],
                    new_isr=[3],
                    partition_epoch=before["cut", 0][1],
                )
            ],
        ),
    )
    assert response.error_code == ErrorCode.STALE_BROKER_EPOCH, response.error_message
    states = await cluster.partitions("cut")
    assert states[0]["leader"] not in (3, -1)
    assert states[0]["leader_epoch"] > led_before["leader_epoch"]
    assert all(3 not in state["isr"] for state in states.values())

    cluster.cut_off(3, LinkMode.PASS)

    # Healed, it is unfenced and follows the new leader in the new epoch (dropping the write
    # it took as a zombie).
    async def following() -> bool:
        state = (await cluster.partitions("cut"))[0]
        return 3 in await cluster.alive_brokers() and await cluster.replica_sees(
            3, "cut", 0, state["leader"], state["leader_epoch"]
        )

    await eventually(following, 20)


async def test_a_broker_back_from_a_missed_session_rejoins_the_isrs(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("rejoin", assignments=[(1, 2, 3)])
    await eventually(lambda: cluster.produced("rejoin", 0, b"warm-up"), 20)

    cluster.brokers[3].signal(signal.SIGSTOP)

    async def isr(expected: list[int]) -> bool:
        return sorted((await cluster.partitions("rejoin"))[0]["isr"]) == expected

    await eventually(lambda: isr([1, 2]), 10)
    cluster.brokers[3].signal(signal.SIGCONT)
    await eventually(lambda: cluster.has_alive_brokers({3}), 10)
    assert await cluster.produced("rejoin", 0, b"while it catches up")
    # Caught up within a few fetches (100 ms backoff, 200 ms long polls).
    await eventually(lambda: isr([1, 2, 3]), 5)


def lose_tail(partition_dir: Path, records: int) -> None:
    """What a crash may do to a stopped broker's log: its last `records` records, unflushed,
    are gone."""
    log = Log.open(partition_dir, LogConfig())
    try:
        log.truncate_to(log.log_end_offset - records)
    finally:
        log.close()


def lose_an_earlier_segments_end(partition_dir: Path) -> None:
    """What a machine crash could do to a stopped broker's log (review 13): the segment before
    the last, unflushed, loses its second half at a batch boundary while the last one stays."""
    earlier = sorted(partition_dir.glob("*.log"))[-2]
    data = earlier.read_bytes()
    batch_ends = [0]
    while batch_ends[-1] < len(data):
        batch_ends.append(batch_ends[-1] + read_header(data, batch_ends[-1]).size)
    earlier.write_bytes(data[: batch_ends[len(batch_ends) // 2]])
    for index in (earlier.with_suffix(".index"), earlier.with_suffix(".timeindex")):
        index.unlink()  # rebuilt on load


async def test_a_replica_whose_crash_left_a_gap_in_its_log_serves_every_acked_record(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually, tmp_path: Path
) -> None:
    """Before review 13, the replica loaded the hole with its LEO past it, rejoined the ISR
    and, elected, served the acknowledged records without those in the hole. Loading now cuts
    its log at the gap, and it fetches the rest back before it rejoins the ISR."""
    cluster = await make_cluster()
    topic = "gap"
    await cluster.create_topic(
        topic, assignments=[(3, 1, 2)], **{"min.insync.replicas": "2", "segment.bytes": "600"}
    )
    await eventually(lambda: cluster.settled([topic]), 30)
    acked = await cluster.produce_all(topic, 0, [f"r{i:03d}".encode() for i in range(40)])
    cluster.brokers[3].kill()
    lose_an_earlier_segments_end(tmp_path / "broker-3" / f"{topic}-0")
    await cluster.start_broker(3)
    await eventually(lambda: cluster.settled([topic]), 40)
    await cluster.call_controller(
        "ElectLeaders", cpb.ElectLeadersRequest(election_type=cpb.ELECTION_TYPE_PREFERRED)
    )

    async def led_by_3() -> bool:
        state = (await cluster.partitions(topic))[0]
        return state["leader"] == 3 and await cluster.applied([topic])

    await eventually(led_by_3, 30)
    assert await cluster.read(3, topic, 0) == acked


async def led_by_1_with_acked_records(
    cluster: Cluster, eventually: Eventually, topic: str
) -> tuple[dict[bytes, int], dict[str, Any], int, tuple[int, str, int]]:
    """`topic`: one partition on [1, 2, 3] (min.insync.replicas=2), settled and led by broker 1,
    with 20 records acknowledged. Those records (value -> offset), its LeaderAndIsr and
    partition epoch, and the active controller."""
    await cluster.create_topic(topic, assignments=[(1, 2, 3)], **{"min.insync.replicas": "2"})
    await eventually(lambda: cluster.settled([topic]), 20)
    acked = await cluster.produce_all(topic, 0, [f"{topic}{i}".encode() for i in range(20)])
    before, since = (await cluster.store.load_partitions())[topic, 0]
    assert before["leader"] == 1
    active = await cluster.store.active_controller()
    assert active is not None
    return acked, before, since, active


async def another_controller_active(cluster: Cluster, old: tuple[int, str, int]) -> bool:
    now = await cluster.store.active_controller()
    return now is not None and now[0] != old[0]


async def test_a_broker_restarted_during_a_new_controllers_grace_period_leads_no_more_at_its_epoch(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually, tmp_path: Path
) -> None:
    cluster = await make_cluster(session_timeout_ms=LONG_SESSION_TIMEOUT_MS)
    acked, before, since, active = await led_by_1_with_acked_records(cluster, eventually, "restart")

    # The leader dies, losing its unflushed tail, and so does the active controller, long
    # before the leader's session ends: the next controller loads broker 1 as registered and
    # leading, fenced only until it hears from it, and moves no leader in its grace period.
    cluster.brokers[1].kill()
    cluster.controllers[active[0]].kill()
    lose_tail(tmp_path / "broker-1" / "restart-0", 5)

    await eventually(lambda: another_controller_active(cluster, active), cluster.lease_ttl_s + 5)
    await eventually(lambda: cluster.has_alive_brokers({2, 3}), 10)
    assert (await cluster.partitions("restart"))[0] == before
    # Broker 1 restarts within that grace period.
    await cluster.start_broker(1)

    async def moved() -> bool:
        state = (await cluster.partitions("restart"))[0]
        return state["leader"] != 1 and state["leader_epoch"] > before["leader_epoch"]

    await eventually(moved, 20)
    await eventually(lambda: cluster.settled(["restart"]), 20)  # broker 1 back in the ISR
    history = await cluster.partition_history("restart", 0, since)
    # Its new incarnation never led or counted in the ISR at its old incarnation's epoch: its
    # leadership and ISR membership went in one change, at a newer leader epoch, and the new
    # leader let it back into the ISR only later (AlterIsr: same leader, same epoch).
    taken = history[0]
    assert taken["leader"] in (2, 3) and 1 not in taken["isr"], history
    assert taken["leader_epoch"] > before["leader_epoch"], history
    rejoined = next(s for s in history if 1 in s["isr"])
    assert (rejoined["leader"], rejoined["leader_epoch"]) == (
        taken["leader"],
        taken["leader_epoch"],
    ), history

    # It had caught up: leading again, it serves every acknowledged record at its offset.
    await cluster.call_controller(
        "ElectLeaders", cpb.ElectLeadersRequest(election_type=cpb.ELECTION_TYPE_PREFERRED)
    )

    async def leads_again() -> bool:
        state = (await cluster.partitions("restart"))[0]
        return state["leader"] == 1 and await cluster.applied(["restart"])

    await eventually(leads_again, 20)
    seen = await cluster.read(1, "restart", 0)
    assert {v: seen.get(v) for v in acked} == acked


async def test_an_isr_member_heard_from_in_a_grace_period_leads_a_partition_left_offline(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    cluster = await make_cluster(session_timeout_ms=ENDLESS_SESSION_TIMEOUT_MS)
    acked, before, since, active = await led_by_1_with_acked_records(cluster, eventually, "offline")

    # Leader 1 dies; followers 2 and 3 pause (alive, in sync, silent); then the active
    # controller dies. The next one hears from no ISR member, and its grace period cannot
    # end by itself (broker 3 stays silent, and one session timeout outlasts the test).
    cluster.brokers[1].kill()
    for b in (2, 3):
        cluster.brokers[b].signal(signal.SIGSTOP)
    cluster.controllers[active[0]].kill()

    await eventually(lambda: another_controller_active(cluster, active), cluster.lease_ttl_s + 5)
    # Broker 1 restarts: its registration takes it out of the ISR, with no leader to elect.
    await cluster.start_broker(1)
    await eventually(lambda: cluster.has_alive_brokers({1}), 20)
    offline = (await cluster.partitions("offline"))[0]
    assert (offline["leader"], offline["isr"]) == (-1, [2, 3])

    # ISR member 2 heartbeats: it leads at once, while the grace period goes on.
    cluster.brokers[2].signal(signal.SIGCONT)

    async def led_by_2() -> bool:
        return (await cluster.partitions("offline"))[0]["leader"] == 2

    await eventually(led_by_2, 20)
    assert "grace period over" not in await cluster.active_controller_log()
    assert 3 not in await cluster.alive_brokers()
    # A clean election: 2 was in the ISR, and 3, not heard from yet, stays in it (until
    # leader 2 drops it, as it does a follower that lags).
    history = (await cluster.partition_history("offline", 0, since))[:2]
    assert [(s["leader"], s["isr"]) for s in history] == [(-1, [2, 3]), (2, [2, 3])], history
    assert history[1]["leader_epoch"] == before["leader_epoch"] + 2, history

    # Every acknowledged record is there, at its offset, on the new leader.
    cluster.brokers[3].signal(signal.SIGCONT)
    await eventually(lambda: cluster.settled(["offline"]), 20)
    assert "grace period over (every broker has heartbeated)" in (
        await cluster.active_controller_log()
    )
    assert (await cluster.partitions("offline"))[0]["leader"] == 2
    seen = await cluster.read(2, "offline", 0)
    assert {v: seen.get(v) for v in acked} == acked


async def test_unclean_leader_election_only_where_the_topic_enables_it(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("clean", assignments=[(1, 2)])
    await cluster.create_topic(
        "unclean", assignments=[(1, 2)], **{"unclean.leader.election.enable": "true"}
    )
    topics = ("clean", "unclean")
    for topic in topics:
        await eventually(lambda t=topic: cluster.produced(t, 0, b"warm-up"), 20)

    cluster.brokers[2].signal(signal.SIGSTOP)

    async def all_states(condition: Callable[[dict[str, Any]], bool]) -> bool:
        return all([condition((await cluster.partitions(t))[0]) for t in topics])

    await eventually(lambda: all_states(lambda s: s["isr"] == [1]), 10)
    cluster.brokers[1].kill()
    await eventually(lambda: all_states(lambda s: s["leader"] == -1), 10)
    cluster.brokers[2].signal(signal.SIGCONT)
    # Once broker 2 is alive again, the election of both partitions has run: 2 is their only
    # live replica, and it is outside their ISR.
    await eventually(lambda: cluster.has_alive_brokers({2}), 10)

    clean, unclean = [(await cluster.partitions(t))[0] for t in topics]
    # The ISR emptied when 1 was fenced (KIP-966); 1 is in the ELR, 2 is not.
    assert (clean["leader"], clean["isr"], clean["elr"]) == (-1, [], [1])
    assert (unclean["leader"], unclean["isr"]) == (2, [2])
    warnings = [
        line
        for line in (await cluster.active_controller_log()).splitlines()
        if "UNCLEAN leader election" in line
    ]
    assert len(warnings) == 1, warnings
    assert " WARNING " in warnings[0]
    assert "unclean-0: UNCLEAN leader election of broker 2" in warnings[0]
    await eventually(lambda: cluster.produced("unclean", 0, b"after"), 10)


async def append_to_each(cluster: Cluster, leader: int, topic: str, partitions: list[int]) -> None:
    """One record to each partition, acks=1, in one request to their leader."""
    response = await cluster.broker_stub(leader).Produce(
        pb.ProduceRequest(
            acks=1,
            timeout_ms=5000,
            partitions=[
                pb.PartitionProduceData(
                    topic=topic, partition=p, record_batch=build_batch([Record(value=b"x")])
                )
                for p in partitions
            ],
        ),
        timeout=10,
    )
    assert [r.error_code for r in response.partitions] == [ErrorCode.NONE] * len(partitions)


async def test_isr_shrinks_of_200_partitions_travel_in_a_handful_of_alter_isr_rpcs(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    # A session timeout far beyond the test keeps the paused follower unfenced: the ISRs can
    # then shrink only through the leaders' AlterIsr, not by the controller fencing it.
    cluster = await make_cluster(session_timeout_ms=60_000, metrics=True)
    follower = 3
    await cluster.create_topic("many", assignments=[(1 + p % 2, follower) for p in range(200)])
    await eventually(lambda: cluster.settled(["many"]), 30)
    before = await cluster.partitions("many")
    active = await cluster.store.active_controller()
    assert active is not None
    controller_before = await cluster.metrics("controller", active[0])
    leaders_before = {leader: await cluster.metrics("broker", leader) for leader in (1, 2)}

    cluster.brokers[follower].signal(signal.SIGSTOP)
    # A follower at the leader's LEO counts as caught up however long it is silent (Kafka's
    # rule), so the leaders' logs must move on for it to fall behind.
    for leader in (1, 2):
        await append_to_each(cluster, leader, "many", [p for p in before if p % 2 == leader - 1])

    async def shrunk() -> bool:
        states = await cluster.partitions("many")
        return all(state["isr"] == [state["leader"]] for state in states.values())

    await eventually(shrunk, 15)
    after = await cluster.partitions("many")
    assert {p: (s["leader"], s["leader_epoch"]) for p, s in after.items()} == {
        p: (s["leader"], s["leader_epoch"]) for p, s in before.items()
    }
    # Batching as an operator sees it: each leader's 100 shrinks in a handful of AlterIsr RPCs,
    # and the controller's etcd txns carry many partitions each.
    for leader, earlier in leaders_before.items():
        now = await cluster.metrics("broker", leader)
        shrinks, partitions, rpcs = (
            now.since(earlier, name)
            for name in (
                "tidewater_replica_manager_isr_shrinks_total",
                "tidewater_alter_isr_partitions_total",
                "tidewater_alter_isr_requests_total",
            )
        )
        assert shrinks == 100 and partitions >= 100 and 1 <= rpcs <= 5, (leader, shrinks, rpcs)
    controller = await cluster.metrics("controller", active[0])
    txns = controller.since(controller_before, "tidewater_controller_etcd_txns_total")
    ops = controller.since(controller_before, "tidewater_controller_etcd_txn_ops_total")
    assert ops >= 200 and 1 <= txns <= 10, (txns, ops)


async def test_a_live_broker_the_controller_cannot_reach_gets_its_partitions_once_it_can(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    """Broker 2 heartbeats but nobody reaches it (its inbound proxy drops every connection)
    while a topic with a replica on it is created: the controller's LeaderAndIsr cannot get
    through. It is retried for as long as the broker stays registered and alive (Kafka's
    controller channel manager), so once the link heals the broker replicates the topic."""
    cluster = await make_cluster(inbound_proxies=[2])
    cluster.isolate(2, LinkMode.DROP)
    await cluster.create_topic("reach", assignments=[(1, 2, 3)])
    # Longer than a handful of retries (those the controller made before giving up).
    await asyncio.sleep(UNREACHABLE_S)
    assert 2 in await cluster.alive_brokers()
    cluster.isolate(2, LinkMode.PASS)
    await eventually(lambda: cluster.settled(["reach"]), 20)
