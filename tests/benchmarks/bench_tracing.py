"""What tracing costs: SDK produce throughput (acks=all, RF=3, 3 partitions, 100-byte values)
on local clusters of real processes (`cluster up`: etcd, 2 controllers, a metadata service,
3 brokers) with tracing off, on at 1% sampling (parentbased_traceidratio 0.01) and on at
100%, every process and the producer writing trace files; and "off again", a second cluster
with tracing off, the A/A control.

Runs of one mode on one cluster spread +-20 % from round to round on this shared machine, and
two clusters of one mode and code differ by several percent for as long as they run (an A/A
run), more than the 1% goal's margin. So: generations of clusters, one per mode, started
together and stopped after their rounds; in each round every mode runs once (in a new order,
each run on a quiet cluster: see settle), and a traced mode counts as its ratio to the mean
of the two off clusters in that round; the medians of those ratios over all generations are
the results. The A/A control's ratio (off again to off) says how large a difference the run
can tell from noise. A new cluster's first round warms it up
and does not count.
Goals (issue 6): >= 0.98 x off at 1%, >= 0.85 x off at 100%. Each mode also reports its CPU
per record (all of its cluster's processes and the producer; the throughput's inverse on a
machine the cluster keeps busy, and steadier when a neighbour is not) against off's, and what
tracing adds per record in each role.

--toggle measures 1% without two clusters' bias: one cluster, traced at 1% when it starts,
whose brokers (switched_broker.py) a signal switches untraced and traced again between runs,
and the producer traced at 1% or not: four modes, off (neither), brokers, producer and 1%
(both), once each per round in a new order. In "brokers" the untraced producer's streams
declare no sampled-out parent, so the leader decides a trace of its own for each batch, as
for any client that does not trace. It reports what 1% adds per record to each role's CPU
against the same round's off and against "producer" (the brokers' own work for a traced
producer), and what "producer" and "brokers" add against off: the mean of the rounds'
differences with its standard error, the median of the rounds' rate ratios, and the follower
fetches per 1,000 records. What stays set up in a switched-off broker (its provider and trace
file, the interceptors of calls outside the data plane) and the other processes' tracing are
not measured: --set-up-off adds a fifth cluster to the generations, "1% set up", started as
the 1% one, its brokers switched off and the producer untraced, whose ratio to off is what
that costs.

Run: .venv/bin/python tests/benchmarks/bench_tracing.py [--records N] [--rounds R]
         [--generations G] [--set-up-off] [--toggle]"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import re
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from harness import cpu_seconds
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from switched_broker import SWITCH_OFF, SWITCH_ON, state_file

from tidewater.client.admin import Admin
from tidewater.client.producer import Producer
from tidewater.local.cluster import LocalCluster
from tidewater.local.process import TIDEWATER
from tidewater.telemetry.otlp_file import OtlpJsonFileSpanExporter, OtlpJsonFileSpanProcessor

TOPIC = "bench"
PARTITIONS = 3
VALUE = bytes(100)
# "off again": a second cluster with tracing off, the A/A control: how far two clusters of one
# mode differ shows which differences the benchmark cannot tell from noise.
CONTROL = "off again"
MODES: dict[str, float | None] = {"off": None, CONTROL: None, "1%": 0.01, "100%": 1.0}
# --set-up-off's fifth mode: a cluster set up for 1% as the 1% one is (every process's trace
# file, the SDK, the gRPC interceptors), its brokers' tracing switched off (switched_broker.py)
# and the producer untraced: what tracing costs before any request is traced.
SET_UP = "1% set up"
MODE_DIRS = {"off": "off", CONTROL: "off-again", "1%": "1", "100%": "100", SET_UP: "1-set-up"}
# The sampling ratio each mode's cluster is set up with (the producer's: MODES).
CLUSTER_RATIOS = MODES | {SET_UP: 0.01}
OFF = ("off", CONTROL)
GOALS = {"1%": 0.98, "100%": 0.85}
ROLES = {"broker": "brokers", "controller": "controllers"}
# Quiet: at most one clock tick of CPU over all of a cluster's processes in a window.
SETTLE_WINDOW_S = 0.2
QUIET_CPU_S = 0.01
SETTLE_MAX_S = 10.0
# --toggle's modes: (the brokers trace, the producer traces), all at 1%.
TOGGLE_RATIO = 0.01
TOGGLES = {
    "off": (False, False),
    "brokers": (True, False),
    "producer": (False, True),
    "1%": (True, True),
}
# What --toggle reports: each mode's CPU per record against another's, by role.
TOGGLE_DIFFERENCES = (("1%", "off"), ("1%", "producer"), ("producer", "off"), ("brokers", "off"))
TOGGLE_ROLES = ("brokers", "producer", "all")
SWITCHED_BROKER = Path(__file__).with_name("switched_broker.py")
SWITCH_TIMEOUT_S = 10.0
# Kafka's RequestsPerSec for follower fetches, as a broker's metrics endpoint serves it.
FOLLOWER_FETCHES = re.compile(
    r'^tidewater_request_requests_total\{[^}]*request="FetchFollower"[^}]*\} (\S+)$', re.M
)
FETCHES = "follower fetches"


async def produce(
    bootstrap: list[str], records: int, provider: TracerProvider | None, pids: dict[str, list[int]]
) -> tuple[float, dict[str, float]]:
    """Records/s of `records` sends after a warm-up, acks=all, flushed; and the CPU us per
    record of this process ("producer") and of the cluster's by role (`pids`), which a busy
    neighbour skews less than the rate."""

    def cpu() -> dict[str, float]:
        return {"producer": time.process_time()} | {
            role: sum(map(cpu_seconds, role_pids)) for role, role_pids in pids.items()
        }

    async with Producer(bootstrap, acks=-1, linger_ms=5, tracer_provider=provider) as producer:
        for _ in range(records // 10):
            await producer.send(TOPIC, VALUE)
        await producer.flush()
        cpu_before = cpu()
        start = time.perf_counter()
        futures = [await producer.send(TOPIC, VALUE) for _ in range(records)]
        await producer.flush()
        elapsed = time.perf_counter() - start
        cpu_after = cpu()
    failed = [f for f in futures if f.exception() is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} records failed: {failed[0].exception()}")
    return records / elapsed, {
        role: (cpu_after[role] - cpu_before[role]) / records * 1e6 for role in cpu_before
    }


async def create_topic(cluster: LocalCluster) -> None:
    state = cluster.record()
    async with Admin([m.address for m in state.find("controller")]) as admin:
        await admin.create_topic(TOPIC, partitions=PARTITIONS, replication_factor=3)


async def open_fetch_streams(cluster: LocalCluster) -> None:
    """Returns once every follower's FetchStream is open: an acks=all record to each
    partition is acknowledged only when both its followers have fetched it. A switched
    broker must not be switched off before: a stream that opens untraced declares no
    sampled-out parent, and its leader would decide a trace of its own for each fetch on it
    whenever switched on, which no cluster traced from its start does (create_topic()
    returns before the brokers have even heard of the partitions)."""
    bootstrap = [m.address for m in cluster.record().find("metadata")]
    async with Producer(bootstrap, acks=-1) as producer:
        for partition in range(PARTITIONS):
            await producer.send_and_wait(TOPIC, VALUE, partition=partition)


def start_cluster(
    stack: contextlib.ExitStack, work: Path, mode: str, broker_entry: Sequence[str] = TIDEWATER
) -> LocalCluster:
    ratio = CLUSTER_RATIOS[mode]
    if ratio is None:
        os.environ.pop("OTEL_TRACES_SAMPLER", None)
        os.environ.pop("OTEL_TRACES_SAMPLER_ARG", None)
    else:
        # The cluster's processes inherit the sampler.
        os.environ["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        os.environ["OTEL_TRACES_SAMPLER_ARG"] = str(ratio)
    cluster = LocalCluster(work, brokers=3, trace=ratio is not None, broker_entry=broker_entry)
    stack.callback(cluster.stop)
    cluster.start()
    asyncio.run(create_topic(cluster))
    if mode == SET_UP:
        # Once the followers' FetchStreams are open traced, declaring their constant.
        asyncio.run(open_fetch_streams(cluster))
        switch_brokers(cluster, False)
    return cluster


def run_once(
    cluster: LocalCluster, ratio: float | None, records: int, trace_file: Path
) -> tuple[float, dict[str, float]]:
    """Records/s and CPU us per record by role (producer, brokers, rest, and "all") of one
    round; the producer traced at `ratio`, or not at all when None."""
    provider = None
    try:
        if ratio is not None:
            provider = TracerProvider(
                resource=Resource.create({"service.name": "tidewater-client"}),
                sampler=ParentBased(TraceIdRatioBased(ratio)),
            )
            # What `--trace-file` installs in a client tool.
            provider.add_span_processor(
                OtlpJsonFileSpanProcessor(OtlpJsonFileSpanExporter(trace_file))
            )
        state = cluster.record()
        bootstrap = [m.address for m in state.find("metadata")]
        pids: dict[str, list[int]] = {}
        for member in state.members:
            pids.setdefault(ROLES.get(member.role, member.role), []).append(member.pid)
        result = asyncio.run(produce(bootstrap, records, provider, pids))
    finally:
        if provider is not None:
            provider.shutdown()
    settle([pid for role_pids in pids.values() for pid in role_pids])
    rate, cpu = result
    cpu["all"] = sum(cpu.values())
    return rate, cpu


def settle(pids: list[int]) -> None:
    """Wait until the cluster is quiet: at 100% its processes go on writing spans after the
    producer's last ack, and that tail slowed whichever mode ran next by up to 10 %."""
    deadline = time.monotonic() + SETTLE_MAX_S
    used = sum(map(cpu_seconds, pids))
    while time.monotonic() < deadline:
        time.sleep(SETTLE_WINDOW_S)
        before, used = used, sum(map(cpu_seconds, pids))
        if used - before <= QUIET_CPU_S:
            return


