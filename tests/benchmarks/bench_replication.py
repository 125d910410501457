"""Replication benchmarks: three broker processes, RF=3 acks=all, each number a ratio of a bare
grpc.aio reference measured in the same run.

    .venv/bin/python tests/benchmarks/bench_replication.py [--only throughput,latency,paced,idle]
        [--quick] [--seconds 5] [--rounds 3] [--sends 2000] [--paced-seconds 10]
        [--idle-seconds 10] [--partitions 1000] [--in-flight 4]

- throughput: 1 MiB batches of 1 KiB records, `--in-flight` unary Produce calls, RF=3 acks=all
  (min.insync.replicas=2), vs reference B, a bare relay (a leader forwarding the same bytes to
  two followers that append them to files and ack), and vs Tidewater's RF=1 acks=1. Sustained
  rates: warm-up relay runs first fill the page cache up to the kernel's background writeback
  threshold, so every measured run pays for writeback (on a small machine that costs a good
  part of the CPUs, and a run into a clean page cache is up to twice as fast). Rounds then
  alternate the three, and the best round of each counts. Each round shows the cores busy
  during RF=3 in each broker and on the whole machine.
- latency: one 1 KiB record at a time, RF=3 acks=all, over ProduceStream and over unary
  Produce, vs reference A, a bare bidi-stream echo of the same bytes. The goals are for
  ProduceStream, the path issue 3 asks of latency-sensitive clients and the one the SDK uses;
  unary Produce, kept for simple clients, is shown for context. For context too, the bare
  relay's round trip of one record (the four one-way hops of an acks=all ack over bare
  streams) and its processes' CPU per record, beside each broker's.
- paced: p99 of an open-loop producer on ProduceStream at half the RF=3 peak, vs A's p99; the
  relay paced the same way is shown for context. Needs the peak, so it runs throughput too.
  Latency runs start after a sync, with no writeback of earlier runs competing for the CPUs.
- idle: CPU of each broker with `--partitions` idle partitions replicated RF=3, leaders spread.

Reference servers and the load client run bare_grpc.py (no Tidewater code) on asyncio's own
event loop, brokers on uvloop, their own; the client is the same process and code for
references and Tidewater, sending identical pre-serialized bytes.
Every Tidewater run checks that the leader's high watermark moved by exactly the records the
client had acknowledged. The stand-in controller runs in this process. Every child process is
killed or stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from bare_grpc import ECHO_STREAM, ECHO_UNARY, RELAY, RELAY_STREAM
from harness import cpu_seconds, drain_writeback

from tidewater.local.process import ManagedProcess, broker_process
from tidewater.local.standin_controller import (
    PartitionState,
    StandinController,
    leader_and_isr_request,
)
from tidewater.records.batch import Record, build_batch
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

BARE = Path(__file__).with_name("bare_grpc.py")
PRODUCE = "/tidewater.v1.BrokerService/Produce"
PRODUCE_STREAM = "/tidewater.v1.BrokerService/ProduceStream"
SECTIONS = ("throughput", "latency", "paced", "idle")
BROKERS = (1, 2, 3)
RECORD_BYTES = 1024
# The most 1 KiB records that fit in a 1 MiB batch: max.message.bytes is 1 MiB + 12 bytes.
RECORDS_PER_BATCH = 1014
RF3_TOPIC = "rf3"
RF1_TOPIC = "rf1"
IDLE_TOPIC = "idle"
READY_TIMEOUT_S = 30.0
WARMUP_RUNS_MAX = 10
# A client run may take this long beyond its nominal duration before it is killed.
CLIENT_GRACE_S = 120.0
FULL = {
    "seconds": 5.0,
    "rounds": 3,
    "sends": 2000,
    "paced_seconds": 10.0,
    "idle_seconds": 10.0,
    "settle_seconds": 3.0,
}
QUICK = {
    "seconds": 1.0,
    "rounds": 1,
    "sends": 200,
    "paced_seconds": 2.0,
    "idle_seconds": 2.0,
    "settle_seconds": 1.0,
}


@dataclass(frozen=True)
class Options:
    sections: frozenset[str]
    seconds: float
    rounds: int
    sends: int
    paced_seconds: float
    idle_seconds: float
    settle_seconds: float
    partitions: int
    in_flight: int


@dataclass(frozen=True)
class Goal:
    label: str
    value: float
    limit: float
    at_most: bool

    @property
    def met(self) -> bool:
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    @property
    def bound(self) -> str:
        return f"{'<=' if self.at_most else '>='} {self.limit:g}"


@dataclass
class Report:
    goals: list[Goal] = field(default_factory=list)
    # Absolute numbers for the summary line.
    keys: list[str] = field(default_factory=list)

    def line(self, text: str) -> None:
        print(text, flush=True)

    def key(self, text: str) -> None:
        self.keys.append(text)

    def goal(self, text: str, label: str, value: float, limit: float, *, at_most: bool) -> None:
        goal = Goal(label, value, limit, at_most)
        self.goals.append(goal)
        self.line(f"{text}  ({'meets' if goal.met else 'MISSES'} goal {goal.bound})")

    def summary(self) -> str:
        met = sum(g.met for g in self.goals)
        parts = [
            f"{g.label} {g.value:.2f} {'ok' if g.met else 'MISS'} ({g.bound})" for g in self.goals
        ]
        return (
            f"SUMMARY replication: {met}/{len(self.goals)} goals met "
            f"({', '.join(self.keys)}): {'; '.join(parts)}"
        )


@dataclass(frozen=True)
class Payload:
    """A pre-serialized ProduceRequest in a file, for the client process."""

    path: Path
    records: int

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def write_payload(path: Path, topic: str, acks: int, records: int) -> Payload:
    batch = build_batch([Record(value=os.urandom(RECORD_BYTES)) for _ in range(records)])
    request = pb.ProduceRequest(
        acks=acks,
        partitions=[pb.PartitionProduceData(topic=topic, partition=0, record_batch=batch)],
    )
    path.write_bytes(request.SerializeToString())
    return Payload(path, records)


class Children:
    """Reference servers (bare_grpc.py) and client runs; every one is killed on close."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.servers: list[subprocess.Popen[bytes]] = []
        self.relay_pids: list[int] = []

    def server(self, role: str, name: str, *args: str) -> str:
        """Start a reference server; its address once it serves."""
        ready = self.work_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, str(BARE), role, "--ready", str(ready), *args])
        self.servers.append(proc)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"reference server {name} did not start")
            time.sleep(0.02)
        return ready.read_text()

    def relay(self) -> str:
        """Reference B's three processes; the leader's address."""
        followers = [
            self.server("relay-follower", f"relay-f{i}", "--out", str(self.work_dir / f"f{i}"))
            for i in (1, 2)
        ]
        address = self.server("relay-leader", "relay-l", "--followers", ",".join(followers))
        # Leader first, as Tidewater's brokers are listed.
        self.relay_pids = [self.servers[-1].pid, *(proc.pid for proc in self.servers[-3:-1])]
        return address

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the running servers, together."""
        return sum(cpu_seconds(proc.pid) for proc in self.servers if proc.poll() is None)

    def close(self) -> None:
        for proc in self.servers:
            proc.kill()
            proc.wait()
        self.servers.clear()

    async def client(
        self, mode: str, address: str, method: str, payload: Payload, **options: float
    ) -> dict[str, float]:
        """Run the load client to completion; its JSON result."""
        args = [str(BARE), "client", mode, "--address", address, "--method", method]
        args += ["--payload", str(payload.path)]
        for name, value in options.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            timeout = CLIENT_GRACE_S + options.get("seconds", 0)
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"client {mode} on {method} failed:\n{err.decode()[-3000:]}")
        result: dict[str, float] = json.loads(out)
        return result


def page_cache_dirty() -> tuple[int, int]:
    """Bytes dirty or under writeback, and the threshold where background writeback starts."""
    stats = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    page = os.sysconf("SC_PAGE_SIZE")
    dirty = int(stats["nr_dirty"]) + int(stats["nr_writeback"])
    return dirty * page, int(stats["nr_dirty_background_threshold"]) * page


def machine_cpu() -> tuple[int, int]:
    """Clock ticks of all CPUs since boot: in all, and idle (idle and iowait)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(ticks), ticks[3] + ticks[4]


