from __future__ import annotations

import random
from collections import Counter

import pytest

from tidewater.controller.assignment import (
    Assignment,
    Broker,
    add_partitions,
    assign_replicas,
    validate_explicit_assignment,
    validate_partition_increase,
)
from tidewater.errors import (
    BrokerNotAvailable,
    InvalidPartitions,
    InvalidReplicationFactor,
    InvalidRequest,
)
from tidewater.v1.errors_pb2 import ErrorCode


def no_racks(*ids: int) -> list[Broker]:
    return [(b, None) for b in ids]


def with_racks(racks: dict[int, str]) -> list[Broker]:
    return list(racks.items())


def leader_counts(assignment: Assignment) -> Counter[int]:
    return Counter(replicas[0] for replicas in assignment.values())


def replica_counts(assignment: Assignment) -> Counter[int]:
    return Counter(b for replicas in assignment.values() for b in replicas)


def racks_of(assignment: Assignment, racks: dict[int, str]) -> list[set[str]]:
    return [{racks[b] for b in replicas} for replicas in assignment.values()]


# Rack-unaware


def test_kafka_replica_assignment_example() -> None:
    # AdminTest.testReplicaAssignment: 5 brokers, 10 partitions, RF 3, start index 0.
    assert assign_replicas(no_racks(0, 1, 2, 3, 4), 10, 3, start_index=0) == {
        0: (0, 1, 2),
        1: (1, 2, 3),
        2: (2, 3, 4),
        3: (3, 4, 0),
        4: (4, 0, 1),
        5: (0, 2, 3),
        6: (1, 3, 4),
        7: (2, 4, 0),
        8: (3, 0, 1),
        9: (4, 1, 2),
    }


def test_broker_order_given_does_not_matter() -> None:
    assert assign_replicas(no_racks(4, 2, 0, 3, 1), 10, 3, start_index=1) == assign_replicas(
        no_racks(0, 1, 2, 3, 4), 10, 3, start_index=1
    )


@pytest.mark.parametrize("seed", range(5))
def test_leaders_and_followers_spread_evenly_from_a_random_start(seed: int) -> None:
    brokers = no_racks(*range(10, 16))
    assignment = assign_replicas(brokers, 24, 3, rng=random.Random(seed))
    assert sorted(assignment) == list(range(24))
    assert all(len(set(replicas)) == 3 for replicas in assignment.values())
    assert set(leader_counts(assignment).values()) == {4}
    assert set(replica_counts(assignment).values()) == {12}


def test_random_start_is_drawn_from_the_rng() -> None:
    brokers = no_racks(*range(6))
    starts = {assign_replicas(brokers, 1, 2, rng=random.Random(seed))[0] for seed in range(20)}
    assert len(starts) > 1
    assert assign_replicas(brokers, 6, 2, rng=random.Random(3)) == assign_replicas(
        brokers, 6, 2, rng=random.Random(3)
    )


def test_replication_factor_of_every_broker() -> None:
    assignment = assign_replicas(no_racks(1, 2, 3), 3, 3, start_index=0)
    assert all(sorted(replicas) == [1, 2, 3] for replicas in assignment.values())
    assert set(leader_counts(assignment).values()) == {1}


@pytest.mark.parametrize("rf", [0, -1, 6])
def test_replication_factor_below_one_or_above_live_brokers_is_invalid(rf: int) -> None:
    with pytest.raises(InvalidReplicationFactor) as raised:
        assign_replicas(no_racks(0, 1, 2, 3, 4), 10, rf)
    assert raised.value.code == ErrorCode.INVALID_REPLICATION_FACTOR


@pytest.mark.parametrize("partitions", [0, -3])
def test_partition_count_below_one_is_invalid(partitions: int) -> None:
    with pytest.raises(InvalidPartitions) as raised:
        assign_replicas(no_racks(0, 1, 2), partitions, 1)
    assert raised.value.code == ErrorCode.INVALID_PARTITIONS


# Rack-aware

SIX_ON_THREE_RACKS = {0: "rack1", 1: "rack3", 2: "rack3", 3: "rack2", 4: "rack2", 5: "rack1"}


