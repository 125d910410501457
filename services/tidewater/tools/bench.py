"""`tidewater bench produce | consume`: the cluster's throughput and latency through the SDK,
like kafka-producer-perf-test and kafka-consumer-perf-test."""

from __future__ import annotations

import argparse
import asyncio
import random
import string
import sys
import time
from collections.abc import Sequence

from tqdm import tqdm

from tidewater.client.consumer import Consumer
from tidewater.client.producer import Producer, RecordFuture
from tidewater.errors import RequestTimedOut
from tidewater.stats import percentile
from tidewater.tools.options import (
    add_connection_options,
    at_least,
    bootstrap,
    partition_count,
)
from tidewater.tools.produce import add_producer_options, delivery_failure, producer_config

MIB = 1024 * 1024
PERCENTILES = (0.5, 0.95, 0.99, 0.999)


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="measure produce or consume throughput")
    kinds = bench.add_subparsers(dest="kind", required=True)
    produce = kinds.add_parser(
        "produce", help="send records as fast as allowed; throughput and ack latency"
    )
    produce.add_argument("--topic", required=True)
    produce.add_argument("--num-records", type=at_least(1), required=True)
    produce.add_argument("--record-size", type=at_least(1), required=True, help="value bytes")
    produce.add_argument(
        "--throughput", type=throughput_arg, required=True, help="records/s to aim at; -1: no limit"
    )
    add_producer_options(produce)
    consume = kinds.add_parser(
        "consume", help="read records from the beginning; throughput and poll latency"
    )
    consume.add_argument("--topic", required=True)
    consume.add_argument("--num-records", type=at_least(1), required=True)
    consume.add_argument(
        "--timeout-ms",
        type=at_least(1),
        default=10000,
        help="give up after this long without a record",
    )
    for kind in (produce, consume):
        add_connection_options(kind)
        kind.set_defaults(run=run)


def throughput_arg(text: str) -> float:
    try:
        throughput = float(text)
    except ValueError:
        throughput = 0.0
    if throughput <= 0 and throughput != -1:
        raise argparse.ArgumentTypeError(f"expected records/s > 0 or -1, got {text!r}")
    return throughput


async def run(args: argparse.Namespace) -> int:
    if args.kind == "produce":
        return await _produce(args)
    return await _consume(args)


async def _produce(args: argparse.Namespace) -> int:
    config = producer_config(args)  # its usage errors before anything else
    # Like Kafka's tool: one payload of random letters, sent again and again.
    payload = "".join(random.choices(string.ascii_uppercase, k=args.record_size)).encode()
    latencies: list[float] = []
    failures: list[BaseException] = []
    progress = tqdm(total=args.num_records, unit="rec", file=sys.stderr, disable=None)

    def acked(sent: float, future: RecordFuture) -> None:
        if future.exception() is not None:
            failures.append(future.exception())  # type: ignore[arg-type]
        else:
            latencies.append(time.perf_counter() - sent)
        progress.update()

    async with Producer(bootstrap(args), **config) as producer:
        await partition_count(producer.metadata, args.topic)
        interval = 1 / args.throughput if args.throughput > 0 else 0.0
        started = time.perf_counter()
        for i in range(args.num_records):
            if interval and (ahead := started + i * interval - time.perf_counter()) > 0.001:
                await asyncio.sleep(ahead)
            sent = time.perf_counter()
            future = await producer.send(args.topic, payload)
            future.add_done_callback(lambda f, sent=sent: acked(sent, f))
            if failures:
                break
        await producer.flush()
        elapsed = time.perf_counter() - started
    progress.close()
    if failures:
        raise delivery_failure(failures[0], args)
    latencies.sort()
    rate = len(latencies) / elapsed
    print(
        f"{len(latencies)} records sent, {rate:,.1f} records/sec "
        f"({rate * args.record_size / MIB:.2f} MiB/sec), "
        + _latency_summary(latencies)
        + f" ({elapsed:.2f} s, acks={args.acks}, compression={args.compression})"
    )
    return 0


async def _consume(args: argparse.Namespace) -> int:
    poll_latencies: list[float] = []
    count = size = 0
    progress = tqdm(total=args.num_records, unit="rec", file=sys.stderr, disable=None)
    async with Consumer(
        bootstrap(args),
        auto_offset_reset="earliest",
        request_timeout_ms=args.request_timeout_ms,
    ) as consumer:
        partitions = await partition_count(consumer.metadata, args.topic)
        consumer.assign([(args.topic, p) for p in range(partitions)])
        await consumer.seek_to_beginning()
        started = last_record = time.perf_counter()
        while count < args.num_records:
            polled = time.perf_counter()
            records = await consumer.poll(500)
            now = time.perf_counter()
            poll_latencies.append(now - polled)
            if records:
                last_record = now
            elif (now - last_record) * 1000 > args.timeout_ms:
                raise RequestTimedOut(
                    f"read {count} of {args.num_records} records, then none for "
                    f"{args.timeout_ms} ms"
                )
            count += len(records)
            size += sum(len(r.value or b"") + len(r.key or b"") for r in records)
            progress.update(len(records))
        elapsed = time.perf_counter() - started
    progress.close()
    poll_latencies.sort()
    print(
        f"{count} records consumed, {count / elapsed:,.1f} records/sec "
        f"({size / MIB / elapsed:.2f} MiB/sec, {size / MIB:.1f} MiB), {len(poll_latencies)} "
        f"polls: " + _latency_summary(poll_latencies) + f" ({elapsed:.2f} s)"
    )
    return 0


def _latency_summary(sorted_s: Sequence[float]) -> str:
    """Average, max and percentiles in ms, from latencies in seconds sorted ascending."""
    if not sorted_s:
        return "no latencies"
    parts = [f"{sum(sorted_s) / len(sorted_s) * 1e3:.1f} ms avg latency"]
    for p in PERCENTILES:
        parts.append(f"{percentile(sorted_s, p) * 1e3:.1f} ms p{p * 100:g}")
    parts.append(f"{sorted_s[-1] * 1e3:.1f} ms max")
    return ", ".join(parts)