class Cluster:
    """Three broker processes with default configs, played the controller for by a stand-in
    controller in this process."""

    def __init__(self, work_dir: Path, children: Children) -> None:
        self.work_dir = work_dir
        self.children = children
        self.controller = StandinController(brokers={})
        self.procs: dict[int, ManagedProcess] = {}
        self.channels: dict[int, grpc.aio.Channel] = {}

    async def start(self, stack: AsyncExitStack) -> None:
        address = await self.controller.start()
        stack.push_async_callback(self.controller.stop)
        stack.push_async_callback(self.stop_brokers)
        for broker_id in BROKERS:
            proc = broker_process(broker_id, self.work_dir, {"controllers": address})
            self.procs[broker_id] = proc
            # Off the event loop: brokers call the controller while starting and stopping.
            self.controller.brokers[broker_id] = await asyncio.to_thread(proc.start)
            channel = grpc.aio.insecure_channel(
                self.controller.brokers[broker_id], options=CHANNEL_OPTIONS
            )
            stack.push_async_callback(channel.close)
            self.channels[broker_id] = channel

    async def stop_brokers(self) -> None:
        """Clean shutdown (SIGTERM), all at once; SIGKILL for any that hangs."""
        codes = await asyncio.gather(*(asyncio.to_thread(p.stop) for p in self.procs.values()))
        for broker_id, code in zip(self.procs, codes, strict=True):
            if code != 0:
                print(f"broker {broker_id} did not stop cleanly: exit code {code}", flush=True)

    def cpu_seconds(self) -> dict[int, float]:
        return {b: cpu_seconds(proc.pid) for b, proc in self.procs.items()}

    def stub(self, broker_id: int) -> broker_pb2_grpc.BrokerServiceStub:
        return broker_pb2_grpc.BrokerServiceStub(self.channels[broker_id])

    async def high_watermark(self, topic: str) -> int:
        leader = self.controller.states[(topic, 0)].leader
        spec = pb.ListOffsetsPartition(
            topic=topic, partition=0, current_leader_epoch=-1, spec=pb.OFFSET_SPEC_LATEST
        )
        response = await self.stub(leader).ListOffsets(
            pb.ListOffsetsRequest(replica_id=-1, partitions=[spec]), timeout=10
        )
        result = response.partitions[0]
        if result.error_code != ErrorCode.NONE:
            raise RuntimeError(f"ListOffsets {topic}-0: {result.error_message}")
        return result.offset

    async def run(
        self, topic: str, payload: Payload, mode: str, method: str, **options: float
    ) -> tuple[dict[str, float], dict[int, float]]:
        """A client run against the partition's leader: its result and each broker's CPU
        seconds. Raises unless every acknowledged record was committed."""
        leader = self.controller.states[(topic, 0)].leader
        before = await self.high_watermark(topic)
        cpu_before = self.cpu_seconds()
        result = await self.children.client(
            mode, self.controller.brokers[leader], method, payload, **options
        )
        cpu = {b: s - cpu_before[b] for b, s in self.cpu_seconds().items()}
        committed = await self.high_watermark(topic) - before
        if committed != result["calls"] * payload.records:
            raise RuntimeError(
                f"{topic}: {committed} records committed, {result['calls'] * payload.records} "
                "acknowledged: the numbers would be of failed produces"
            )
        return result, cpu

    async def spread_leaders(self, topic: str, partitions: int) -> None:
        """Partition p led by broker p % 3 + 1, RF=3; one LeaderAndIsr per broker."""
        request = leader_and_isr_request(
            topic, 0, leader=1, leader_epoch=1, replicas=BROKERS, leaders=self.controller.brokers
        )
        del request.partition_states[:]
        for p in range(partitions):
            first = p % len(BROKERS)
            replicas = [*BROKERS[first:], *BROKERS[:first]]
            state = PartitionState(
                leader=replicas[0],
                leader_epoch=1,
                isr=replicas,
                replicas=replicas,
                partition_epoch=1,
            )
            self.controller.states[(topic, p)] = state
            request.partition_states.add(**state.fields(topic, p), is_new=True)
        control = [broker_pb2_grpc.BrokerControlStub(self.channels[b]) for b in BROKERS]
        responses = await asyncio.gather(*(c.LeaderAndIsr(request, timeout=120) for c in control))
        for response in responses:
            if response.error_code or any(e.error_code for e in response.partition_errors):
                raise RuntimeError(f"LeaderAndIsr refused: {response}")


