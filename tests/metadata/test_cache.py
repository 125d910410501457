"""The metadata service's cluster view: applying the controller's pushes, describing topics."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest

from tests.metadata.updates import DELTA, FULL, state, update
from tidewater.errors import InvalidRequest, StaleControllerEpoch, TidewaterError
from tidewater.metadata.cache import MetadataCache
from tidewater.v1 import cluster_pb2, common_pb2
from tidewater.v1.errors_pb2 import ErrorCode


def topic_codes(cache: MetadataCache, topics: Sequence[str] = ()) -> dict[str, int]:
    return {t.topic: t.error_code for t in cache.describe(topics).topics}


@pytest.fixture
def cache() -> MetadataCache:
    """A cache holding a FULL view of controller epoch 3: orders (2 partitions), audit (1)."""
    cache = MetadataCache()
    cache.apply(
        update(
            FULL,
            3,
            [state("orders", 1, leader=2, leader_epoch=5), state("orders", 0), state("audit", 0)],
        )
    )
    return cache


def test_empty_until_the_first_full_view() -> None:
    cache = MetadataCache()
    assert not cache.ready
    response = cache.describe([])
    assert response.controller.controller_id == -1
    assert response.controller.controller_epoch == -1
    assert not response.controller.HasField("endpoint")
    assert list(response.brokers) == []
    assert list(response.topics) == []


def test_no_topics_answers_the_brokers_and_the_controller_only(cache: MetadataCache) -> None:
    """What an admin client asks to find the controller (review 33 #1: it fetched every
    topic each time)."""
    bare = cache.describe([], no_topics=True)
    full = cache.describe([])
    assert full.topics and not bare.topics
    assert (bare.controller, list(bare.brokers)) == (full.controller, list(full.brokers))


def test_full_view_is_described(cache: MetadataCache) -> None:
    assert cache.ready
    response = cache.describe([])
    assert response.controller == common_pb2.ControllerInfo(
        controller_id=7,
        endpoint=common_pb2.Endpoint(host="10.0.0.9", port=9093),
        controller_epoch=3,
    )
    assert [(b.broker_id, b.endpoint.host, b.endpoint.port) for b in response.brokers] == [
        (1, "10.0.0.1", 9001),
        (2, "10.0.0.1", 9002),
        (3, "10.0.0.1", 9003),
    ]
    assert [t.topic for t in response.topics] == ["audit", "orders"]
    orders = response.topics[1]
    assert orders.error_code == ErrorCode.NONE
    assert [p.partition for p in orders.partitions] == [0, 1]
    p1 = orders.partitions[1]
    assert (p1.error_code, p1.leader, p1.leader_epoch) == (ErrorCode.NONE, 2, 5)
    assert list(p1.replicas) == [1, 2, 3]
    assert list(p1.isr) == [1, 2, 3]
    assert list(p1.offline_replicas) == []


def test_topics_in_request_order_each_once(cache: MetadataCache) -> None:
    response = cache.describe(["orders", "missing", "audit", "orders", "missing"])
    assert [t.topic for t in response.topics] == ["orders", "missing", "audit"]
    assert [t.error_code for t in response.topics] == [
        ErrorCode.NONE,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.NONE,
    ]
    missing = response.topics[1]
    assert missing.error_message
    assert list(missing.partitions) == []


@pytest.mark.parametrize("name", ["bad/name", ".", "..", "x" * 250, ""])
def test_invalid_topic_names(cache: MetadataCache, name: str) -> None:
    [topic] = cache.describe([name]).topics
    assert topic.topic == name
    assert topic.error_code == ErrorCode.INVALID_TOPIC
    assert topic.error_message
    assert list(topic.partitions) == []


def test_delta_upserts_partitions_and_replaces_brokers(cache: MetadataCache) -> None:
    cache.apply(
        update(
            DELTA,
            3,
            [state("orders", 0, leader=3, isr=[3, 1], leader_epoch=1), state("events", 0)],
            brokers=[1, 3, 4],
        )
    )
    response = cache.describe([])
    assert [b.broker_id for b in response.brokers] == [1, 3, 4]
    assert [t.topic for t in response.topics] == ["audit", "events", "orders"]
    orders = response.topics[2]
    p0, p1 = orders.partitions
    assert (p0.leader, p0.leader_epoch, list(p0.isr)) == (3, 1, [3, 1])
    # Untouched by the delta, but its leader (broker 2) has left the live brokers.
    assert (p1.error_code, p1.leader, p1.leader_epoch) == (ErrorCode.LEADER_NOT_AVAILABLE, -1, 5)


def test_full_view_forgets_what_it_does_not_name(cache: MetadataCache) -> None:
    cache.apply(update(FULL, 4, [state("events", 0)], brokers=[1, 2, 3]))
    assert topic_codes(cache) == {"events": ErrorCode.NONE}
    assert topic_codes(cache, ["orders"]) == {"orders": ErrorCode.UNKNOWN_TOPIC_OR_PARTITION}
    assert cache.describe([]).controller.controller_epoch == 4


def test_same_epoch_full_view_is_accepted(cache: MetadataCache) -> None:
    cache.apply(update(FULL, 3, [state("audit", 0, leader=3)]))
    assert [p.leader for p in cache.describe(["audit"]).topics[0].partitions] == [3]
    assert topic_codes(cache) == {"audit": ErrorCode.NONE}


@pytest.mark.parametrize("kind", [FULL, DELTA])
def test_stale_controller_epoch_is_refused_and_changes_nothing(
    cache: MetadataCache, kind: int
) -> None:
    before = cache.describe([])
    with pytest.raises(StaleControllerEpoch) as refused:
        cache.apply(update(kind, 2, [state("orders", 0, leader=3)], brokers=[3], controller_id=8))
    assert refused.value.code == ErrorCode.STALE_CONTROLLER_EPOCH
    assert cache.describe([]) == before
    assert cache.controller_epoch == 3


def test_delta_before_any_full_view_is_refused() -> None:
    cache = MetadataCache()
    with pytest.raises(TidewaterError) as refused:
        cache.apply(update(DELTA, 1, [state("orders", 0)]))
    assert refused.value.code == ErrorCode.INVALID_UPDATE_VERSION
    assert not cache.ready
    assert list(cache.describe([]).topics) == []


def test_delta_of_a_newer_controller_needs_its_full_view_and_fences_the_old_one(
    cache: MetadataCache,
) -> None:
    before = cache.describe([])
    with pytest.raises(TidewaterError) as refused:
        cache.apply(update(DELTA, 4, [state("orders", 0, leader=3)], controller_id=8))
    assert refused.value.code == ErrorCode.INVALID_UPDATE_VERSION
    assert cache.describe([]) == before
    # The old view is still served, but its controller can no longer amend it.
    with pytest.raises(StaleControllerEpoch):
        cache.apply(update(DELTA, 3, [state("orders", 0, leader=3)]))
    cache.apply(update(FULL, 4, [state("orders", 0, leader=3)], controller_id=8))
    cache.apply(update(DELTA, 4, [state("orders", 1, leader=2)], controller_id=8))
    response = cache.describe(["orders"])
    assert [p.leader for p in response.topics[0].partitions] == [3, 2]
    assert response.controller.controller_id == 8


def test_deleted_topics_are_forgotten(cache: MetadataCache) -> None:
    cache.apply(update(DELTA, 3, deleted=["orders", "never-existed"]))
    assert topic_codes(cache) == {"audit": ErrorCode.NONE}
    assert topic_codes(cache, ["orders"]) == {"orders": ErrorCode.UNKNOWN_TOPIC_OR_PARTITION}


def test_topic_recreated_after_deletion_has_only_its_new_partitions(cache: MetadataCache) -> None:
    cache.apply(update(DELTA, 3, deleted=["orders"]))
    cache.apply(update(DELTA, 3, [state("orders", 0, leader=3)]))
    [orders] = cache.describe(["orders"]).topics
    assert [(p.partition, p.leader) for p in orders.partitions] == [(0, 3)]


def test_a_topic_is_served_with_its_id_and_replaced_by_one_of_another_id() -> None:
    """The controller's DELTA deleting a topic may not reach the service (it then gets a FULL
    view): a partition state under another topic id is a new topic, and the old one's other
    partitions go. Before, the old topic's partition 1 stayed, and no id was served."""
    old, new = uuid.uuid4().bytes, uuid.uuid4().bytes
    cache = MetadataCache()
    cache.apply(update(FULL, 3, [state("orders", p, leader_epoch=4, topic_id=old) for p in (0, 1)]))
    [orders] = cache.describe(["orders"]).topics
    assert orders.topic_id == old
    cache.apply(update(DELTA, 3, [state("orders", 0, leader=3, topic_id=new)]))
    [orders] = cache.describe(["orders"]).topics
    assert orders.topic_id == new
    assert [(p.partition, p.leader, p.leader_epoch) for p in orders.partitions] == [(0, 3, 0)]


