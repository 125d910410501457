"""Replica assignment for CreateTopics and CreatePartitions, as Kafka's AdminUtils does it.

Rack-unaware: partition p's preferred replica is broker (start + p) mod n, so leaders spread
evenly; its followers follow at a shift that grows by one every n partitions, so followers
spread too. Rack-aware (every broker has a rack): the same walk over the brokers listed
alternately by rack, skipping a broker whose rack (or itself) already holds a replica of the
partition while some rack (or broker) holds none. Brokers without a rack in a cluster that
has racks make the assignment rack-unaware (Kafka's RackAwareMode.Safe).

CreatePartitions with an explicit placement: `validate_partition_increase`, then
`validate_explicit_assignment` over `range(current, count)` with the topic's replication factor.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence

from tidewater.errors import (
    BrokerNotAvailable,
    InvalidPartitions,
    InvalidReplicaAssignment,
    InvalidReplicationFactor,
    InvalidRequest,
)

# (broker id, rack); None or "" when the broker has no rack.
Broker = tuple[int, str | None]
Assignment = dict[int, tuple[int, ...]]


def assign_replicas(
    brokers: Sequence[Broker],
    num_partitions: int,
    replication_factor: int,
    *,
    start_index: int | None = None,
    first_partition: int = 0,
    rng: random.Random | None = None,
) -> Assignment:
    """Replicas for partitions first_partition.. on the given (live) brokers, preferred
    leader first. A start index makes it deterministic (Kafka's fixedStartIndex: it also fixes
    the first follower shift); without one both are drawn from rng."""
    if num_partitions < 1:
        raise InvalidPartitions(f"number of partitions must be at least 1, got {num_partitions}")
    if replication_factor < 1:
        raise InvalidReplicationFactor(
            f"replication factor must be at least 1, got {replication_factor}"
        )
    if replication_factor > len(brokers):
        raise InvalidReplicationFactor(
            f"replication factor {replication_factor} is larger than the {len(brokers)} "
            "available brokers"
        )
    racks = {broker_id: rack for broker_id, rack in sorted(brokers) if rack}
    rack_aware = len(racks) == len(brokers)
    broker_list = _rack_alternated(racks) if rack_aware else [b for b, _ in sorted(brokers)]
    n = len(broker_list)
    rng = rng or random.Random()
    start = start_index if start_index is not None else rng.randrange(n)
    shift = start_index if start_index is not None else rng.randrange(n)
    assignment = {}
    for partition in range(first_partition, first_partition + num_partitions):
        if partition > 0 and partition % n == 0:
            shift += 1
        first = (partition + start) % n
        if rack_aware:
            replicas = _rack_aware_replicas(broker_list, racks, first, shift, replication_factor)
        else:
            replicas = [broker_list[first]] + [
                broker_list[_replica_index(first, shift, j, n)]
                for j in range(replication_factor - 1)
            ]
        assignment[partition] = tuple(replicas)
    return assignment


def add_partitions(
    brokers: Sequence[Broker],
    existing: Mapping[int, Sequence[int]],
    new_count: int,
    *,
    rng: random.Random | None = None,
) -> Assignment:
    """CreatePartitions: replicas for partitions len(existing)..new_count-1, with partition 0's
    replication factor, continuing from where partition 0's preferred leader sits in the broker
    list (Kafka's AdminZkClient.createPartitions)."""
    validate_partition_increase(existing, new_count)
    first_replicas = existing[0]
    ids = sorted(b for b, _ in brokers)
    start = next((i for i, b in enumerate(ids) if b >= first_replicas[0]), 0)
    return assign_replicas(
        brokers,
        new_count - len(existing),
        len(first_replicas),
        start_index=start,
        first_partition=len(existing),
        rng=rng,
    )


def validate_partition_increase(existing: Mapping[int, Sequence[int]], new_count: int) -> None:
    if new_count <= len(existing):
        raise InvalidPartitions(
            f"the number of partitions can only grow: the topic has {len(existing)}, "
            f"{new_count} is not more"
        )


def validate_explicit_assignment(
    assignment: Mapping[int, Sequence[int]],
    registered: Collection[int],
    *,
    usable: Collection[int] | None = None,
    partitions: range | None = None,
    replication_factor: int | None = None,
) -> Assignment:
    """An assignment given in the request: exactly the expected partitions (default 0..n-1),
    each with the same number (the topic's, if given) of distinct, registered brokers, at
    least one of them `usable` (default: every registered one), as Kafka's createTopic: a
    partition with none could get no leader, and would stay offline once they came back
    (it would have no ISR to elect from)."""
    expected = partitions if partitions is not None else range(len(assignment))
    if sorted(assignment) != list(expected):
        raise InvalidRequest(
            f"the assignment must name partitions {expected.start}..{expected.stop - 1} once "
            f"each, got {sorted(assignment)}"
        )
    rf = replication_factor
    for partition, replicas in sorted(assignment.items()):
        if not replicas:
            raise InvalidReplicationFactor(f"partition {partition} has no replicas")
        if rf is None:
            rf = len(replicas)  # the first partition's sets the rule
        if len(set(replicas)) != len(replicas):
            raise InvalidRequest(f"partition {partition} names a broker twice: {list(replicas)}")
        if len(replicas) != rf:
            raise InvalidRequest(
                f"partition {partition} has {len(replicas)} replicas, expected {rf} like the "
                "other partitions"
            )
        unknown = sorted(set(replicas) - set(registered))
        if unknown:
            raise BrokerNotAvailable(f"partition {partition}: brokers {unknown} are not registered")
        if usable is not None and not set(replicas) & set(usable):
            raise InvalidReplicaAssignment(
                f"partition {partition}: none of brokers {list(replicas)} is alive and not "
                "shutting down"
            )
    return {partition: tuple(replicas) for partition, replicas in sorted(assignment.items())}


def _replica_index(first: int, shift: int, j: int, n: int) -> int:
    """The j-th follower's index: 1 + (shift + j) mod (n - 1) after the preferred replica, so it
    never lands on the preferred replica itself."""
    return (first + 1 + (shift + j) % (n - 1)) % n


def _rack_alternated(racks: Mapping[int, str]) -> list[int]:
    """Brokers taken one rack at a time in rack order, by id within a rack:
    {0: a, 1: c, 2: c, 3: b, 4: b, 5: a} → [0, 3, 1, 5, 4, 2]."""
    by_rack: dict[str, list[int]] = {}
    for broker_id, rack in sorted(racks.items()):
        by_rack.setdefault(rack, []).append(broker_id)
    columns = [by_rack[rack] for rack in sorted(by_rack)]
    depth = max(len(column) for column in columns)
    return [column[i] for i in range(depth) for column in columns if i < len(column)]


def _rack_aware_replicas(
    broker_list: Sequence[int],
    racks: Mapping[int, str],
    first: int,
    shift: int,
    replication_factor: int,
) -> list[int]:
    n = len(broker_list)
    num_racks = len(set(racks.values()))
    leader = broker_list[first]
    replicas = [leader]
    racks_used = {racks[leader]}
    k = 0
    while len(replicas) < replication_factor:
        broker = broker_list[_replica_index(first, shift * num_racks, k, n)]
        k += 1
        rack = racks[broker]
        # RF <= n, so some broker always holds no replica yet: never take one twice. Skip a
        # broker whose rack already holds a replica while some rack holds none.
        if broker in replicas or (rack in racks_used and len(racks_used) < num_racks):
            continue
        replicas.append(broker)
        racks_used.add(rack)
    return replicas