def per_broker(cpu: dict[int, float], divisor: float, scale: float = 1.0) -> str:
    return "/".join(f"{s / divisor * scale:.2f}" for s in cpu.values())


@dataclass
class Echo:
    """Reference A, the yardstick of the latency goals."""

    p50_ms: float
    p99_ms: float


async def measure_echo(
    opts: Options, children: Children, relay: str, record: Payload, report: Report
) -> Echo:
    address = children.server("echo", "echo")
    await drain_writeback()
    stream = await children.client("stream-rtt", address, ECHO_STREAM, record, count=opts.sends)
    unary = await children.client("unary-rtt", address, ECHO_UNARY, record, count=opts.sends)
    # The same four one-way hops as an acks=all ack (client, leader, followers, leader,
    # client), pushed over bare streams: what any design with them costs here.
    cpu_before = {pid: cpu_seconds(pid) for pid in children.relay_pids}
    relayed = await children.client("stream-rtt", relay, RELAY_STREAM, record, count=opts.sends)
    relay_cpu = {pid: cpu_seconds(pid) - s for pid, s in cpu_before.items()}
    report.line(
        f"A  bare stream echo, 1 KiB round trip  p50 {stream['p50_ms']:6.3f} ms  "
        f"p99 {stream['p99_ms']:6.3f} ms  ({opts.sends} sends)"
    )
    report.line(
        f"   bare unary echo (context)           p50 {unary['p50_ms']:6.3f} ms  "
        f"p99 {unary['p99_ms']:6.3f} ms"
    )
    report.line(
        f"   bare relay to 2 followers (context) p50 {relayed['p50_ms']:6.3f} ms  "
        f"p99 {relayed['p99_ms']:6.3f} ms  ({relayed['p50_ms'] / stream['p50_ms']:.1f} x / "
        f"{relayed['p99_ms'] / stream['p99_ms']:.1f} x the echo; CPU per send, leader and "
        f"followers {per_broker(relay_cpu, relayed['calls'], 1e3)} ms)"
    )
    return Echo(stream["p50_ms"], stream["p99_ms"])


