"""Which partition a record goes to: Kafka's default partitioner for keyed records (murmur2,
so the same keys land on the same partitions as with Kafka's clients), and a sticky, adaptive
choice for keyless ones (KIP-480 / KIP-794)."""

from __future__ import annotations

import random
from collections.abc import Callable

_M = 0x5BD1E995
_SEED = 0x9747B28C
_MASK32 = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's `Utils.murmur2`: the 32-bit MurmurHash2 of `data`, as a signed int."""
    length = len(data)
    h = (_SEED ^ length) & _MASK32
    end4 = length & ~3
    for i in range(0, end4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK32
        k ^= k >> 24
        k = (k * _M) & _MASK32
        h = ((h * _M) & _MASK32) ^ k
    tail = length & 3
    if tail:
        if tail == 3:
            h ^= data[end4 + 2] << 16
        if tail >= 2:
            h ^= data[end4 + 1] << 8
        h ^= data[end4]
        h = (h * _M) & _MASK32
    h ^= h >> 13
    h = (h * _M) & _MASK32
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for_key(key: bytes, num_partitions: int) -> int:
    """Kafka's default partitioner: `toPositive(murmur2(key)) % numPartitions`."""
    return (murmur2(key) & 0x7FFFFFFF) % num_partitions


class StickyPartitioner:
    """Keyless records stick to one partition per topic until that partition's batch is
    closed (full or sent), then move on. The next partition is drawn among those whose leader
    is available, preferring the shortest queues: a partition behind a slow or unreachable
    leader builds a queue and stops being chosen, which is the seed's adaptive partitioning
    kept simple."""

    def __init__(
        self,
        queue_length: Callable[[str, int], int],
        available: Callable[[str, int], bool],
        rng: random.Random | None = None,
    ) -> None:
        self._queue_length = queue_length
        self._available = available
        self._rng = rng or random.Random()
        self._sticky: dict[str, int] = {}

    def partition(self, topic: str, num_partitions: int) -> int:
        current = self._sticky.get(topic)
        if current is None or current >= num_partitions:
            current = self._sticky[topic] = self._choose(topic, num_partitions)
        return current

    def batch_closed(self, topic: str, partition: int) -> None:
        """The batch the sticky partition was filling is closed: pick anew on the next
        record."""
        if self._sticky.get(topic) == partition:
            del self._sticky[topic]

    def _choose(self, topic: str, num_partitions: int) -> int:
        candidates = [p for p in range(num_partitions) if self._available(topic, p)]
        if not candidates:
            return self._rng.randrange(num_partitions)
        lengths = {p: self._queue_length(topic, p) for p in candidates}
        shortest = min(lengths.values())
        return self._rng.choice([p for p in candidates if lengths[p] == shortest])
