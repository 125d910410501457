from __future__ import annotations

import pytest

from tidewater.client.partitioner import StickyPartitioner, murmur2, partition_for_key

# Kafka's UtilsTest.testMurmur2.
KAFKA_VECTORS = {
    "21": -973932308,
    "foobar": -790332482,
    "a-little-bit-long-string": -985981536,
    "a-little-bit-longer-string": -1486304829,
    "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    "abc": 479470107,
}


@pytest.mark.parametrize(("key", "expected"), KAFKA_VECTORS.items())
def test_murmur2_matches_kafka(key: str, expected: int) -> None:
    assert murmur2(key.encode()) == expected


def test_murmur2_of_bytes() -> None:
    assert murmur2(bytes([ord("a"), ord("b"), ord("c")])) == 479470107


# Partitions Kafka's Java partitioner picks among 1,000 (recorded by kafka-python's
# test_murmur2_java_compatibility against org.apache.kafka.clients.producer.Partitioner).
KAFKA_PARTITIONS_OF_1000 = {
    b"": 681,
    b"a": 524,
    b"ab": 434,
    b"abc": 107,
    b"123456789": 566,
    b"\x00 ": 742,
}


@pytest.mark.parametrize(("key", "expected"), KAFKA_PARTITIONS_OF_1000.items())
def test_keys_land_on_the_partition_kafka_picks(key: bytes, expected: int) -> None:
    assert partition_for_key(key, 1000) == expected


def test_keys_land_where_kafka_puts_them() -> None:
    # toPositive(murmur2(key)) % n, computed from the vectors above.
    assert partition_for_key(b"foobar", 10) == (-790332482 & 0x7FFFFFFF) % 10
    assert partition_for_key(b"21", 7) == (-973932308 & 0x7FFFFFFF) % 7
    assert all(partition_for_key(b"same", 12) == partition_for_key(b"same", 12) for _ in range(3))


def test_sticky_partition_holds_until_batch_closes_and_avoids_unavailable() -> None:
    queues = {0: 0, 1: 5, 2: 0, 3: 0}
    partitioner = StickyPartitioner(lambda _topic, p: queues[p], lambda _topic, p: p != 3)
    first = partitioner.partition("t", 4)
    assert first in (0, 2)
    assert all(partitioner.partition("t", 4) == first for _ in range(10))
    partitioner.batch_closed("t", first)
    queues[first] = 9
    assert partitioner.partition("t", 4) == ({0, 2} - {first}).pop()