async def measure_throughput(
    opts: Options,
    cluster: Cluster,
    relay: str,
    payloads: dict[str, Payload],
    report: Report,
) -> float:
    """Rounds of relay, RF=3 acks=all and RF=1 acks=1 at sustained rates; the best RF=3 MB/s."""
    load = {"seconds": opts.seconds, "in_flight": opts.in_flight}

    async def run_relay() -> tuple[float, float]:
        """MB/s and the relay processes' CPU seconds per MB."""
        cpu_before = cluster.children.cpu_seconds()
        result = await cluster.children.client(
            "unary-throughput", relay, RELAY, payloads[RF3_TOPIC], **load
        )
        cpu = cluster.children.cpu_seconds() - cpu_before
        return result["mb_per_s"], cpu / (result["mb_per_s"] * opts.seconds)

    warmup = []
    dirty, threshold = page_cache_dirty()
    while dirty < 0.8 * threshold and len(warmup) < WARMUP_RUNS_MAX:
        warmup.append(f"{(await run_relay())[0]:.1f}")
        dirty, threshold = page_cache_dirty()
    report.line(
        f"warm-up: relay runs at {', '.join(warmup)} MB/s up to {dirty / 1e9:.2f} GB dirty in "
        f"the page cache; background writeback starts at {threshold / 1e9:.2f} GB"
    )
    best = {"relay": 0.0, RF3_TOPIC: 0.0, RF1_TOPIC: 0.0}
    for round_ in range(1, opts.rounds + 1):
        mbs, cpu_per_mb = {}, {}
        mbs["relay"], cpu_per_mb["relay"] = await run_relay()
        cores = ""
        for topic in (RF3_TOPIC, RF1_TOPIC):
            ticks_before, idle_before = machine_cpu()
            result, cpu = await cluster.run(
                topic, payloads[topic], "unary-throughput", PRODUCE, **load
            )
            ticks, idle = machine_cpu()
            mbs[topic] = result["mb_per_s"]
            cpu_per_mb[topic] = sum(cpu.values()) / (mbs[topic] * opts.seconds)
            if topic == RF3_TOPIC:
                # RF=3 is not bound by the CPUs: the machine's busy cores show it.
                busy = (1 - (idle - idle_before) / (ticks - ticks_before)) * (os.cpu_count() or 1)
                cores = f"{per_broker(cpu, opts.seconds)}, machine {busy:.2f}"
        report.line(
            f"round {round_}: "
            + " | ".join(
                f"{name} {mbs[key]:6.1f} MB/s {cpu_per_mb[key] * 1e3:5.1f} ms CPU/MB"
                for name, key in (("relay", "relay"), ("RF=3", RF3_TOPIC), ("RF=1", RF1_TOPIC))
            )
            + f" | RF=3 cores busy per broker {cores}; {page_cache_dirty()[0] / 1e9:.2f} GB dirty"
        )
        best = {name: max(best[name], mbs[name]) for name in best}
    report.line(
        f"B  bare relay to 2 followers            {best['relay']:7.1f} MB/s  "
        "(expected about 100-125 MB/s on the reference machine)"
    )
    report.line(f"Tidewater RF=3 acks=all               {best[RF3_TOPIC]:7.1f} MB/s")
    report.line(f"Tidewater RF=1 acks=1                 {best[RF1_TOPIC]:7.1f} MB/s")
    report.key(f"RF=3 acks=all {best[RF3_TOPIC]:.1f} MB/s")
    ratio = best[RF3_TOPIC] / best["relay"]
    report.goal(f"  RF=3 acks=all / relay  {ratio:5.2f}", "rf3/relay", ratio, 0.6, at_most=False)
    ratio = best[RF3_TOPIC] / best[RF1_TOPIC]
    report.goal(f"  RF=3 acks=all / RF=1   {ratio:5.2f}", "rf3/rf1", ratio, 0.5, at_most=False)
    return best[RF3_TOPIC]


