"""What the benchmarks share to start a broker and measure processes: a broker leading a
partition alone, the CPU time and resident memory of a process (from /proc), and a drain of
the page cache's writeback between phases."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc

from tidewater.local.process import ManagedProcess
from tidewater.local.standin_controller import make_leader

TOPIC = "bench"


async def lead_alone(broker: ManagedProcess, broker_id: int) -> str:
    """Start a broker process and make it the only replica, and leader, of TOPIC-0; returns its
    address."""
    address = broker.start()
    async with grpc.aio.insecure_channel(address) as channel:
        await make_leader(channel, TOPIC, 0, leader=broker_id, leader_epoch=1, replicas=[broker_id])
    return address


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def drain_writeback() -> None:
    await asyncio.to_thread(os.sync)
