"""Replication benchmarks: three broker processes, RF=3 acks=all, each number a ratio of a bare
grpc.aio reference measured in the same run.

    .venv/bin/python tests/benchmarks/bench_replication.py [--only throughput,latency,paced,idle]
        [--quick] [--seconds 5] [--sends 2000] [--paced-seconds 10] [--idle-seconds 10] ...

- throughput: 1 MiB batches of 1 KiB records, `--in-flight` unary Produce calls, RF=3 acks=all
  (min.insync.replicas=2) vs reference B, a bare relay (a leader forwarding the same bytes to
  two followers that append them to files and ack), and vs Tidewater's RF=1 acks=1.
- latency: one 1 KiB record at a time, RF=3 acks=all, over unary Produce and ProduceStream, vs
  reference A, a bare bidi-stream echo of the same bytes.
- paced: p99 of an open-loop producer on ProduceStream at half the RF=3 throughput, vs A's p99.
- idle: CPU of each broker with `--partitions` idle partitions replicated RF=3, leaders spread.

Reference servers and the load client run bare_grpc.py (no Tidewater code); the client is the
same process and code for references and Tidewater, sending identical pre-serialized bytes.
The stand-in controller runs in this process. Every child is killed on the way out.
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
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tidewater.local.process import ManagedProcess, broker_args
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
ECHO_STREAM = "/bench.Reference/EchoStream"
ECHO_UNARY = "/bench.Reference/Echo"
RELAY = "/bench.Reference/Relay"
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
FULL = {
    "seconds": 5.0,
    "sends": 2000,
    "paced_seconds": 10.0,
    "idle_seconds": 10.0,
    "settle_seconds": 3.0,
}
QUICK = {
    "seconds": 1.0,
    "sends": 200,
    "paced_seconds": 2.0,
    "idle_seconds": 2.0,
    "settle_seconds": 1.0,
}
# A client run may take this long beyond its nominal duration before it is killed.
CLIENT_GRACE_S = 120.0


@dataclass(frozen=True)
class Goal:
    label: str
    value: float
    limit: float
    at_most: bool

    @property
    def met(self) -> bool:
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def __str__(self) -> str:
        verdict = "meets" if self.met else "MISSES"
        return f"{verdict} goal {'<=' if self.at_most else '>='} {self.limit:g}"


@dataclass
class Report:
    goals: list[Goal] = field(default_factory=list)

    def line(self, text: str) -> None:
        print(text, flush=True)

    def goal(self, text: str, label: str, value: float, limit: float, at_most: bool) -> None:
        goal = Goal(label, value, limit, at_most)
        self.goals.append(goal)
        self.line(f"{text}  ({goal})")

    def summary(self) -> str:
        met = sum(g.met for g in self.goals)
        parts = [
            f"{g.label} {g.value:.2f} {'ok' if g.met else 'MISS'} ({'<=' if g.at_most else '>='}"
            f"{g.limit:g})"
            for g in self.goals
        ]
        return f"SUMMARY replication: {met}/{len(self.goals)} goals met; " + "; ".join(parts)


class Children:
    """Reference servers (bare_grpc.py) and client runs; every one is killed on close."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.servers: list[subprocess.Popen[bytes]] = []

    def server(self, role: str, name: str, *args: str) -> str:
        """Start a reference server; its address once it serves."""
        ready = self.work_dir / f"{name}.ready"
        proc = subprocess.Popen([sys.executable, str(BARE), role, "--ready", str(ready), *args])
        self.servers.append(proc)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"reference server {name} did not start")
            time.sleep(0.02)
        return ready.read_text()

    def close(self) -> None:
        for proc in self.servers:
            proc.kill()
            proc.wait()
        self.servers.clear()

    async def client(
        self, mode: str, address: str, method: str, payload: Path, **options: float
    ) -> dict[str, float]:
        """Run the load client to completion; its JSON result."""
        args = [str(BARE), "client", mode, "--address", address, "--method", method]
        args += ["--payload", str(payload)]
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


def produce_request(topic: str, acks: int, records: int) -> bytes:
    batch = build_batch([Record(value=os.urandom(RECORD_BYTES)) for _ in range(records)])
    return pb.ProduceRequest(
        acks=acks,
        partitions=[pb.PartitionProduceData(topic=topic, partition=0, record_batch=batch)],
    ).SerializeToString()


