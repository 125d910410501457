"""The producer's own cost, no broker: records/s the accumulator batches and build_batch
encodes, for 100-byte values on one core (issue 5's goal: >= 300,000 records/s). Prints the
rate per CPU second of this process (what one core does, whatever else shares the machine) and
per wall-clock second.

Run: .venv/bin/python tests/benchmarks/bench_client.py [records]"""

from __future__ import annotations

import asyncio
import sys
import time

from tidewater.client.accumulator import RecordAccumulator, estimate_size
from tidewater.records.batch import Record
from tidewater.records.header import Compression

BATCH_SIZE = 16384
PARTITIONS = 6


def drain(accumulator: RecordAccumulator, tp: tuple[str, int]) -> None:
    """What the sender does with a ready batch, minus the network: build it, and release it
    as an acknowledgement would."""
    queue = accumulator.queues[tp]
    while queue:
        batch = queue.popleft()
        batch.build(Compression.NONE, 0)
        accumulator.incomplete.discard(batch)


async def run(count: int) -> tuple[float, float]:
    accumulator = RecordAccumulator(BATCH_SIZE, asyncio.get_running_loop())
    value = bytes(100)
    size = estimate_size(None, value, ())
    start, start_cpu = time.perf_counter(), time.process_time()
    now = time.monotonic()
    for i in range(count):
        tp = ("bench", i % PARTITIONS)
        _, batch = accumulator.append(tp, Record(None, value), size, now)
        if batch.closed:
            drain(accumulator, tp)
    for tp in accumulator.queues:
        drain(accumulator, tp)
    return count / (time.process_time() - start_cpu), count / (time.perf_counter() - start)


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    cpu_rate, wall_rate = asyncio.run(run(count))
    print(
        f"{count} records of 100 B, batch.size {BATCH_SIZE}: {cpu_rate:,.0f} records per CPU "
        f"second ({wall_rate:,.0f} per wall second)"
    )


if __name__ == "__main__":
    main()
