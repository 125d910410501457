"""What metrics cost the broker: small acks=all produce requests (one 100-byte record each)
against a broker with metrics off and one with metrics on (scraped every second, far more
often than Prometheus' default 15 s), in alternating rounds, same run: requests per second and
each broker's CPU time per request.

    .venv/bin/python tests/benchmarks/bench_metrics.py [--seconds 5] [--rounds 3] [--in-flight 8]

Metrics off leaves three clock reads and a None check on a request's path: measured here too
(in-process, timeit) against the time one request takes, since no run can tell that apart from
noise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import timeit
from pathlib import Path

from bench_broker_produce import PRODUCE, drive
from harness import TOPIC, lead_alone

from tidewater.local.process import broker_process
from tidewater.local.scrape import scrape
from tidewater.records.batch import Record, build_batch
from tidewater.v1 import broker_pb2 as pb


async def scrape_every_second(port: int) -> None:
    while True:
        await scrape(port)
        await asyncio.sleep(1.0)


def off_path_ns() -> float:
    """What metrics off adds to one request: three clock reads and a None check."""
    request_metrics = None
    n = 200_000

    def added() -> None:
        time.perf_counter_ns()
        time.perf_counter_ns()
        time.perf_counter_ns()
        if request_metrics is not None:
            raise AssertionError

    return timeit.timeit(added, number=n) / n * 1e9


async def main(seconds: float, rounds: int, in_flight: int) -> None:
    payload = pb.ProduceRequest(
        acks=-1,
        partitions=[
            pb.PartitionProduceData(
                topic=TOPIC, partition=0, record_batch=build_batch([Record(value=b"x" * 100)])
            )
        ],
    ).SerializeToString()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        brokers = {
            "off": broker_process(1, root, {}),
            "on": broker_process(2, root, {}, metrics_port=0),
        }
        try:
            addresses = {
                name: await lead_alone(proc, broker_id)
                for broker_id, (name, proc) in enumerate(brokers.items(), start=1)
            }
            # Per broker: requests per second, and its CPU time per request (us), per round.
            rates: dict[str, list[float]] = {"off": [], "on": []}
            cpu_us: dict[str, list[float]] = {"off": [], "on": []}
            scraper = asyncio.create_task(scrape_every_second(brokers["on"].metrics_port))
            try:
                for _ in range(rounds):
                    for name, address in addresses.items():
                        mbs, cpu_ms_per_mib = await drive(
                            address, PRODUCE, payload, seconds, in_flight, brokers[name].pid
                        )
                        rates[name].append(mbs * 1e6 / len(payload))
                        cpu_us[name].append(cpu_ms_per_mib * 1000 * len(payload) / 2**20)
            finally:
                scraper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scraper
            scraped = await scrape(brokers["on"].metrics_port)
        finally:
            for proc in brokers.values():
                proc.stop()
    off, on = (statistics.median(rates[name]) for name in ("off", "on"))
    cpu_off, cpu_on = (statistics.median(cpu_us[name]) for name in ("off", "on"))
    served = scraped("tidewater_request_requests_total", request="Produce")
    added_ns = off_path_ns()
    print(f"{rounds} rounds of {seconds} s per broker, {in_flight} in flight, acks=all, 1 record")
    for name in ("off", "on"):
        print(f"metrics {name:3}  " + "  ".join(f"{r:8.0f}" for r in rates[name]) + "  req/s")
        print(
            "             " + "  ".join(f"{c:8.0f}" for c in cpu_us[name]) + "  broker CPU us/req"
        )
    print(f"the broker with metrics counted {served:.0f} produce requests")
    print(
        f"metrics off adds {added_ns:.0f} ns per request = "
        f"{added_ns / cpu_off / 10:.3f} % of the broker's {cpu_off:.0f} us of CPU per request"
    )
    print(
        f"SUMMARY metrics on: {on:.0f} req/s = {on / off:.3f} x off ({off:.0f} req/s); broker CPU "
        f"{cpu_on:.0f} us/req = {cpu_on / cpu_off:.3f} x off ({cpu_off:.0f} us/req)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.rounds, args.in_flight))
