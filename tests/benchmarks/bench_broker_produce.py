"""Broker produce throughput over gRPC (acks=1, 1 MiB batches of 1 KiB records) as a ratio of a
bare grpc.aio echo server receiving the same bytes, measured in the same run.

    .venv/bin/python tests/benchmarks/bench_broker_produce.py [--seconds 5] [--in-flight 4]

Both servers run as child processes; the client sends identical pre-serialized ProduceRequest
bytes to each, so client cost is the same and only the server side differs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from tidewater.local.process import ManagedProcess, broker_args
from tidewater.local.standin_controller import make_leader
from tidewater.records.batch import Record, build_batch
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2 as pb

PRODUCE = "/tidewater.v1.BrokerService/Produce"
ECHO = "/bench.Echo/Receive"


async def echo_server(ready_file: Path) -> None:
    """A grpc.aio server with no Tidewater code: takes the bytes, answers a few bytes."""

    async def receive(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"ok"

    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Receive": grpc.unary_unary_rpc_method_handler(receive)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ready_file.write_text(f"127.0.0.1:{port}")
    await server.wait_for_termination()


def check_produced(response: bytes) -> bytes:
    """Count only real appends: a rejected batch must not pass for throughput."""
    result = pb.ProduceResponse.FromString(response).partitions[0]
    if result.error_code:
        raise RuntimeError(f"produce failed: {result.error_message}")
    return response


async def drive(address: str, method: str, payload: bytes, seconds: float, in_flight: int) -> float:
    """Send payload back to back with `in_flight` concurrent calls; return MB/s."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        check = check_produced if method == PRODUCE else None
        call = channel.unary_unary(method, response_deserializer=check)
        for _ in range(3):
            await call(payload)  # warm up
        sent = 0
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()

        async def worker() -> None:
            nonlocal sent
            while time.perf_counter() < deadline:
                await call(payload)
                sent += len(payload)

        await asyncio.gather(*(worker() for _ in range(in_flight)))
        return sent / (time.perf_counter() - started) / 1e6


async def main(seconds: float, in_flight: int) -> None:
    # 1000 records of 1 KiB: just under the default max.message.bytes (1048588).
    batch = build_batch([Record(value=os.urandom(1024)) for _ in range(1000)])
    payload = pb.ProduceRequest(
        acks=1, partitions=[pb.PartitionProduceData(topic="bench", partition=0, record_batch=batch)]
    ).SerializeToString()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ready = root / "echo.ready"
        echo = subprocess.Popen([sys.executable, __file__, "--echo-server", str(ready)])
        broker = ManagedProcess("broker-1", broker_args(1, root / "b1", "127.0.0.1:0", {}), root)
        try:
            address = broker.start()
            async with grpc.aio.insecure_channel(address) as channel:
                await make_leader(channel, "bench", 0, leader=1, leader_epoch=1, replicas=[1])
            while not ready.exists():
                await asyncio.sleep(0.05)
            echo_mbs = await drive(ready.read_text(), ECHO, payload, seconds, in_flight)
            broker_mbs = await drive(address, PRODUCE, payload, seconds, in_flight)
        finally:
            broker.stop()
            echo.kill()
    ratio = broker_mbs / echo_mbs
    print(
        f"batch size        {len(batch) / 2**20:.2f} MiB, {in_flight} in flight, {seconds} s each"
    )
    print(f"bare grpc.aio echo {echo_mbs:8.1f} MB/s")
    print(f"tidewater produce  {broker_mbs:8.1f} MB/s  (acks=1)")
    print(
        f"SUMMARY broker produce {broker_mbs:.1f} MB/s = {ratio:.2f} x bare echo "
        f"({'meets' if ratio >= 0.6 else 'misses'} goal 0.6)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--echo-server", type=Path)
    args = parser.parse_args()
    if args.echo_server:
        asyncio.run(echo_server(args.echo_server))
    else:
        asyncio.run(main(args.seconds, args.in_flight))
