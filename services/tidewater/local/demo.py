"""`tidewater demo`: a broker process, made leader of a partition, and a produce/consume round trip.

Until the controller exists, the demo plays the controller: it sends LeaderAndIsr itself.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import grpc

from tidewater.local.process import ManagedProcess, broker_args
from tidewater.local.standin_controller import make_leader
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.records.header import Compression
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "demo"
BATCH_RECORDS = 1000


async def run_demo(records: int, data_dir: Path | None) -> int:
    with tempfile.TemporaryDirectory(prefix="tidewater-demo-") as tmp:
        root = data_dir or Path(tmp)
        broker = ManagedProcess(
            "broker-1", broker_args(1, root / "broker-1", "127.0.0.1:0", {}), root
        )
        address = broker.start()
        print(f"broker 1 serving on {address} (data in {root / 'broker-1'})")
        try:
            async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
                await make_leader(channel, TOPIC, 0, leader=1, leader_epoch=1, replicas=[1])
                print(f"broker 1 leads {TOPIC}-0")
                stub = broker_pb2_grpc.BrokerServiceStub(channel)
                await _produce(stub, records)
                await _consume(stub, records)
        finally:
            code = broker.stop()
            print(f"broker stopped (exit code {code})")
    return 0


async def _produce(stub: broker_pb2_grpc.BrokerServiceStub, total: int) -> None:
    started = time.perf_counter()
    latencies: list[float] = []
    for start in range(0, total, BATCH_RECORDS):
        batch = build_batch(
            [
                Record(key=str(i).encode(), value=f"record {i}".encode())
                for i in range(start, min(start + BATCH_RECORDS, total))
            ],
            compression=Compression.ZSTD,
        )
        sent = time.perf_counter()
        response = await stub.Produce(
            pb.ProduceRequest(
                acks=-1,
                partitions=[pb.PartitionProduceData(topic=TOPIC, partition=0, record_batch=batch)],
            )
        )
        latencies.append(time.perf_counter() - sent)
        result = response.partitions[0]
        if result.error_code != ErrorCode.NONE:
            raise RuntimeError(
                f"produce failed: {ErrorCode.Name(result.error_code)} {result.error_message}"
            )
    elapsed = time.perf_counter() - started
    latencies.sort()
    p50_ms = latencies[len(latencies) // 2] * 1e3
    print(
        f"produced {total} records (acks=all, zstd, {BATCH_RECORDS}/batch) in {elapsed:.2f} s: "
        f"{total / elapsed:,.0f} records/s; produce-to-ack p50 {p50_ms:.2f} ms, "
        f"max {latencies[-1] * 1e3:.2f} ms"
    )


async def _consume(stub: broker_pb2_grpc.BrokerServiceStub, total: int) -> None:
    offset = 0
    started = time.perf_counter()
    while offset < total:
        response = await stub.Fetch(
            pb.FetchRequest(
                replica_id=-1,
                max_wait_ms=500,
                min_bytes=1,
                max_bytes=4 << 20,
                partitions=[
                    pb.FetchPartition(
                        topic=TOPIC,
                        partition=0,
                        fetch_offset=offset,
                        current_leader_epoch=-1,
                        last_fetched_epoch=-1,
                        log_start_offset=-1,
                    )
                ],
            )
        )
        result = response.partitions[0]
        if result.error_code != ErrorCode.NONE:
            raise RuntimeError(
                f"fetch failed: {ErrorCode.Name(result.error_code)} {result.error_message}"
            )
        for record in decode_batches(result.record_batches):
            if record.offset < offset:
                continue
            if record.offset != offset or record.value != f"record {offset}".encode():
                raise RuntimeError(f"consumed {record} where offset {offset} was expected")
            offset += 1
    elapsed = time.perf_counter() - started
    print(f"consumed {total} records back in order in {elapsed:.2f} s: round trip OK")