def test_kafka_rack_aware_example() -> None:
    # AdminRackAwareTest.testGetRackAlternatedBrokerListAndAssignReplicasToBrokers.
    assert assign_replicas(with_racks(SIX_ON_THREE_RACKS), 7, 3, start_index=0) == {
        0: (0, 3, 1),
        1: (3, 1, 5),
        2: (1, 5, 4),
        3: (5, 4, 2),
        4: (4, 2, 0),
        5: (2, 0, 3),
        6: (0, 4, 2),
    }


def test_leaders_follow_the_rack_alternated_broker_list() -> None:
    # One rack at a time, in rack order, by id within a rack.
    five = {b: r for b, r in SIX_ON_THREE_RACKS.items() if b != 5}
    assignment = assign_replicas(with_racks(five), 5, 1, start_index=0)
    assert [assignment[p][0] for p in range(5)] == [0, 3, 1, 4, 2]


@pytest.mark.parametrize("start_index", [None, 0, 2, 5])
def test_rack_aware_puts_each_partition_on_distinct_racks(start_index: int | None) -> None:
    racks = {0: "rack1", 1: "rack2", 2: "rack2", 3: "rack3", 4: "rack3", 5: "rack1"}
    assignment = assign_replicas(
        with_racks(racks), 12, 3, start_index=start_index, rng=random.Random(1)
    )
    assert all(len(r) == 3 for r in racks_of(assignment, racks))
    assert set(leader_counts(assignment).values()) == {2}
    assert set(replica_counts(assignment).values()) == {6}


def test_rack_aware_with_uneven_racks_still_spreads_leaders() -> None:
    racks = {0: "rack1", 1: "rack1", 2: "rack2", 3: "rack3", 4: "rack3", 5: "rack1"}
    assignment = assign_replicas(with_racks(racks), 12, 3, start_index=2)
    assert all(len(r) == 3 for r in racks_of(assignment, racks))
    assert set(leader_counts(assignment).values()) == {2}


def test_more_replicas_than_racks_uses_every_rack() -> None:
    assignment = assign_replicas(with_racks(SIX_ON_THREE_RACKS), 6, 5, start_index=0)
    assert all(len(r) == 3 for r in racks_of(assignment, SIX_ON_THREE_RACKS))
    assert all(len(set(replicas)) == 5 for replicas in assignment.values())


def test_a_replica_on_every_broker_despite_crowded_racks() -> None:
    # Rack a holds three of five brokers: once every rack has a replica, brokers already
    # holding one must still be skipped.
    racks = {0: "a", 1: "b", 2: "c", 3: "a", 4: "a"}
    for start in range(5):
        assignment = assign_replicas(with_racks(racks), 6, 5, start_index=start)
        assert all(sorted(replicas) == [0, 1, 2, 3, 4] for replicas in assignment.values())


def test_single_rack_spreads_like_rack_unaware() -> None:
    racks = dict.fromkeys(range(6), "rack1")
    assignment = assign_replicas(with_racks(racks), 12, 3, start_index=1)
    assert all(len(set(replicas)) == 3 for replicas in assignment.values())
    assert set(leader_counts(assignment).values()) == {2}
    assert set(replica_counts(assignment).values()) == {6}


def test_a_broker_without_rack_makes_the_assignment_rack_unaware() -> None:
    brokers: list[Broker] = [(0, "rack1"), (1, "rack1"), (2, ""), (3, "rack2")]
    assert assign_replicas(brokers, 8, 2, start_index=1) == assign_replicas(
        no_racks(0, 1, 2, 3), 8, 2, start_index=1
    )


# CreatePartitions


def test_kafka_add_partitions_on_all_servers() -> None:
    # AddPartitionsTest.testReplicaPlacementAllServers: partition 0 on (2, 3, 0, 1), grow to 7.
    added = add_partitions(no_racks(0, 1, 2, 3), {0: (2, 3, 0, 1)}, 7)
    assert sorted(added) == [1, 2, 3, 4, 5, 6]
    assert [added[p][0] for p in sorted(added)] == [3, 0, 1, 2, 3, 0]
    assert all(sorted(replicas) == [0, 1, 2, 3] for replicas in added.values())


def test_kafka_add_partitions_on_some_servers() -> None:
    # AddPartitionsTest.testReplicaPlacementPartialServers: partition 0 on (1, 2), grow to 3.
    assert add_partitions(no_racks(0, 1, 2, 3), {0: (1, 2)}, 3) == {1: (2, 0), 2: (3, 1)}


