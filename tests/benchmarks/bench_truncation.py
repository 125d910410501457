"""How long a follower's truncation holds the event loop: a follower log of N small
idempotent batches (10 producers, 100-byte values, one segment, nothing flushed) truncated by
its last 5 batches, three ways on fresh logs: the producer state undone from its journal
after the log was written out on a worker thread (what a diverged follower does), undone
without the write-out, and rebuilt from the log (the journal released up to the LEO, as a
truncation below the HW finds it: what every truncation did before the journal).

Run: .venv/bin/python tests/benchmarks/bench_truncation.py [--batches N]"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.log import Log
from tidewater.broker.partition import HostedPartition, replication_config
from tidewater.broker.topic_config import TopicConfig
from tidewater.records.batch import Record, build_batch
from tidewater.records.header import patch_base_offset_and_epoch
from tidewater.replication.partition import LeaderAndIsr, Partition

PRODUCERS = 10
CHUNK = 1000  # batches a follower append carries
MODES = ("journal, written out first", "journal", "rebuilt from the log")


def follower(directory: Path) -> HostedPartition:
    config = TopicConfig(log=LogConfig())
    log = Log.open(directory, config.log, 0)
    state = Partition("t", 0, 3, log, replication_config(config, 30_000), 0)
    state.make_follower(LeaderAndIsr(1, 1, (1, 2, 3), (1, 2, 3), 1))
    return HostedPartition(state, log, config, lambda: 1_000)


async def fill(hosted: HostedPartition, batches: int) -> int:
    """Append `batches` one-record batches, as a follower; their size in bytes."""
    value = [Record(value=bytes(100))]
    templates = [
        bytearray(build_batch(value, producer_id=p, producer_epoch=0, base_sequence=0))
        for p in range(PRODUCERS)
    ]
    offset = 0
    while offset < batches:
        chunk = bytearray()
        for i in range(offset, min(offset + CHUNK, batches)):
            batch = bytearray(templates[i % PRODUCERS])
            patch_base_offset_and_epoch(batch, 0, i, 1)
            chunk += batch
        await hosted.append_as_follower(bytes(chunk))
        offset += CHUNK
    return batches * len(templates[0])


async def truncation_ms(root: Path, batches: int, mode: str) -> tuple[float, float, int]:
    """(ms on the loop, ms of the write-out off it, bytes) for one truncation in `mode`."""
    with tempfile.TemporaryDirectory(dir=root) as d:
        hosted = follower(Path(d) / "t-0")
        size = await fill(hosted, batches)
        written_out = 0.0
        if mode == MODES[0]:
            start = time.perf_counter()
            await hosted.log.write_out()
            written_out = (time.perf_counter() - start) * 1000
        elif mode == MODES[2]:
            hosted.producer_state.release(hosted.log.log_end_offset)
        start = time.perf_counter()
        hosted.truncate_to(batches - 5)
        on_loop = (time.perf_counter() - start) * 1000
        hosted.log.close()
        return on_loop, written_out, size


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=300_000)
    args = parser.parse_args()
    root = Path(tempfile.gettempdir())
    results = {}
    for mode in MODES:
        on_loop, written_out, size = await truncation_ms(root, args.batches, mode)
        results[mode] = on_loop
        extra = f" (write-out off the loop {written_out:.1f} ms)" if mode == MODES[0] else ""
        print(
            f"{args.batches:,} batches ({size / 1e6:.0f} MB), {mode}: "
            f"{on_loop:.1f} ms on the loop{extra}"
        )
    print(
        f"SUMMARY truncation of {args.batches:,} small batches: on the loop "
        + ", ".join(f"{mode} {ms:.1f} ms" for mode, ms in results.items())
    )


if __name__ == "__main__":
    asyncio.run(main())