class Cluster:
    """Three broker processes (default configs) driven by a stand-in controller in this
    process."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.controller = StandinController(brokers={})
        self.procs: dict[int, ManagedProcess] = {}
        self.channels: dict[int, grpc.aio.Channel] = {}

    async def start(self, stack: AsyncExitStack) -> None:
        address = await self.controller.start()
        stack.push_async_callback(self.controller.stop)
        for broker_id in BROKERS:
            proc = ManagedProcess(
                f"broker-{broker_id}",
                broker_args(
                    broker_id,
                    self.work_dir / f"broker-{broker_id}",
                    "127.0.0.1:0",
                    {"controllers": address},
                ),
                self.work_dir,
            )
            stack.callback(proc.stop)
            self.procs[broker_id] = proc
            self.controller.brokers[broker_id] = proc.start()
            channel = grpc.aio.insecure_channel(
                self.controller.brokers[broker_id], options=CHANNEL_OPTIONS
            )
            stack.push_async_callback(channel.close)
            self.channels[broker_id] = channel

    def address(self, broker_id: int) -> str:
        return self.controller.brokers[broker_id]

    def stub(self, broker_id: int) -> broker_pb2_grpc.BrokerServiceStub:
        return broker_pb2_grpc.BrokerServiceStub(self.channels[broker_id])

    async def high_watermark(self, topic: str, partition: int = 0) -> int:
        leader = self.controller.states[(topic, partition)].leader
        response = await self.stub(leader).ListOffsets(
            pb.ListOffsetsRequest(
                replica_id=-1,
                partitions=[
                    pb.ListOffsetsPartition(
                        topic=topic,
                        partition=partition,
                        current_leader_epoch=-1,
                        spec=pb.OFFSET_SPEC_LATEST,
                    )
                ],
            ),
            timeout=10,
        )
        result = response.partitions[0]
        if result.error_code != ErrorCode.NONE:
            raise RuntimeError(f"ListOffsets {topic}-{partition}: {result.error_message}")
        return result.offset

    async def spread_leaders(self, topic: str, partitions: int) -> None:
        """Partition p led by broker p % 3 + 1, RF=3; one LeaderAndIsr per broker."""
        template = leader_and_isr_request(
            topic, 0, leader=1, leader_epoch=1, replicas=BROKERS, leaders=self.controller.brokers
        )
        del template.partition_states[:]
        for p in range(partitions):
            first = p % len(BROKERS)
            replicas = [*BROKERS[first:], *BROKERS[:first]]
            template.partition_states.add(
                topic=topic,
                partition=p,
                controller_epoch=1,
                leader=replicas[0],
                leader_epoch=1,
                isr=replicas,
                partition_epoch=1,
                replicas=replicas,
                is_new=True,
            )
            self.controller.states[(topic, p)] = PartitionState(
                leader=replicas[0],
                leader_epoch=1,
                isr=replicas,
                replicas=replicas,
                partition_epoch=1,
            )
        control = [broker_pb2_grpc.BrokerControlStub(self.channels[b]) for b in BROKERS]
        responses = await asyncio.gather(*(c.LeaderAndIsr(template, timeout=120) for c in control))
        for response in responses:
            if response.error_code or any(e.error_code for e in response.partition_errors):
                raise RuntimeError(f"LeaderAndIsr refused: {response.error_message}")


async def expect_committed(cluster: Cluster, topic: str, before: int, records: int) -> None:
    """Every acknowledged produce must be committed; anything else means the numbers are of
    failures."""
    after = await cluster.high_watermark(topic)
    if after - before != records:
        raise RuntimeError(
            f"{topic}: high watermark moved by {after - before}, expected {records}: "
            "some produces failed"
        )


@dataclass
class Options:
    sections: set[str]
    seconds: float
    sends: int
    paced_seconds: float
    idle_seconds: float
    settle_seconds: float
    partitions: int
    in_flight: int


@dataclass
class References:
    stream_p50_ms: float = 0.0
    stream_p99_ms: float = 0.0
    relay_mbs: float = 0.0


async def measure_references(
    opts: Options, children: Children, payloads: dict[str, Path], report: Report
) -> References:
    refs = References()
    if opts.sections & {"latency", "paced"}:
        echo = children.server("echo", "echo")
        stream = await children.client(
            "stream-rtt", echo, ECHO_STREAM, payloads["record"], count=opts.sends
        )
        unary = await children.client(
            "unary-rtt", echo, ECHO_UNARY, payloads["record"], count=opts.sends
        )
        refs.stream_p50_ms, refs.stream_p99_ms = stream["p50_ms"], stream["p99_ms"]
        report.line(
            f"A  bare stream echo, 1 KiB round trip  p50 {stream['p50_ms']:6.3f} ms  "
            f"p99 {stream['p99_ms']:6.3f} ms  ({opts.sends} sends)"
        )
        report.line(
            f"   bare unary echo (context)           p50 {unary['p50_ms']:6.3f} ms  "
            f"p99 {unary['p99_ms']:6.3f} ms"
        )
    if "throughput" in opts.sections:
        relay_dir = children.work_dir / "relay"
        relay_dir.mkdir()
        followers = [
            children.server("relay-follower", f"relay-f{i}", "--out", str(relay_dir / f"f{i}"))
            for i in (1, 2)
        ]
        leader = children.server("relay-leader", "relay-l", "--followers", ",".join(followers))
        relay = await children.client(
            "unary-throughput",
            leader,
            RELAY,
            payloads["rf3"],
            seconds=opts.seconds,
            in_flight=opts.in_flight,
        )
        children.close()  # the relay's files go with its dir; the brokers get the CPUs
        for f in relay_dir.iterdir():
            f.unlink()
        refs.relay_mbs = relay["mb_per_s"]
        report.line(
            f"B  bare relay to 2 followers            {relay['mb_per_s']:7.1f} MB/s  "
            "(expected about 100-125 MB/s on the reference machine)"
        )
    return refs


async def measure_cluster(
    opts: Options,
    children: Children,
    payloads: dict[str, Path],
    refs: References,
    report: Report,
) -> None:
    async with AsyncExitStack() as stack:
        cluster = Cluster(children.work_dir / "cluster")
        await cluster.start(stack)
        cluster.controller.configs[RF3_TOPIC] = {"min.insync.replicas": "2"}
        await cluster.controller.elect(RF3_TOPIC, 0, leader=1, replicas=list(BROKERS))
        await cluster.controller.elect(RF1_TOPIC, 0, leader=1, replicas=[1])
        leader = cluster.address(1)

        async def run(
            topic: str, records_per_call: int, mode: str, method: str, **kw: float
        ) -> dict[str, float]:
            before = await cluster.high_watermark(topic)
            payload = payloads["record" if records_per_call == 1 else topic]
            result = await children.client(mode, leader, method, payload, **kw)
            await expect_committed(cluster, topic, before, int(result["calls"]) * records_per_call)
            return result

        batch = {"seconds": opts.seconds, "in_flight": opts.in_flight}
        rf3_mbs = 0.0
        if opts.sections & {"throughput", "paced"}:
            rf3 = await run(RF3_TOPIC, RECORDS_PER_BATCH, "unary-throughput", PRODUCE, **batch)
            rf3_mbs = rf3["mb_per_s"]
            report.line(f"Tidewater RF=3 acks=all               {rf3_mbs:7.1f} MB/s")
        if "throughput" in opts.sections:
            rf1 = await run(RF1_TOPIC, RECORDS_PER_BATCH, "unary-throughput", PRODUCE, **batch)
            report.line(f"Tidewater RF=1 acks=1                 {rf1['mb_per_s']:7.1f} MB/s")
            report.goal(
                f"  RF=3 acks=all / relay  {rf3_mbs / refs.relay_mbs:5.2f}",
                "rf3/relay",
                rf3_mbs / refs.relay_mbs,
                0.6,
                at_most=False,
            )
            report.goal(
                f"  RF=3 acks=all / RF=1   {rf3_mbs / rf1['mb_per_s']:5.2f}",
                "rf3/rf1",
                rf3_mbs / rf1["mb_per_s"],
                0.5,
                at_most=False,
            )
        if "latency" in opts.sections:
            for name, label, mode, method in (
                ("unary Produce", "unary", "unary-rtt", PRODUCE),
                ("ProduceStream", "stream", "stream-rtt", PRODUCE_STREAM),
            ):
                lat = await run(RF3_TOPIC, 1, mode, method, count=opts.sends)
                report.line(
                    f"1 record RF=3 acks=all, {name:13}  p50 {lat['p50_ms']:6.3f} ms  "
                    f"p99 {lat['p99_ms']:6.3f} ms  max {lat['max_ms']:6.1f} ms"
                )
                for q, limit in (("p50", 3.0), ("p99", 4.0)):
                    ratio = lat[f"{q}_ms"] / getattr(refs, f"stream_{q}_ms")
                    report.goal(
                        f"  {q} / stream echo {q}   {ratio:5.2f}",
                        f"{label} {q}",
                        ratio,
                        limit,
                        at_most=True,
                    )
        if "paced" in opts.sections:
            rate_hz = rf3_mbs / 2 * 1e6 / payloads["rf3"].stat().st_size
            count = max(20, round(rate_hz * opts.paced_seconds))
            paced = await run(
                RF3_TOPIC,
                RECORDS_PER_BATCH,
                "paced-stream",
                PRODUCE_STREAM,
                rate_hz=rate_hz,
                count=count,
            )
            ratio = paced["p99_ms"] / refs.stream_p99_ms
            report.line(
                f"paced ProduceStream at {paced['mb_per_s']:.1f} MB/s ({rate_hz:.1f} batches/s, "
                f"half of peak)  p50 {paced['p50_ms']:6.2f} ms  p99 {paced['p99_ms']:6.2f} ms"
            )
            report.goal(
                f"  p99 / stream echo p99  {ratio:5.2f}", "paced p99", ratio, 10.0, at_most=True
            )


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def measure_idle(opts: Options, work_dir: Path, report: Report) -> None:
    async with AsyncExitStack() as stack:
        cluster = Cluster(work_dir / "idle")
        await cluster.start(stack)
        started = time.perf_counter()
        await cluster.spread_leaders(IDLE_TOPIC, opts.partitions)
        report.line(
            f"idle: {opts.partitions} partitions RF=3 on 3 brokers, LeaderAndIsr took "
            f"{time.perf_counter() - started:.1f} s; settling {opts.settle_seconds:g} s"
        )
        await asyncio.sleep(opts.settle_seconds)  # fetchers start their long polls
        pids = {b: cluster.procs[b].pid for b in BROKERS}
        before = {b: cpu_seconds(pid) for b, pid in pids.items()}
        started = time.perf_counter()
        await asyncio.sleep(opts.idle_seconds)
        elapsed = time.perf_counter() - started
        usage = {b: (cpu_seconds(pid) - before[b]) / elapsed * 100 for b, pid in pids.items()}
        for b in BROKERS:
            report.line(f"  broker {b} CPU over {elapsed:.1f} s idle  {usage[b]:5.2f} % of a core")
        report.goal(
            f"  busiest broker         {max(usage.values()):5.2f} %",
            "idle cpu %",
            max(usage.values()),
            5.0,
            at_most=True,
        )
        await check_replicating(cluster, opts.partitions)


async def check_replicating(cluster: Cluster, partitions: int) -> None:
    """Low idle CPU only counts if the partitions really replicate: an acks=all produce to the
    first and the last partition must commit, and no ISR may have changed."""
    for p in (0, partitions - 1):
        leader = cluster.controller.states[(IDLE_TOPIC, p)].leader
        response = await cluster.stub(leader).Produce(
            pb.ProduceRequest(
                acks=-1,
                timeout_ms=10_000,
                partitions=[
                    pb.PartitionProduceData(
                        topic=IDLE_TOPIC, partition=p, record_batch=build_batch([Record(b"x")])
                    )
                ],
            ),
            timeout=15,
        )
        result = response.partitions[0]
        if result.error_code != ErrorCode.NONE:
            raise RuntimeError(f"{IDLE_TOPIC}-{p} does not replicate: {result.error_message}")
    if cluster.controller.isr_changes:
        raise RuntimeError(f"ISRs changed while idle: {cluster.controller.isr_changes[:5]}")


async def main(opts: Options) -> None:
    report = Report()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        root = Path(tmp)
        children = Children(root)
        stack.callback(children.close)
        payloads = {
            "record": root / "record.bin",
            RF3_TOPIC: root / "rf3.bin",
            RF1_TOPIC: root / "rf1.bin",
        }
        payloads["record"].write_bytes(produce_request(RF3_TOPIC, -1, 1))
        payloads[RF3_TOPIC].write_bytes(produce_request(RF3_TOPIC, -1, RECORDS_PER_BATCH))
        payloads[RF1_TOPIC].write_bytes(produce_request(RF1_TOPIC, 1, RECORDS_PER_BATCH))
        report.line(
            f"{os.cpu_count()} CPUs; batch request {payloads[RF3_TOPIC].stat().st_size} bytes "
            f"({RECORDS_PER_BATCH} x {RECORD_BYTES} B records), record request "
            f"{payloads['record'].stat().st_size} bytes, {opts.in_flight} in flight, "
            f"{opts.seconds:g} s per throughput run"
        )
        refs = await measure_references(opts, children, payloads, report)
        if opts.sections & {"throughput", "latency", "paced"}:
            await measure_cluster(opts, children, payloads, refs, report)
        if "idle" in opts.sections:
            await measure_idle(opts, root, report)
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
    return Options(
        sections=sections,
        seconds=args.seconds,
        sends=args.sends,
        paced_seconds=args.paced_seconds,
        idle_seconds=args.idle_seconds,
        settle_seconds=args.settle_seconds,
        partitions=args.partitions,
        in_flight=args.in_flight,
    )


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