Results = dict[str, tuple[float, dict[str, float]]]


def run_round(
    clusters: dict[str, LocalCluster], order: list[str], records: int, work: Path, label: str
) -> Results:
    """Each mode's records/s and CPU us per record by role (and "all") in one round."""
    results = {}
    for mode in order:
        trace_file = work / MODE_DIRS[mode] / "traces" / f"client-{label.replace(' ', '-')}.jsonl"
        rate, cpu = run_once(clusters[mode], MODES.get(mode), records, trace_file)
        results[mode] = (rate, cpu)
        print(
            f"{label} tracing {mode:>9}: {rate:10,.0f} records/s, {cpu['all']:5.1f} us CPU per "
            f"record (all processes; brokers {cpu['brokers']:.1f}, producer "
            f"{cpu['producer']:.1f})",
            flush=True,
        )
    return results


class Tally:
    """Per round, each traced mode's rate and CPU per record by role, beside the same round's
    off clusters' (their mean: two clusters' biases half cancel); and the A/A control."""

    def __init__(self, traced: Sequence[str]) -> None:
        self.traced = traced
        self.ratios: dict[str, list[float]] = {mode: [] for mode in traced}
        self.cpu_ratios: dict[str, list[float]] = {mode: [] for mode in traced}
        self.added: dict[str, dict[str, list[float]]] = {mode: {} for mode in traced}
        self.control: list[float] = []
        self.off_rates: list[float] = []

    def count(self, results: Results) -> None:
        off_rate = statistics.mean(results[m][0] for m in OFF)
        off_cpu = {
            role: statistics.mean(results[m][1][role] for m in OFF) for role in results["off"][1]
        }
        self.off_rates.append(off_rate)
        self.control.append(results[CONTROL][0] / results["off"][0])
        for mode in self.traced:
            rate, cpu = results[mode]
            self.ratios[mode].append(rate / off_rate)
            self.cpu_ratios[mode].append(off_cpu["all"] / cpu["all"])
            for role in cpu:
                self.added[mode].setdefault(role, []).append(cpu[role] - off_cpu[role])

    def summary(self) -> str:
        aa = statistics.median(self.control)
        summary = [
            f"off {statistics.median(self.off_rates):,.0f} records/s",
            f"A/A control (off again / off) {aa:.3f}x",
        ]
        for mode in self.traced:
            ratio = statistics.median(self.ratios[mode])
            goal = GOALS.get(mode)
            verdict = (
                "" if goal is None else f"goal >= {goal}: {'met' if ratio >= goal else 'MISSED'}; "
            )
            cpu_ratio = statistics.median(self.cpu_ratios[mode])
            by_role = ", ".join(
                f"{role} {statistics.median(us):+.2f}" for role, us in self.added[mode].items()
            )
            summary.append(
                f"{mode} {ratio:.3f}x ({verdict}CPU per record {cpu_ratio:.3f}x off's, plus us "
                f"per record: {by_role})"
            )
        return (
            "medians of each round's ratio to off: "
            + "; ".join(summary)
            + f"; differences within {abs(aa - 1):.3f} (the A/A control's) are noise"
        )


