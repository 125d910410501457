"""`tidewater demo`: the README's main job. Starts a local cluster (`tidewater cluster up
--detach`: etcd, a metadata service, two controllers, three brokers), creates a topic with
replication factor 3, produces records with acks=all, consumes them back, prints the
produce-to-ack latency, and stops the cluster (`tidewater cluster down`)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tidewater.client import Admin, Consumer, Producer
from tidewater.errors import TidewaterError
from tidewater.local.cluster import ClusterFile, describe
from tidewater.stats import percentile
from tidewater.tools.options import INTERRUPTED_EXIT
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "demo"
PARTITIONS = 3


def _cli(*args: str, quiet: bool = False) -> None:
    """`quiet`: its output not shown (errors are: they go to stderr). Ctrl-C, which the
    command got too and acted on (`cluster up` stops what it started), is the demo's."""
    stdout = subprocess.DEVNULL if quiet else None
    command = [sys.executable, "-m", "tidewater", *args]
    try:
        subprocess.run(command, check=True, stdout=stdout)
    except subprocess.CalledProcessError as e:
        if e.returncode == INTERRUPTED_EXIT:
            raise KeyboardInterrupt from None  # review 27 M1: a traceback
        raise


async def run_demo(records: int, data_dir: Path | None) -> int:
    with tempfile.TemporaryDirectory(prefix="tidewater-demo-") as tmp:
        root = data_dir or Path(tmp)
        # Its banner would tell how to reach and stop a cluster that this demo stops itself.
        _cli("cluster", "up", "--detach", "--data-dir", str(root), quiet=True)
        try:
            state = ClusterFile.read(root)
            assert state is not None, "cluster up wrote no cluster.json"
            print(describe(state, hints=False), flush=True)
            bootstrap = [m.address for m in state.find("metadata")]
            controllers = [m.address for m in state.find("controller")]
            async with Admin(controllers, bootstrap) as admin:
                topic = await _create_topic(admin)
            print(f"created topic {topic}: {PARTITIONS} partitions, replication factor 3")
            await _produce(bootstrap, topic, records)
            await _consume(bootstrap, topic, records)
        finally:
            _cli("cluster", "down", "--data-dir", str(root))
    return 0


async def _create_topic(admin: Admin) -> str:
    """`demo`, or in a data dir kept from an earlier run, `demo-2`, `demo-3`, ... (review 27
    L7: the second run failed on TOPIC_ALREADY_EXISTS)."""
    for n in range(1, 1000):
        topic = TOPIC if n == 1 else f"{TOPIC}-{n}"
        try:
            await admin.create_topic(
                topic,
                partitions=PARTITIONS,
                replication_factor=3,
                configs={"min.insync.replicas": "2"},
            )
        except TidewaterError as e:
            if e.code != ErrorCode.TOPIC_ALREADY_EXISTS:
                raise
            continue
        return topic
    raise TidewaterError(
        f"topics {TOPIC} to {TOPIC}-999 exist already", ErrorCode.TOPIC_ALREADY_EXISTS
    )


async def _produce(bootstrap: list[str], topic: str, total: int) -> None:
    latencies: list[float] = []
    started = time.perf_counter()
    async with Producer(bootstrap, acks=-1, linger_ms=5, compression="zstd") as producer:
        futures = []
        for i in range(total):
            sent = time.perf_counter()
            future = await producer.send(topic, f"record {i}".encode(), key=str(i).encode())
            future.add_done_callback(
                lambda _, sent=sent: latencies.append(time.perf_counter() - sent)
            )
            futures.append(future)
        await producer.flush()
    failed = [f for f in futures if f.exception() is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} records not acknowledged: {failed[0].exception()}")
    elapsed = time.perf_counter() - started
    latencies.sort()

    def pct(p: float) -> float:
        return percentile(latencies, p) * 1e3

    print(
        f"produced {total} records (acks=all, idempotent, zstd) in {elapsed:.2f} s: "
        f"{total / elapsed:,.0f} records/s"
    )
    print(
        f"produce-to-ack latency: p50 {pct(0.5):.1f} ms, p90 {pct(0.9):.1f} ms, "
        f"p99 {pct(0.99):.1f} ms, max {latencies[-1] * 1e3:.1f} ms"
    )


async def _consume(bootstrap: list[str], topic: str, total: int) -> None:
    values: set[bytes] = set()
    started = time.perf_counter()
    async with Consumer(bootstrap, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, p) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 60
        while len(values) < total and time.monotonic() < deadline:
            values.update(r.value for r in await consumer.poll(500) if r.value is not None)
    expected = {f"record {i}".encode() for i in range(total)}
    if values != expected:
        raise RuntimeError(f"consumed {len(values)} distinct records, expected {total}")
    elapsed = time.perf_counter() - started
    print(f"consumed all {total} records back in {elapsed:.2f} s: round trip OK")