async def measure_latency(
    opts: Options, cluster: Cluster, record: Payload, echo: Echo, report: Report
) -> None:
    for name, label, mode, method in (
        ("ProduceStream", "stream", "stream-rtt", PRODUCE_STREAM),
        ("unary Produce", "unary", "unary-rtt", PRODUCE),
    ):
        await drain_writeback()
        result, cpu = await cluster.run(RF3_TOPIC, record, mode, method, count=opts.sends)
        report.line(
            f"1 record RF=3 acks=all, {name:13}  p50 {result['p50_ms']:6.3f} ms  "
            f"p99 {result['p99_ms']:6.3f} ms  max {result['max_ms']:6.1f} ms  "
            f"(CPU per send per broker {per_broker(cpu, result['calls'], 1e3)} ms)"
        )
        report.key(f"{label} p50/p99 {result['p50_ms']:.2f}/{result['p99_ms']:.2f} ms")
        for q, echo_ms, limit in (("p50", echo.p50_ms, 3.0), ("p99", echo.p99_ms, 4.0)):
            ratio = result[f"{q}_ms"] / echo_ms
            text = f"  {q} / stream echo {q}   {ratio:5.2f}"
            if method == PRODUCE_STREAM:
                report.goal(text, f"{label} {q}", ratio, limit, at_most=True)
            else:
                report.line(f"{text}  (context)")