def test_added_partitions_continue_the_leader_rotation() -> None:
    brokers = no_racks(*range(5))
    existing = assign_replicas(brokers, 5, 2, rng=random.Random(9))
    added = add_partitions(brokers, existing, 15)
    grown = {**existing, **added}
    assert sorted(grown) == list(range(15))
    assert set(leader_counts(grown).values()) == {3}
    assert all(len(set(replicas)) == 2 for replicas in added.values())


def test_rack_aware_expansion() -> None:
    # AdminRackAwareTest.testRackAwareExpansion: 12 more partitions with RF 2.
    racks = {6: "rack1", 7: "rack2", 8: "rack2", 9: "rack3", 10: "rack3", 11: "rack1"}
    existing = assign_replicas(with_racks(racks), 12, 2, start_index=0)
    added = add_partitions(with_racks(racks), existing, 24)
    assert sorted(added) == list(range(12, 24))
    assert all(len(r) == 2 for r in racks_of(added, racks))
    assert set(leader_counts(added).values()) == {2}
    assert set(replica_counts(added).values()) == {4}


@pytest.mark.parametrize("new_count", [3, 2, 0])
def test_partition_count_can_only_grow(new_count: int) -> None:
    existing = {0: (1, 2), 1: (2, 1), 2: (1, 2)}
    with pytest.raises(InvalidPartitions) as raised:
        add_partitions(no_racks(1, 2), existing, new_count)
    assert raised.value.code == ErrorCode.INVALID_PARTITIONS
    with pytest.raises(InvalidPartitions):
        validate_partition_increase(existing, new_count)


def test_added_partitions_need_the_topics_replication_factor_in_live_brokers() -> None:
    with pytest.raises(InvalidReplicationFactor):
        add_partitions(no_racks(1, 2), {0: (1, 2, 3)}, 2)


# Explicit assignments


def test_explicit_assignment_is_kept_in_partition_order() -> None:
    assert validate_explicit_assignment({1: [3, 1], 0: [1, 2]}, {1, 2, 3}) == {
        0: (1, 2),
        1: (3, 1),
    }


@pytest.mark.parametrize(
    "assignment",
    [{0: (1, 2), 2: (2, 1)}, {1: (1, 2)}, {}],
    ids=["gap", "not-from-zero", "empty"],
)
def test_explicit_assignment_must_name_partitions_from_zero_without_gaps(
    assignment: dict[int, tuple[int, ...]],
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        validate_explicit_assignment(assignment, {1, 2}, partitions=range(2))
    assert raised.value.code == ErrorCode.INVALID_REQUEST


def test_explicit_assignment_rejects_a_broker_named_twice() -> None:
    with pytest.raises(InvalidRequest, match="twice"):
        validate_explicit_assignment({0: (1, 2), 1: (2, 2)}, {1, 2})


def test_explicit_assignment_needs_one_replication_factor() -> None:
    with pytest.raises(InvalidRequest, match="expected 2"):
        validate_explicit_assignment({0: (1, 2), 1: (1, 2, 3)}, {1, 2, 3})


def test_explicit_assignment_needs_replicas() -> None:
    with pytest.raises(InvalidReplicationFactor):
        validate_explicit_assignment({0: ()}, {1, 2})


def test_explicit_assignment_needs_registered_brokers() -> None:
    with pytest.raises(BrokerNotAvailable) as raised:
        validate_explicit_assignment({0: (1, 7), 1: (9, 1)}, {1, 2})
    assert raised.value.code == ErrorCode.BROKER_NOT_AVAILABLE
    assert "[7]" in str(raised.value)


def test_explicit_placement_of_added_partitions() -> None:
    # Topic with 2 partitions and RF 2 grows to 4.
    placed = validate_explicit_assignment(
        {2: (3, 1), 3: (1, 2)}, {1, 2, 3}, partitions=range(2, 4), replication_factor=2
    )
    assert placed == {2: (3, 1), 3: (1, 2)}
    with pytest.raises(InvalidRequest):
        validate_explicit_assignment(
            {2: (3, 1, 2), 3: (1, 2, 3)}, {1, 2, 3}, partitions=range(2, 4), replication_factor=2
        )
    with pytest.raises(InvalidRequest):
        validate_explicit_assignment(
            {0: (3, 1), 1: (1, 2)}, {1, 2, 3}, partitions=range(2, 4), replication_factor=2
        )