@pytest.mark.parametrize(
    "request_",
    [
        update(FULL, 3, [state("orders", 0)], deleted=["audit"]),
        update(DELTA, 3, [state("orders", 0, leader=3)], deleted=["orders"]),
    ],
    ids=["deleted-topics-in-full", "deleted-and-updated"],
)
def test_self_contradicting_request_is_refused(
    cache: MetadataCache, request_: cluster_pb2.UpdateMetadataRequest
) -> None:
    before = cache.describe([])
    with pytest.raises(InvalidRequest):
        cache.apply(request_)
    assert cache.describe([]) == before


def test_offline_replicas_give_replica_not_available_until_their_broker_is_back(
    cache: MetadataCache,
) -> None:
    """Review 20 M1: a replica the partition's state marked offline stayed so after its
    broker was back (a DELTA names the live brokers only), until the partition's next change:
    after a controller failover, whose first view names no broker live yet, every partition
    whose ISR was full for good."""
    cache.apply(update(DELTA, 3, [state("orders", 0, isr=[1, 2], offline=[3])], brokers=[1, 2]))
    [p0, p1] = cache.describe(["orders"]).topics[0].partitions
    assert p0.error_code == ErrorCode.REPLICA_NOT_AVAILABLE
    assert p0.error_message
    assert (p0.leader, list(p0.offline_replicas)) == (1, [3])
    assert list(p0.replicas) == [1, 2, 3]
    cache.apply(update(DELTA, 3, brokers=[1, 2, 3]))  # broker 3 heartbeats again
    [p0, p1] = cache.describe(["orders"]).topics[0].partitions
    assert (p0.error_code, list(p0.offline_replicas)) == (ErrorCode.NONE, [])
    assert p1.error_code == ErrorCode.NONE


