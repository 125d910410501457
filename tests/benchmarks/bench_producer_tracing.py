"""What tracing at 1% costs the SDK producer alone: one local cluster with tracing off, and
the producer (in this process) in turns with no tracer provider and with a 1% provider writing
a trace file, each turn on the same cluster, so no cluster-to-cluster difference enters.
Reports the producer process's CPU per record of each turn and the medians' ratio.

bench_tracing.py measures whole clusters, where a producer's CPU per record follows its batch
sizes, which follow the cluster's latency; this isolates the producer's own code.

Run: .venv/bin/python tests/benchmarks/bench_producer_tracing.py [--records N] [--rounds R]"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

from bench_tracing import TOPIC, VALUE, start_cluster
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from tidewater.client.producer import Producer
from tidewater.telemetry.otlp_file import OtlpJsonFileSpanExporter, OtlpJsonFileSpanProcessor

MODES = ("no provider", "1%")


async def produce(bootstrap: list[str], records: int, provider: TracerProvider | None) -> float:
    """CPU us of this process per record over `records` sends after a warm-up, flushed."""
    async with Producer(bootstrap, acks=-1, linger_ms=5, tracer_provider=provider) as producer:
        for _ in range(records // 10):
            await producer.send(TOPIC, VALUE)
        await producer.flush()
        before = time.process_time()
        for _ in range(records):
            await producer.send(TOPIC, VALUE)
        await producer.flush()
        return (time.process_time() - before) / records * 1e6


def one_percent(trace_file: Path) -> TracerProvider:
    provider = TracerProvider(
        resource=Resource.create({"service.name": "tidewater-client"}),
        sampler=ParentBased(TraceIdRatioBased(0.01)),
    )
    provider.add_span_processor(OtlpJsonFileSpanProcessor(OtlpJsonFileSpanExporter(trace_file)))
    return provider


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000, help="per turn")
    parser.add_argument("--rounds", type=int, default=8, help="each a turn of both modes")
    args = parser.parse_args()
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    with (
        tempfile.TemporaryDirectory(prefix="tidewater-bench-producer-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        cluster = start_cluster(stack, Path(tmp) / "cluster", "off")
        bootstrap = [m.address for m in cluster.record().find("metadata")]
        for round_ in range(args.rounds):
            # Alternate which mode goes first, so neither always follows the other.
            for mode in MODES if round_ % 2 == 0 else reversed(MODES):
                provider = one_percent(Path(tmp) / f"{round_}.jsonl") if mode == "1%" else None
                try:
                    us = asyncio.run(produce(bootstrap, args.records, provider))
                finally:
                    if provider is not None:
                        provider.shutdown()
                cpu[mode].append(us)
                print(f"round {round_ + 1} {mode:>11}: {us:5.2f} us CPU per record", flush=True)
    off, traced = (statistics.median(cpu[mode]) for mode in MODES)
    print(
        f"producer tracing cost, {args.records:,} records x {args.rounds} rounds: CPU per record "
        f"(medians) no provider {off:.2f} us, 1% {traced:.2f} us, ratio {traced / off:.3f} "
        f"(rounds spread {min(min(v) for v in cpu.values()):.2f}-"
        f"{max(max(v) for v in cpu.values()):.2f} us)"
    )


if __name__ == "__main__":
    main()
