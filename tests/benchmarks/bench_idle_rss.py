"""Broker resident memory with 1,000 idle partitions it leads.

.venv/bin/python tests/benchmarks/bench_idle_rss.py [--partitions 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import grpc
from harness import cpu_seconds, rss_mib

from tidewater.local.process import broker_process
from tidewater.local.standin_controller import leader_and_isr_request
from tidewater.v1 import broker_pb2_grpc


async def main(partitions: int, idle_s: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        broker = broker_process(1, Path(tmp), {})
        address = broker.start()
        try:
            empty = rss_mib(broker.pid)
            request = leader_and_isr_request("idle", 0, leader=1, leader_epoch=1, replicas=[1])
            template = request.partition_states[0]
            del request.partition_states[:]
            for p in range(partitions):
                state = request.partition_states.add()
                state.CopyFrom(template)
                state.partition = p
            async with grpc.aio.insecure_channel(address) as channel:
                response = await broker_pb2_grpc.BrokerControlStub(channel).LeaderAndIsr(request)
                assert not any(e.error_code for e in response.partition_errors)
            cpu_before = cpu_seconds(broker.pid)
            time.sleep(idle_s)
            cpu = (cpu_seconds(broker.pid) - cpu_before) / idle_s
            rss = rss_mib(broker.pid)
        finally:
            broker.stop()
    print(f"RSS with no partitions      {empty:7.1f} MiB")
    print(f"RSS with {partitions} partitions  {rss:7.1f} MiB")
    print(f"idle CPU                     {cpu * 100:6.2f} % of a core over {idle_s} s")
    print(
        f"SUMMARY idle broker with {partitions} partitions: {rss:.0f} MiB RSS "
        f"({'meets' if rss < 200 else 'misses'} goal < 200 MiB), {cpu * 100:.1f}% CPU"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    args = parser.parse_args()
    asyncio.run(main(args.partitions, args.idle_seconds))