async def measure_paced(
    opts: Options,
    cluster: Cluster,
    relay: str,
    batch: Payload,
    peak_mbs: float,
    echo: Echo,
    report: Report,
) -> None:
    """Open-loop batches at half the peak rate, then the relay at the same pace."""
    rate_hz = peak_mbs / 2 * 1e6 / batch.size
    pacing = {"rate_hz": rate_hz, "count": max(20, round(rate_hz * opts.paced_seconds))}
    await drain_writeback()
    paced, _ = await cluster.run(RF3_TOPIC, batch, "paced-stream", PRODUCE_STREAM, **pacing)
    await drain_writeback()
    reference = await cluster.children.client("paced-stream", relay, RELAY_STREAM, batch, **pacing)
    report.line(
        f"paced ProduceStream at half of peak, {paced['mb_per_s']:5.1f} MB/s "
        f"({rate_hz:.1f} batches/s)  p50 {paced['p50_ms']:6.2f} ms  p99 {paced['p99_ms']:6.2f} ms"
    )
    report.line(
        f"   bare relay paced the same (context)    p50 {reference['p50_ms']:6.2f} ms  "
        f"p99 {reference['p99_ms']:6.2f} ms"
    )
    report.key(f"paced p99 {paced['p99_ms']:.1f} ms")
    ratio = paced["p99_ms"] / echo.p99_ms
    report.goal(f"  p99 / stream echo p99  {ratio:5.2f}", "paced p99", ratio, 10.0, at_most=True)


async def measure_idle(opts: Options, cluster: Cluster, report: Report) -> None:
    await drain_writeback()
    started = time.perf_counter()
    await cluster.spread_leaders(IDLE_TOPIC, opts.partitions)
    report.line(
        f"idle: {opts.partitions} partitions RF=3 on 3 brokers, LeaderAndIsr took "
        f"{time.perf_counter() - started:.1f} s; settling {opts.settle_seconds:g} s"
    )
    await asyncio.sleep(opts.settle_seconds)  # the fetchers start their long polls
    before = cluster.cpu_seconds()
    started = time.perf_counter()
    await asyncio.sleep(opts.idle_seconds)
    elapsed = time.perf_counter() - started
    usage = {b: (s - before[b]) / elapsed * 100 for b, s in cluster.cpu_seconds().items()}
    for b, percent in usage.items():
        report.line(f"  broker {b} CPU over {elapsed:.1f} s idle  {percent:5.2f} % of a core")
    await check_replicating(cluster, opts.partitions)
    busiest = max(usage.values())
    report.key(f"idle CPU {busiest:.1f}%")
    report.goal(
        f"  busiest broker         {busiest:5.2f} %", "idle cpu %", busiest, 5.0, at_most=True
    )


async def check_replicating(cluster: Cluster, partitions: int) -> None:
    """Low idle CPU only counts if the partitions really replicate: an acks=all produce to the
    first and the last partition must commit, and no ISR may have changed."""
    for p in (0, partitions - 1):
        leader = cluster.controller.states[(IDLE_TOPIC, p)].leader
        data = pb.PartitionProduceData(
            topic=IDLE_TOPIC, partition=p, record_batch=build_batch([Record(b"x")])
        )
        response = await cluster.stub(leader).Produce(
            pb.ProduceRequest(acks=-1, timeout_ms=10_000, partitions=[data]), timeout=15
        )
        result = response.partitions[0]
        if result.error_code != ErrorCode.NONE:
            raise RuntimeError(f"{IDLE_TOPIC}-{p} does not replicate: {result.error_message}")
    if cluster.controller.isr_changes:
        raise RuntimeError(f"ISRs changed while idle: {cluster.controller.isr_changes[:5]}")


