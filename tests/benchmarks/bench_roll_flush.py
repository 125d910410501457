"""How long an append waits across segment rolls: the rolled segment's fsync on the event loop
(as before) vs in the LogManager's worker thread.

    .venv/bin/python tests/benchmarks/bench_roll_flush.py [--mib 400] [--segment-mib 128]
        [--rounds 2]

Appends 1 MiB batches (1,000 x 1 KiB records) paced every 5 ms on an event loop, through a
real LogManager in a temporary directory, and prints per-append p50/p99/max for each mode,
alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.manager import LogManager
from tidewater.records.batch import Record, build_batch

MODES = ("on the loop", "in a thread")
PACE_S = 0.005


async def appends_ms(root: Path, background: bool, mib: int, segment_mib: int) -> list[float]:
    config = LogConfig(segment_bytes=segment_mib << 20)
    manager = LogManager([root], config)
    try:
        log = manager.get_or_create_log("roll", 0, config)
        if not background:
            log.flush_in_background = None  # the roll flushes inside the append
        batch = build_batch([Record(value=os.urandom(1024)) for _ in range(1000)])
        times = []
        for _ in range(mib):
            started = time.perf_counter()
            log.append_as_leader(bytearray(batch), leader_epoch=1)
            times.append((time.perf_counter() - started) * 1e3)
            await asyncio.sleep(PACE_S)
        while log.recovery_point < log.segments[-1].base_offset:
            await asyncio.sleep(0.05)  # the last background flush, before the next round
        return sorted(times)
    finally:
        manager.shutdown()


async def main(args: argparse.Namespace) -> None:
    worst = dict.fromkeys(MODES, 0.0)
    for round_ in range(1, args.rounds + 1):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as tmp:
                times = await appends_ms(Path(tmp), mode == MODES[1], args.mib, args.segment_mib)
            p99 = times[int(len(times) * 0.99)]
            worst[mode] = max(worst[mode], times[-1])
            print(
                f"round {round_}: fsync {mode:11}  p50 {times[len(times) // 2]:6.2f} ms  "
                f"p99 {p99:6.1f} ms  max {times[-1]:6.1f} ms",
                flush=True,
            )
    print(
        f"SUMMARY roll flush: worst append {worst[MODES[0]]:.1f} ms with the fsync on the loop, "
        f"{worst[MODES[1]]:.1f} ms in a thread ({args.mib} x 1 MiB, {args.segment_mib} MiB "
        f"segments, load average {os.getloadavg()[0]:.2f})"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=400, help="1 MiB appends per run")
    parser.add_argument("--segment-mib", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
