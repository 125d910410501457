"""Requests the controller refuses, or takes apart, before they reach etcd (review 23): an
in-process controller on a real etcd, its ControllerService called directly."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.controller.in_process import ConnectStore, RunController, heartbeat, seed
from tidewater.controller.controller import Controller, ControllerConfig
from tidewater.controller.model import BrokerState, PartitionRecord, TopicState
from tidewater.controller.server import monotonic_ms
from tidewater.controller.service import ControllerService
from tidewater.errors import PolicyViolation, StoreUnavailable
from tidewater.local.wait import eventually
from tidewater.v1 import common_pb2
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

T0 = common_pb2.TopicPartition(topic="t", partition=0)


async def running(
    connect_store: ConnectStore, run_controller: RunController, record: PartitionRecord
) -> tuple[Controller, ControllerService]:
    """Brokers 1-3 registered and heard from; t-0 on all three in `record`'s state."""
    await seed(connect_store, brokers=(1, 2, 3), replicas=(1, 2, 3), record=record)
    controller, _ = await run_controller(await connect_store(), 60_000)
    for broker_id in (1, 2, 3):
        await heartbeat(controller, broker_id)
    return controller, ControllerService(controller)


async def test_a_partition_named_twice_is_elected_once_and_the_controller_stays(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 23 #3: both copies went into one etcd txn, which etcd refuses for a key named
    twice; the controller took that for etcd failing and resigned (a new grace period for the
    whole cluster), and the client got REQUEST_TIMED_OUT. Kafka takes the partitions as a
    set. An AlterIsr naming one twice is refused whole."""
    controller, service = await running(
        connect_store, run_controller, PartitionRecord(2, 3, (1, 2, 3), 1)
    )
    epoch = controller.epoch
    elect = cpb.ElectLeadersRequest(election_type=cpb.ELECTION_TYPE_PREFERRED, partitions=[T0, T0])
    response = await service.ElectLeaders(elect, None)  # type: ignore[arg-type]
    assert [(p.partition, p.error_code) for p in response.partitions] == [(0, ErrorCode.NONE)]
    assert (controller.active, controller.epoch) == (True, epoch)
    assert controller.model.partitions[("t", 0)].leader == 1

    record = controller.model.partitions[("t", 0)]
    alter = cpb.AlterIsrRequest(broker_id=1, broker_epoch=controller.model.brokers[1].epoch)
    for _ in range(2):
        alter.partitions.add(
            topic="t",
            partition=0,
            leader_epoch=record.leader_epoch,
            partition_epoch=record.partition_epoch,
            new_isr=[1, 2],
        )
    refused = await service.AlterIsr(alter, None)  # type: ignore[arg-type]
    assert refused.error_code == ErrorCode.INVALID_REQUEST, refused.error_message
    assert (controller.active, controller.model.partitions[("t", 0)]) == (True, record)


async def test_an_explicit_assignment_needs_a_replica_that_can_lead(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 23 #2: a partition placed only on brokers that are fenced or shutting down was
    created with no leader and no ISR, and stayed offline once they came back. Refused, as
    Kafka's createTopic and createPartitions refuse it."""
    controller, service = await running(
        connect_store, run_controller, PartitionRecord(1, 0, (1, 2, 3), 1)
    )
    await controller.fence(controller.model.brokers[3], "a test")
    await controller.begin_shutdown(controller.model.brokers[2])
    on_2_and_3 = [cpb.CreatableReplicaAssignment(partition=0, broker_ids=[2, 3])]
    created = await service.CreateTopics(
        cpb.CreateTopicsRequest(topics=[cpb.CreatableTopic(name="n", assignments=on_2_and_3)]),
        None,  # type: ignore[arg-type]
    )
    assert created.topics[0].error_code == ErrorCode.INVALID_REPLICA_ASSIGNMENT
    assert "n" not in controller.model.topics
    added = cpb.CreatePartitionsTopic(
        name="t",
        count=2,
        assignments=[cpb.CreatableReplicaAssignment(partition=1, broker_ids=[3, 2, 1])],
    )
    grown = await service.CreatePartitions(
        cpb.CreatePartitionsRequest(topics=[added]),
        None,  # type: ignore[arg-type]
    )
    # Broker 1 can lead it: allowed.
    assert grown.topics[0].error_code == ErrorCode.NONE, grown.topics[0].error_message
    assert controller.model.partitions[("t", 1)].leader == 1


async def test_a_second_process_with_a_live_brokers_id_is_refused_until_its_session_ends(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 23 #4: a second process registering broker 1's id fenced the live one, which
    registered again at its next heartbeat and fenced the second: they led the same
    partitions in turns, on different disks. Kafka's DUPLICATE_BROKER_REGISTRATION while the
    old session is valid; a clean shutdown's epoch, or the session's end, lets it register."""
    controller, service = await running(
        connect_store, run_controller, PartitionRecord(1, 0, (1, 2, 3), 1)
    )
    live = controller.model.brokers[1]

    async def register(
        incarnation: str, previous_broker_epoch: int = 0
    ) -> cpb.RegisterBrokerResponse:
        request = cpb.RegisterBrokerRequest(
            broker=common_pb2.BrokerInfo(
                broker_id=1, endpoint=common_pb2.Endpoint(host="127.0.0.1", port=9)
            ),
            incarnation_id=incarnation,
            previous_broker_epoch=previous_broker_epoch,
        )
        return await service.RegisterBroker(request, None)  # type: ignore[arg-type]

    duplicate = await register("b")
    assert duplicate.error_code == ErrorCode.DUPLICATE_BROKER_REGISTRATION
    assert controller.model.brokers[1] is live and not live.fenced
    assert controller.model.partitions[("t", 0)].leader == 1

    restarted = await register("c", previous_broker_epoch=live.epoch)
    assert restarted.error_code == ErrorCode.NONE, restarted.error_message
    assert restarted.broker_epoch > live.epoch

    await controller.fence(controller.model.brokers[1], "its session expired")
    after_expiry = await register("d")
    assert after_expiry.error_code == ErrorCode.NONE, after_expiry.error_message


async def create_default(service: ControllerService, name: str) -> cpb.CreatableTopicResult:
    """CreateTopics of `name`, one partition, no replication factor: the default's."""
    response = await service.CreateTopics(
        cpb.CreateTopicsRequest(topics=[cpb.CreatableTopic(name=name, num_partitions=1)]),
        None,  # type: ignore[arg-type]
    )
    return response.topics[0]


async def test_the_default_replication_factor_is_refused_rather_than_shrunk_while_a_broker_is_down(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """A topic created without a replication factor while one of three brokers was down got
    two replicas for good. Kafka's placer refuses default.replication.factor with
    INVALID_REPLICATION_FACTOR; an explicit smaller factor still works."""
    controller, service = await running(
        connect_store, run_controller, PartitionRecord(1, 0, (1, 2, 3), 1)
    )
    await controller.fence(controller.model.brokers[3], "a test")
    refused = await create_default(service, "d")
    assert refused.error_code == ErrorCode.INVALID_REPLICATION_FACTOR, refused.error_message
    assert "replication factor 3" in refused.error_message
    assert "d" not in controller.model.topics
    response = await service.CreateTopics(
        cpb.CreateTopicsRequest(
            topics=[cpb.CreatableTopic(name="two", num_partitions=1, replication_factor=2)]
        ),
        None,  # type: ignore[arg-type]
    )
    assert response.topics[0].error_code == ErrorCode.NONE, response.topics[0].error_message
    assert len(controller.model.topics["two"].assignment[0]) == 2


async def test_a_new_controller_in_its_grace_period_asks_to_retry_a_factor_its_brokers_lack(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Right after a failover a broker not heard from yet may well be alive: a replication
    factor only it would complete is answered REQUEST_TIMED_OUT (retriable), not
    INVALID_REPLICATION_FACTOR; it is placed once that broker heartbeats. Never on a broker
    not heard from (review 33 #2: a long-dead one got partitions with no leader)."""
    await seed(connect_store, brokers=(1, 2, 3), replicas=(1, 2, 3))
    controller, _ = await run_controller(await connect_store(), 60_000)
    for broker_id in (1, 2):
        await heartbeat(controller, broker_id)
    assert controller.in_grace
    service = ControllerService(controller)
    retry = await create_default(service, "d")
    assert retry.error_code == ErrorCode.REQUEST_TIMED_OUT, retry.error_message
    assert "d" not in controller.model.topics
    response = await service.CreateTopics(
        cpb.CreateTopicsRequest(
            topics=[cpb.CreatableTopic(name="two", num_partitions=6, replication_factor=1)]
        ),
        None,  # type: ignore[arg-type]
    )
    assert response.topics[0].error_code == ErrorCode.NONE
    assert {r for rs in controller.model.topics["two"].assignment.values() for r in rs} <= {1, 2}
    await heartbeat(controller, 3)
    created = await create_default(service, "d")
    assert created.error_code == ErrorCode.NONE, created.error_message
    assert sorted(controller.model.topics["d"].assignment[0]) == [1, 2, 3]


async def test_an_unset_default_replication_factor_is_at_most_the_brokers_ever_registered(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Unset, it is 3, or the number of brokers that ever registered where fewer: a one-broker
    cluster needs no setting."""
    await seed(connect_store, brokers=(1,), replicas=(1,))
    controller, _ = await run_controller(await connect_store(), 60_000)
    await heartbeat(controller, 1)
    assert (await create_default(ControllerService(controller), "one")).error_code == ErrorCode.NONE
    assert controller.model.topics["one"].assignment[0] == (1,)


async def test_a_set_default_replication_factor_is_taken(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """--default-replication-factor (Kafka's default.replication.factor)."""
    await seed(connect_store, brokers=(1, 2, 3), replicas=(1, 2, 3))
    controller, _ = await run_controller(
        await connect_store(), 60_000, default_replication_factor=2
    )
    for broker_id in (1, 2, 3):
        await heartbeat(controller, broker_id)
    assert (await create_default(ControllerService(controller), "two")).error_code == ErrorCode.NONE
    assert len(controller.model.topics["two"].assignment[0]) == 2


async def test_more_than_ten_thousand_partitions_in_one_request_are_refused_whole(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 29 #3: ~100,000 partitions made a topic record larger than etcd takes in one
    request; the controller took etcd's refusal for an outage and resigned, and the admin
    client's retries made the next one resign too. Kafka's POLICY_VIOLATION past 10,000
    partitions a request, for every topic of it."""
    controller, service = await running(
        connect_store, run_controller, PartitionRecord(1, 0, (1, 2, 3), 1)
    )
    epoch = controller.epoch
    created = await service.CreateTopics(
        cpb.CreateTopicsRequest(
            topics=[
                cpb.CreatableTopic(name="a", num_partitions=6000, replication_factor=1),
                cpb.CreatableTopic(name="b", num_partitions=4001, replication_factor=1),
            ]
        ),
        None,  # type: ignore[arg-type]
    )
    assert [t.error_code for t in created.topics] == [ErrorCode.POLICY_VIOLATION] * 2
    assert "10001" in created.topics[0].error_message
    grown = await service.CreatePartitions(
        cpb.CreatePartitionsRequest(topics=[cpb.CreatePartitionsTopic(name="t", count=10_002)]),
        None,  # type: ignore[arg-type]
    )
    assert grown.topics[0].error_code == ErrorCode.POLICY_VIOLATION
    assert set(controller.model.topics) == {"t"}
    assert len(controller.model.topics["t"].assignment) == 1
    assert (controller.active, controller.epoch) == (True, epoch)
    small = await create_default(service, "small")
    assert small.error_code == ErrorCode.NONE, small.error_message


async def test_a_topic_record_larger_than_etcd_takes_is_refused_before_it_is_sent(
    connect_store: ConnectStore,
) -> None:
    """Grown by many requests, a topic's assignment could still outgrow one etcd write."""
    store = await connect_store()
    huge = TopicState("big", {}, {p: (1, 2, 3) for p in range(100_000)}).to_json()
    with pytest.raises(PolicyViolation, match="more than the 1048576 bytes"):
        await store.put_topic(1, "big", huge)


async def test_an_unknown_election_type_is_refused_not_taken_for_unclean(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 32 #2: any election_type but PREFERRED ran an unclean election, which may
    elect a replica out of the ISR and lose acknowledged records."""
    controller, service = await running(
        connect_store, run_controller, PartitionRecord(-1, 3, (2,), 1)
    )
    before = controller.model.partitions[("t", 0)]
    for election_type in (7, -3):
        elect = cpb.ElectLeadersRequest(election_type=election_type, partitions=[T0])  # type: ignore[arg-type]
        response = await service.ElectLeaders(elect, None)  # type: ignore[arg-type]
        assert response.error_code == ErrorCode.INVALID_REQUEST, response.error_message
        assert "election_type" in response.error_message
    assert controller.model.partitions[("t", 0)] == before


async def test_a_standby_that_cannot_read_etcd_answers_not_controller_naming_nobody(
    connect_store: ConnectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 32 #7: the standby's read of who is active raised out of the handler: gRPC
    UNKNOWN, not a named error, after etcd's timeout."""
    store = await connect_store()
    standby = Controller(
        ControllerConfig(controller_id=2, host="127.0.0.1", port=1), store, monotonic_ms
    )

    async def unavailable() -> None:
        raise StoreUnavailable("etcd range: a test")

    monkeypatch.setattr(store, "active_controller", unavailable)
    response = await ControllerService(standby).DescribeCluster(
        cpb.DescribeClusterRequest(),
        None,  # type: ignore[arg-type]
    )
    assert response.error_code == ErrorCode.NOT_CONTROLLER
    assert response.controller.controller_id == -1


async def test_create_topics_refuses_what_its_protocol_says_it_refuses(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 32 #6: negative counts took the defaults (a topic of one partition and three
    replicas), assignments with counts were taken, and a name given twice created the first
    entry; failed results said 0 partitions, not -1."""
    controller, service = await running(
        connect_store, run_controller, PartitionRecord(1, 0, (1, 2, 3), 1)
    )
    on_1 = [cpb.CreatableReplicaAssignment(partition=0, broker_ids=[1])]
    cases = [
        (cpb.CreatableTopic(name="neg", num_partitions=-3), ErrorCode.INVALID_PARTITIONS),
        (
            cpb.CreatableTopic(name="rf", replication_factor=-1),
            ErrorCode.INVALID_REPLICATION_FACTOR,
        ),
        (
            cpb.CreatableTopic(name="both", num_partitions=1, assignments=on_1),
            ErrorCode.INVALID_REQUEST,
        ),
        (cpb.CreatableTopic(name="twice", num_partitions=1), ErrorCode.INVALID_REQUEST),
        (cpb.CreatableTopic(name="twice", num_partitions=2), ErrorCode.INVALID_REQUEST),
        (cpb.CreatableTopic(name="fine", num_partitions=1), ErrorCode.NONE),
    ]
    response = await service.CreateTopics(
        cpb.CreateTopicsRequest(topics=[topic for topic, _ in cases]),
        None,  # type: ignore[arg-type]
    )
    assert [(r.name, r.error_code) for r in response.topics] == [
        (topic.name, code) for topic, code in cases
    ]
    for result in response.topics[:-1]:
        assert result.error_message
        assert (result.num_partitions, result.replication_factor) == (-1, -1)
    assert set(controller.model.topics) == {"t", "fine"}

    deleted = await service.DeleteTopics(
        cpb.DeleteTopicsRequest(topic_names=["fine", "fine"]),
        None,  # type: ignore[arg-type]
    )
    assert [r.error_code for r in deleted.topics] == [ErrorCode.INVALID_REQUEST] * 2
    assert "fine" in controller.model.topics


async def test_the_answers_of_a_cancel_without_reassignment_and_a_preferred_leader_out_of_sync(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 32 #10: two codes a client can see that no test showed one seeing."""
    controller, service = await running(
        connect_store, run_controller, PartitionRecord(2, 3, (2, 3), 1)
    )
    cancel = cpb.AlterPartitionReassignmentsRequest(
        partitions=[cpb.ReassignablePartition(topic="t", partition=0, cancel=True)]
    )
    cancelled = await service.AlterPartitionReassignments(cancel, None)  # type: ignore[arg-type]
    assert cancelled.partitions[0].error_code == ErrorCode.NO_REASSIGNMENT_IN_PROGRESS
    # Broker 1, the preferred leader, is out of the ISR.
    elect = cpb.ElectLeadersRequest(election_type=cpb.ELECTION_TYPE_PREFERRED, partitions=[T0])
    elected = await service.ElectLeaders(elect, None)  # type: ignore[arg-type]
    assert elected.partitions[0].error_code == ErrorCode.PREFERRED_LEADER_NOT_AVAILABLE
    assert controller.model.partitions[("t", 0)].leader == 2


async def test_a_topic_name_that_differs_from_another_only_by_dot_and_underscore_is_refused(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """As Kafka: a.b and a_b would share their metric names."""
    _, service = await running(connect_store, run_controller, PartitionRecord(1, 0, (1, 2, 3), 1))
    assert (await create_default(service, "orders.eu")).error_code == ErrorCode.NONE
    refused = await create_default(service, "orders_eu")
    assert refused.error_code == ErrorCode.INVALID_TOPIC
    assert "collides with existing topic 'orders.eu'" in refused.error_message


async def test_heartbeats_queued_behind_a_long_event_keep_their_brokers_unfenced(
    connect_store: ConnectStore, run_controller: RunController
) -> None:
    """Review 34 #2: a heartbeat counted when its event ran; behind a long event (a
    CreateTopics of 10,000 partitions on a slow etcd) the session check ran before the
    queued heartbeats and fenced their live brokers, moving their leaderships. Contact counts
    as it arrives now, as Kafka's (KAFKA-15019)."""
    await seed(connect_store, brokers=(1, 2, 3), replicas=(1, 2, 3))
    controller, _ = await run_controller(await connect_store(), 600)
    for broker_id in (1, 2, 3):
        await heartbeat(controller, broker_id)
    fenced: list[int] = []
    fence = controller.fence

    async def recorded(broker: BrokerState, reason: str) -> None:
        fenced.append(broker.broker_id)
        await fence(broker, reason)

    controller.fence = recorded  # type: ignore[method-assign]
    release = asyncio.Event()
    blocking = asyncio.ensure_future(controller.submit(release.wait))
    # The next session check waits behind it, ahead of the heartbeats.
    await eventually(lambda: controller._queue.qsize() >= 1, 10)
    beats = []
    loop = asyncio.get_running_loop()
    until = loop.time() + 1.5  # longer than the session timeout
    while loop.time() < until:
        beats += [asyncio.ensure_future(heartbeat(controller, b)) for b in (1, 2, 3)]
        await asyncio.sleep(0.1)
    release.set()
    await asyncio.wait_for(asyncio.gather(blocking, *beats), 10)
    assert fenced == []


async def test_a_controller_resigning_after_an_etcd_failure_is_a_standby_before_its_revoke(
    connect_store: ConnectStore, run_controller: RunController, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 34 #5: while etcd was slow to take the lease revoke (up to its 5 s timeout),
    the resigning controller still answered as active and its senders went on."""
    controller, service = await running(
        connect_store, run_controller, PartitionRecord(1, 0, (1, 2, 3), 1)
    )
    revoking, release = asyncio.Event(), asyncio.Event()
    resign = controller.store.resign

    async def slow_resign() -> None:
        revoking.set()
        await release.wait()
        await resign()

    monkeypatch.setattr(controller.store, "resign", slow_resign)

    async def etcd_fails() -> None:
        raise StoreUnavailable("etcd txn: a test")

    with contextlib.suppress(StoreUnavailable):
        await controller.submit(etcd_fails)
    await asyncio.wait_for(revoking.wait(), 10)
    assert not controller.active
    response = await service.DescribeCluster(cpb.DescribeClusterRequest(), None)  # type: ignore[arg-type]
    assert response.error_code == ErrorCode.NOT_CONTROLLER
    release.set()