def test_replica_of_a_broker_no_longer_live_is_offline(cache: MetadataCache) -> None:
    cache.apply(update(DELTA, 3, brokers=[1, 2]))
    [p0, _] = cache.describe(["orders"]).topics[0].partitions
    assert p0.error_code == ErrorCode.REPLICA_NOT_AVAILABLE
    assert list(p0.offline_replicas) == [3]


def test_no_leader_gives_leader_not_available(cache: MetadataCache) -> None:
    cache.apply(update(DELTA, 3, [state("audit", 0, leader=-1, isr=[], leader_epoch=9)]))
    [p0] = cache.describe(["audit"]).topics[0].partitions
    assert p0.error_code == ErrorCode.LEADER_NOT_AVAILABLE
    assert p0.error_message
    assert (p0.leader, p0.leader_epoch, list(p0.replicas)) == (-1, 9, [1, 2, 3])


def test_eligible_leader_replicas_are_described(cache: MetadataCache) -> None:
    # KIP-966: what `topics describe` shows of an offline partition whose ISR emptied.
    offline = state("audit", 0, leader=-1, isr=[], leader_epoch=9)
    offline.eligible_leader_replicas.extend([2, 3])
    offline.last_known_elr.append(3)
    cache.apply(update(DELTA, 3, [offline]))
    [p0] = cache.describe(["audit"]).topics[0].partitions
    assert (list(p0.eligible_leader_replicas), list(p0.last_known_elr)) == ([2, 3], [3])