async def measure_on_cluster(
    opts: Options, root: Path, record: Payload, payloads: dict[str, Payload], report: Report
) -> None:
    """Throughput, latency and paced runs: the references and one cluster."""
    async with AsyncExitStack() as stack:
        children = Children(root)
        stack.callback(children.close)
        relay = children.relay()
        cluster = Cluster(root / "cluster", children)
        await cluster.start(stack)
        cluster.controller.configs[RF3_TOPIC] = {"min.insync.replicas": "2"}
        await cluster.controller.elect(RF3_TOPIC, 0, leader=1, replicas=list(BROKERS))
        await cluster.controller.elect(RF1_TOPIC, 0, leader=1, replicas=[1])
        peak_mbs = 0.0
        if "throughput" in opts.sections:
            peak_mbs = await measure_throughput(opts, cluster, relay, payloads, report)
        if not opts.sections & {"latency", "paced"}:
            return
        # In the conditions of the latency runs: after the throughput runs, cluster idle.
        echo = await measure_echo(opts, children, relay, record, report)
        if "latency" in opts.sections:
            await measure_latency(opts, cluster, record, echo, report)
        if "paced" in opts.sections:
            batch = payloads[RF3_TOPIC]
            await measure_paced(opts, cluster, relay, batch, peak_mbs, echo, report)


async def main(opts: Options) -> None:
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        record = write_payload(root / "record.bin", RF3_TOPIC, -1, 1)
        payloads = {
            RF3_TOPIC: write_payload(root / "rf3.bin", RF3_TOPIC, -1, RECORDS_PER_BATCH),
            RF1_TOPIC: write_payload(root / "rf1.bin", RF1_TOPIC, 1, RECORDS_PER_BATCH),
        }
        report.line(
            f"{os.cpu_count()} CPUs; batch request {payloads[RF3_TOPIC].size} bytes "
            f"({RECORDS_PER_BATCH} x {RECORD_BYTES} B records), record request {record.size} "
            f"bytes; {opts.in_flight} in flight, {opts.rounds} x {opts.seconds:g} s per "
            f"throughput run; load average {os.getloadavg()[0]:.2f} before the run"
        )
        if opts.sections & {"throughput", "latency", "paced"}:
            await measure_on_cluster(opts, root, record, payloads, report)
        if "idle" in opts.sections:
            async with AsyncExitStack() as stack:
                cluster = Cluster(root / "idle", Children(root))
                await cluster.start(stack)
                await measure_idle(opts, cluster, report)
    # Other work on the machine during the run shows here, not in the numbers' labels.
    report.line(f"load average {os.getloadavg()[0]:.2f} after the run")
    print(report.summary())


def parse_args(argv: list[str] | None = None) -> Options:
    # --quick changes the defaults; flags given explicitly still win.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--quick", action="store_true")
    durations = QUICK if pre.parse_known_args(argv)[0].quick else FULL
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--quick", action="store_true", help=f"shorter defaults: {QUICK}")
    parser.add_argument("--seconds", type=float, help="per throughput run")
    parser.add_argument("--rounds", type=int, help="throughput rounds; the best counts")
    parser.add_argument("--sends", type=int, help="per latency run")
    parser.add_argument("--paced-seconds", type=float)
    parser.add_argument("--idle-seconds", type=float)
    parser.add_argument("--settle-seconds", type=float, help="before measuring idle CPU")
    parser.add_argument("--partitions", type=int, default=1000, help="idle partitions")
    parser.add_argument("--in-flight", type=int, default=4, help="throughput requests")
    parser.set_defaults(**durations)
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.only.split(",") if s.strip()}
    if unknown := sections - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if "paced" in sections:
        sections.add("throughput")  # the pace is half of its peak
    return Options(
        sections=frozenset(sections),
        seconds=args.seconds,
        rounds=args.rounds,
        sends=args.sends,
        paced_seconds=args.paced_seconds,
        idle_seconds=args.idle_seconds,
        settle_seconds=args.settle_seconds,
        partitions=args.partitions,
        in_flight=args.in_flight,
    )


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
