"""Broker produce throughput over gRPC (acks=1, 1 MiB batches of 1 KiB records) as a ratio of a
bare grpc.aio echo server receiving the same bytes, measured in the same run.

    .venv/bin/python tests/benchmarks/bench_broker_produce.py [--seconds 3] [--rounds 3]
        [--in-flight 4] [--drop-behind BYTES] [--compression gzip|lz4|zstd]

All servers run as child processes; the client sends identical pre-serialized ProduceRequest
bytes to each, so client cost is the same and only the server side differs. A second
reference appends what it receives to a file, as the log does: the gap between the two
references is what storing the bytes costs on this machine, which no broker avoids.

Rounds alternate the servers, each phase after a writeback drain, and the summary takes the
median of the per-round ratios, so load from other processes on a shared machine skews it
less. Each phase also reports the server's CPU time per MiB received.

With --compression the batch is compressed, its records made of words (about 3 x smaller
under gzip) rather than random bytes: the broker decompresses it to check its records, which
the references do not; CPU per MiB is then per MiB received, compressed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from bare_grpc import DROP_BEHIND_BYTES, SERVICE, AppendFile, serve
from harness import TOPIC, cpu_seconds, drain_writeback, lead_alone

from tidewater.local.process import broker_process
from tidewater.records.batch import Record, build_batch
from tidewater.records.header import Compression
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2 as pb

PRODUCE = "/tidewater.v1.BrokerService/Produce"
RECEIVE = f"/{SERVICE}/Receive"


def receive_handlers(append_to: Path | None, drop_behind: int) -> dict[str, grpc.RpcMethodHandler]:
    """No Tidewater code: takes the bytes and answers a few bytes. With `append_to`, first
    appends them to that file with the log's page cache policy (an AppendFile)."""
    out = AppendFile(append_to, drop_behind) if append_to else None

    async def receive(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if out is not None:
            out.write(request)
        return b"ok"

    return {"Receive": grpc.unary_unary_rpc_method_handler(receive)}


def start_reference(
    ready: Path, drop_behind: int, append_to: Path | None = None
) -> subprocess.Popen[bytes]:
    args = [sys.executable, __file__, "--reference", str(ready), "--drop-behind", str(drop_behind)]
    if append_to is not None:
        args += ["--append-to", str(append_to)]
    return subprocess.Popen(args)


def check_produced(response: bytes) -> bytes:
    """Count only real appends: a rejected batch must not pass for throughput."""
    result = pb.ProduceResponse.FromString(response).partitions[0]
    if result.error_code:
        raise RuntimeError(f"produce failed: {result.error_message}")
    return response


async def drive(
    address: str, method: str, payload: bytes, seconds: float, in_flight: int, server_pid: int
) -> tuple[float, float]:
    """Send payload back to back with `in_flight` concurrent calls; return MB/s and the
    server's CPU ms per MiB received."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        check = check_produced if method == PRODUCE else None
        call = channel.unary_unary(method, response_deserializer=check)
        for _ in range(3):
            await call(payload)  # warm up
        await drain_writeback()
        sent = 0
        cpu_before = cpu_seconds(server_pid)
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()

        async def worker() -> None:
            nonlocal sent
            while time.perf_counter() < deadline:
                await call(payload)
                sent += len(payload)

        await asyncio.gather(*(worker() for _ in range(in_flight)))
        elapsed = time.perf_counter() - started
        cpu_ms = (cpu_seconds(server_pid) - cpu_before) * 1000
        return sent / elapsed / 1e6, cpu_ms / (sent / 2**20)


def record_values(compression: Compression) -> list[bytes]:
    """1000 records of 1 KiB: just under the default max.message.bytes (1048588) uncompressed.
    Random bytes, or for a compressed batch words that compress as text does."""
    if compression == Compression.NONE:
        return [os.urandom(1024) for _ in range(1000)]
    rng = random.Random(0)
    words = [
        bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(500)
    ]
    return [b" ".join(rng.choices(words, k=200))[:1024] for _ in range(1000)]


async def main(
    seconds: float, rounds: int, in_flight: int, drop_behind: int, compression: Compression
) -> None:
    batch = build_batch(
        [Record(value=v) for v in record_values(compression)], compression=compression
    )
    payload = pb.ProduceRequest(
        acks=1, partitions=[pb.PartitionProduceData(topic=TOPIC, partition=0, record_batch=batch)]
    ).SerializeToString()
    print(
        f"batch size {len(batch) / 2**20:.2f} MiB, {in_flight} in flight, "
        f"{rounds} rounds of {seconds} s per server, cache.drop.behind.bytes={drop_behind}, "
        f"compression {compression.name.lower()}; "
        "MB/s [server CPU ms per MiB]"
    )
    print("round   bare echo          echo + file append   tidewater produce   ratio  ratio")
    print("                                                                      echo   append")
    ratios: list[float] = []
    floor_ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        echo = start_reference(root / "echo.ready", drop_behind)
        appender = start_reference(root / "append.ready", drop_behind, root / "append.out")
        references = [(echo, root / "echo.ready"), (appender, root / "append.ready")]
        settings = {"log.cache.drop.behind.bytes": str(drop_behind)}
        broker = broker_process(1, root, settings)
        try:
            address = await lead_alone(broker, 1)
            for _, ready in references:
                while not ready.exists():
                    await asyncio.sleep(0.05)
            targets = [(ready.read_text(), RECEIVE, proc.pid) for proc, ready in references]
            targets.append((address, PRODUCE, broker.pid))
            for i in range(rounds):
                # Each round starts with another server: later phases find more of the page
                # cache filled, which costs more on some machines.
                phases: dict[int, tuple[float, float]] = {}
                for k in range(len(targets)):
                    j = (i + k) % len(targets)
                    target, method, pid = targets[j]
                    phases[j] = await drive(target, method, payload, seconds, in_flight, pid)
                ordered = [phases[j] for j in range(len(targets))]
                (echo_mbs, _), (append_mbs, _), (broker_mbs, _) = ordered
                ratios.append(broker_mbs / echo_mbs)
                floor_ratios.append(broker_mbs / append_mbs)
                cells = "".join(f"{mbs:8.1f} [{cpu:5.2f}]    " for mbs, cpu in ordered)
                print(f"{i + 1:5d}   {cells}{ratios[-1]:5.2f}  {floor_ratios[-1]:5.2f}")
        finally:
            broker.stop()
            echo.kill()
            appender.kill()
    ratio = statistics.median(ratios)
    print(
        f"SUMMARY broker produce = {ratio:.2f} x bare echo, "
        f"{statistics.median(floor_ratios):.2f} x echo + file append (medians of {rounds} "
        f"rounds; {'meets' if ratio >= 0.6 else 'misses'} goal 0.6 x bare echo)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--reference", type=Path, help="run a reference server (ready file)")
    parser.add_argument("--append-to", type=Path)
    parser.add_argument(
        "--drop-behind",
        type=int,
        default=DROP_BEHIND_BYTES,
        help="cache.drop.behind.bytes for the broker and the file reference (-1: Kafka's policy)",
    )
    parser.add_argument("--compression", choices=["none", "gzip", "lz4", "zstd"], default="none")
    args = parser.parse_args()
    if args.reference:
        asyncio.run(serve(receive_handlers(args.append_to, args.drop_behind), args.reference))
    else:
        asyncio.run(
            main(
                args.seconds,
                args.rounds,
                args.in_flight,
                args.drop_behind,
                Compression[args.compression.upper()],
            )
        )