def follower_fetches(cluster: LocalCluster) -> float:
    """The follower fetches the brokers have served so far (their metrics endpoints)."""
    served = 0.0
    for member in cluster.record().find("broker"):
        url = f"http://{member.metrics_address}/metrics"
        with urllib.request.urlopen(url, timeout=SWITCH_TIMEOUT_S) as response:
            served += sum(map(float, FOLLOWER_FETCHES.findall(response.read().decode())))
    return served


def switch_brokers(cluster: LocalCluster, on: bool) -> None:
    """Switch the brokers' tracing (switched_broker.py) and wait until each says it has."""
    brokers = [proc for (role, _), proc in cluster.processes.items() if role == "broker"]
    for proc in brokers:
        state_file(proc.ready_file).unlink(missing_ok=True)
        proc.signal(SWITCH_ON if on else SWITCH_OFF)
    want = "on" if on else "off"
    deadline = time.monotonic() + SWITCH_TIMEOUT_S
    for proc in brokers:
        acknowledged = state_file(proc.ready_file)
        while not (acknowledged.exists() and acknowledged.read_text() == want):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} did not switch its tracing {want}")
            time.sleep(0.01)


def mean_and_error(values: list[float]) -> str:
    """The mean with its standard error."""
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return f"{statistics.mean(values):+.2f} +- {error:.2f}"


def toggle(records: int, rounds: int, tmp: Path) -> None:
    """--toggle (see the module's doc)."""
    results: list[Results] = []
    with contextlib.ExitStack() as stack:
        cluster = start_cluster(stack, tmp / "cluster", "1%", (str(SWITCHED_BROKER),))
        asyncio.run(open_fetch_streams(cluster))
        for round_ in range(rounds + 1):
            order = list(TOGGLES)
            random.Random(round_).shuffle(order)
            results.append({})
            for mode in order:
                brokers, producer = TOGGLES[mode]
                switch_brokers(cluster, brokers)
                trace_file = tmp / "cluster" / "traces" / f"client-{round_}-{mode}.jsonl"
                fetches = follower_fetches(cluster)
                rate, cpu = run_once(
                    cluster, TOGGLE_RATIO if producer else None, records, trace_file
                )
                # The warm-up's sends included (a tenth more): for comparing modes.
                cpu[FETCHES] = (follower_fetches(cluster) - fetches) / records * 1000
                results[-1][mode] = (rate, cpu)
                # Round 0 warms the cluster up in every mode and does not count.
                label = f"round {round_}" if round_ else "warm-up"
                print(
                    f"{label} {mode:>8}: {rate:10,.0f} records/s, {cpu['all']:5.1f} us CPU per "
                    f"record (brokers {cpu['brokers']:.2f}, producer {cpu['producer']:.2f}), "
                    f"{cpu[FETCHES]:.1f} follower fetches per 1,000 records",
                    flush=True,
                )
    results = results[1:]
    lines = []
    for mode, against in TOGGLE_DIFFERENCES:
        added = ", ".join(
            f"{role} " + mean_and_error([r[mode][1][role] - r[against][1][role] for r in results])
            for role in TOGGLE_ROLES
        )
        ratio = statistics.median(r[mode][0] / r[against][0] for r in results)
        fetches = mean_and_error([r[mode][1][FETCHES] - r[against][1][FETCHES] for r in results])
        lines.append(
            f"{mode} vs {against}: {added} us per record, rate {ratio:.3f}x, follower fetches "
            f"{fetches} per 1,000 records"
        )
    print(
        f"tracing toggle, one cluster, {records:,} records x {rounds} rounds, CPU per record "
        f"added (mean +- standard error of the rounds' differences) and the median rate ratio: "
        + "; ".join(lines)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=30_000, help="per round and mode")
    parser.add_argument("--rounds", type=int, help="per generation (4); with --toggle, in all (40)")
    parser.add_argument("--generations", type=int, default=4, help="of clusters, one per mode each")
    parser.add_argument(
        "--toggle", action="store_true", help="one cluster, tracing switched (see above)"
    )
    parser.add_argument(
        "--set-up-off",
        action="store_true",
        help=f"a fifth mode, {SET_UP!r}: set up for 1%%, its brokers switched off (see above)",
    )
    args = parser.parse_args()
    modes = [*MODES, SET_UP] if args.set_up_off else list(MODES)
    tally = Tally([mode for mode in modes if mode not in OFF])
    with tempfile.TemporaryDirectory(prefix="tidewater-bench-tracing-") as tmp:
        if args.toggle:
            toggle(args.records, args.rounds or 40, Path(tmp))
            return
        args.rounds = args.rounds or 4
        for generation in range(args.generations):
            with contextlib.ExitStack() as stack:
                work = Path(tmp) / f"g{generation}"
                # Each mode starts in each place in turn, generation by generation, so that
                # the start order cannot favour one.
                turn = generation % len(modes)
                starts = modes[turn:] + modes[:turn]
                clusters = {
                    m: start_cluster(
                        stack,
                        work / MODE_DIRS[m],
                        m,
                        (str(SWITCHED_BROKER),) if m == SET_UP else TIDEWATER,
                    )
                    for m in starts
                }
                # A new cluster's first round is slower in every mode (fetch sessions, the
                # first segments and their page cache, code first run): not counted.
                for mode, cluster in clusters.items():
                    run_once(cluster, MODES.get(mode), args.records, work / "warm-up.jsonl")
                for round_ in range(args.rounds):
                    # A new order every round (rotating one kept each mode's neighbours).
                    order = list(modes)
                    random.Random(generation * args.rounds + round_).shuffle(order)
                    label = f"generation {generation + 1} round {round_ + 1}"
                    tally.count(run_round(clusters, order, args.records, work, label))
    print(
        f"tracing cost, {args.records:,} records x {args.rounds} rounds x {args.generations} "
        f"generations, {tally.summary()}"
    )


if __name__ == "__main__":
    main()
