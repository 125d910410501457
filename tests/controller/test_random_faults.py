"""Random faults against a whole cluster: etcd, two controller processes, a metadata service
and three broker processes, while the SDK's idempotent producer sends acks=all records to
three RF=3 partitions with min.insync.replicas=2. A seeded schedule of faults, one after
another: a broker killed -9 or shut down and started again, a broker or two paused (past the
ISR's lag time and the broker session, or not), a broker cut off from the controllers, or
from everyone who calls it (other brokers' fetches, the controllers, clients), or both (its
connections dropped or blackholed), the active controller killed -9 and started again, a
broker's disk filling up (it stops, and starts again with room); and, as an operator would,
preferred leaders elected again (ElectLeaders). Then,
with everything back and the ISRs full: every acknowledged record is in its partition exactly
once, at the offset its acknowledgement named; no record is there twice; each partition holds
its records in send order; and the three replicas of each partition hold the same bytes. A
consumer reads all along: what it read was committed, so it is all in the final log, at the
offsets it was read at.

Each fault lasts at most a few seconds and a schedule is FAULTS long; the producer stops when
the schedule ends. A soak runs more seeds: TIDEWATER_FAULT_SEEDS=1-40 (about 40 s a seed)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from tests.controller.cluster import Cluster, Eventually
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.dir_failure import HALT_EXIT_CODE
from tidewater.broker.log.log import Log
from tidewater.client.consumer import Consumer
from tidewater.client.errors import ClientError
from tidewater.client.producer import Producer, RecordFuture
from tidewater.errors import TidewaterError
from tidewater.local.fetch import list_offsets, log_bytes, read_served
from tidewater.local.tcp_proxy import LinkMode
from tidewater.records.batch import decode_batches
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import controller_pb2 as cpb

TOPIC = "faults"
PARTITIONS = 3
BROKERS = (1, 2, 3)
FAULTS = 6
# Records not yet acknowledged, at most: the producer waits for the oldest beyond this.
IN_FLIGHT = 2000
MAX_RECORDS = 200_000
PRODUCER = {
    "linger_ms": 2,
    "retry_backoff_ms": 50,
    "request_timeout_ms": 3000,
    "delivery_timeout_ms": 60000,
}
DEADLINE_S = 30.0
# How long a broker whose disk fills may go on before the fault ends.
FULL_DISK_S = 10.0


def seeds() -> list[int]:
    spec = os.environ.get("TIDEWATER_FAULT_SEEDS", "1-2")
    first, _, last = spec.partition("-")
    return list(range(int(first), int(last or first) + 1))


class Nemesis:
    """The faults of a schedule, each undone before it returns."""

    def __init__(self, cluster: Cluster, rng: random.Random, eventually: Eventually) -> None:
        self.cluster = cluster
        self.rng = rng
        self.eventually = eventually
        self.done: list[str] = []

    async def run(self, faults: int) -> None:
        kinds: list[Callable[[], Awaitable[str]]] = [
            self.kill_broker,
            self.restart_broker,
            self.pause_broker,
            self.pause_two_brokers,
            self.cut_broker_off,
            self.isolate_broker,
            self.kill_controller,
            self.elect_preferred_leaders,
            self.fill_disk,
        ]
        for _ in range(faults):
            self.done.append(await self.rng.choice(kinds)())
            print("fault:", self.done[-1])  # shown with a failure
            # Every broker back in the cluster, then some time without faults.
            await self.eventually(lambda: self.cluster.has_alive_brokers(set(BROKERS)), DEADLINE_S)
            await asyncio.sleep(self.rng.uniform(0.2, 1.5))

    async def hold(self) -> float:
        """How long a fault lasts: sometimes shorter than the 1.5 s ISR lag time and broker
        session, sometimes longer."""
        held = self.rng.uniform(0.2, 3.0)
        await asyncio.sleep(held)
        return held

    async def kill_broker(self) -> str:
        broker = self.rng.choice(BROKERS)
        self.cluster.brokers[broker].kill()
        held = await self.hold()
        await self.start(broker)
        return f"kill -9 broker {broker} for {held:.1f} s"

    async def restart_broker(self) -> str:
        broker = self.rng.choice(BROKERS)
        await asyncio.to_thread(self.cluster.brokers[broker].stop)
        await self.start(broker)
        return f"restart broker {broker}"

    async def start(self, broker: int) -> None:
        await self.cluster.start_broker(broker, controller_proxies=True, inbound_proxy=True)

    async def fill_disk(self) -> str:
        """The broker's disk fills up: killed and started again under a file size limit a
        little past its largest file, it stops by itself at its first write past the limit
        (or the fault ends first), and starts again with room."""
        broker = self.rng.choice(BROKERS)
        self.cluster.brokers[broker].kill()
        files = (self.cluster.root / f"broker-{broker}").rglob("*")
        largest = max((f.stat().st_size for f in files if f.is_file()), default=0)
        limit = largest + self.rng.randint(1, 64) * 1024
        await self.cluster.start_broker(
            broker, controller_proxies=True, inbound_proxy=True, file_size_limit=limit
        )
        process = self.cluster.brokers[broker]
        deadline = asyncio.get_running_loop().time() + FULL_DISK_S
        while process.running and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        outcome = "it stopped" if not process.running else "not reached"
        if not process.running:
            assert process.proc is not None and process.proc.returncode == HALT_EXIT_CODE
        process.kill()
        await self.start(broker)
        return f"fill the disk of broker {broker} ({largest} + {limit - largest} bytes): {outcome}"

    async def cut_broker_off(self) -> str:
        broker = self.rng.choice(BROKERS)
        mode = self.rng.choice([LinkMode.DROP, LinkMode.BLACKHOLE])
        held = await self.cut(broker, mode, controllers=True, callers=False)
        return f"cut broker {broker} off the controllers ({mode.value}) for {held:.1f} s"

    async def isolate_broker(self) -> str:
        """Nobody reaches the broker; with `whole`, it reaches no controller either (it
        still fetches from the other brokers)."""
        broker = self.rng.choice(BROKERS)
        mode = self.rng.choice([LinkMode.DROP, LinkMode.BLACKHOLE])
        whole = self.rng.random() < 0.5
        held = await self.cut(broker, mode, controllers=whole, callers=True)
        what = "and its controller links " if whole else ""
        return f"cut the links into broker {broker} {what}({mode.value}) for {held:.1f} s"

    async def cut(self, broker: int, mode: LinkMode, controllers: bool, callers: bool) -> float:
        """Its links to the controllers, and those of everyone who calls it, as asked."""

        def set_links(to: LinkMode) -> None:
            if controllers:
                self.cluster.cut_off(broker, to)
            if callers:
                self.cluster.isolate(broker, to)

        set_links(mode)
        try:
            return await self.hold()
        finally:
            set_links(LinkMode.PASS)

    async def pause_broker(self) -> str:
        broker = self.rng.choice(BROKERS)
        return f"pause broker {broker} for {await self.pause([broker]):.1f} s"

    async def pause_two_brokers(self) -> str:
        brokers = self.rng.sample(BROKERS, 2)
        return f"pause brokers {brokers} for {await self.pause(brokers):.1f} s"

    async def pause(self, brokers: list[int]) -> float:
        for broker in brokers:
            self.cluster.brokers[broker].signal(signal.SIGSTOP)
        try:
            return await self.hold()
        finally:
            for broker in brokers:
                self.cluster.brokers[broker].signal(signal.SIGCONT)

    async def elect_preferred_leaders(self) -> str:
        """Leaders back to the first replica of each partition where it is in sync; the
        outcome, whatever it is, does not matter here (the controller may be moving)."""
        with contextlib.suppress(TidewaterError, grpc.aio.AioRpcError):
            await self.cluster.call_controller(
                "ElectLeaders",
                cpb.ElectLeadersRequest(election_type=cpb.ELECTION_TYPE_PREFERRED),
            )
        return "elect preferred leaders"

    async def kill_controller(self) -> str:
        active = await self.cluster.store.active_controller()
        assert active is not None
        controller_id, address, _ = active
        self.cluster.controllers[controller_id].kill()
        down_s = await self.hold()
        # On its old address: the brokers were started knowing it.
        await self.cluster.start_controller(controller_id, listen=address)
        return f"kill -9 controller {controller_id} for {down_s:.1f} s"


class Sends:
    """Values "<partition>-<n>" to each partition in turn, n counting up across partitions."""

    def __init__(self) -> None:
        self.futures: dict[bytes, RecordFuture] = {}
        self.stop = asyncio.Event()

    async def run(self, producer: Producer) -> None:
        waiting: deque[RecordFuture] = deque()
        for n in range(MAX_RECORDS):
            if self.stop.is_set():
                break
            partition = n % PARTITIONS
            value = f"{partition}-{n}".encode()
            self.futures[value] = future = await producer.send(TOPIC, value, partition=partition)
            waiting.append(future)
            while len(waiting) > IN_FLIGHT or (waiting and waiting[0].done()):
                with contextlib.suppress(Exception):  # failures are counted at the end
                    await waiting.popleft()
            if n % 20 == 0:
                await asyncio.sleep(0.002)  # leave the faults' side of the loop some time
        await producer.flush()

    def acknowledged(self) -> dict[bytes, int]:
        return {
            value: future.result().offset
            for value, future in self.futures.items()
            if future.done() and future.exception() is None
        }


class Reads:
    """What a consumer reads of every partition from the start while the faults go on."""

    def __init__(self) -> None:
        self.seen: dict[int, list[tuple[int, bytes]]] = {p: [] for p in range(PARTITIONS)}
        self.errors: list[str] = []

    async def run(self, bootstrap: list[str], stop: asyncio.Event) -> None:
        async with Consumer(
            bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=200, request_timeout_ms=3000
        ) as consumer:
            consumer.assign([(TOPIC, p) for p in range(PARTITIONS)])
            while not stop.is_set():
                try:
                    fetched = await consumer.poll_partitions(200)
                except (TidewaterError, ClientError) as e:  # a leader gone: ask again
                    self.errors.append(str(e))
                    await asyncio.sleep(0.1)
                    continue
                for (_, partition), records in fetched.items():
                    self.seen[partition] += [(r.offset, r.value or b"") for r in records]


def stored(root: Path, broker: int, partition: int) -> bytes:
    log = Log.open(root / f"broker-{broker}" / f"{TOPIC}-{partition}", LogConfig())
    try:
        return log_bytes(log, log.log_end_offset)
    finally:
        log.close()


@pytest.mark.parametrize("seed", seeds())
async def test_a_random_schedule_of_faults_loses_no_acknowledged_record_and_leaves_replicas_equal(
    make_cluster: Callable[..., Awaitable[Cluster]],
    eventually: Eventually,
    tmp_path: Path,
    seed: int,
) -> None:
    cluster = await make_cluster(metadata=True, controller_proxies=BROKERS, inbound_proxies=BROKERS)
    await cluster.create_topic(TOPIC, partitions=PARTITIONS, rf=3, **{"min.insync.replicas": "2"})
    await eventually(lambda: cluster.settled([TOPIC]), DEADLINE_S)
    nemesis = Nemesis(cluster, random.Random(seed), eventually)
    sends = Sends()
    reads = Reads()
    async with Producer(cluster.bootstrap, **PRODUCER) as producer:
        producing = asyncio.create_task(sends.run(producer))
        reading = asyncio.create_task(reads.run(cluster.bootstrap, sends.stop))
        try:
            await eventually(lambda: len(sends.acknowledged()) >= 500, DEADLINE_S)
            await nemesis.run(FAULTS)
        finally:
            sends.stop.set()
            await producing
            await reading
    acknowledged = sends.acknowledged()
    assert len(acknowledged) > 500, nemesis.done

    await eventually(lambda: cluster.settled([TOPIC]), DEADLINE_S)
    leaders = {p: state["leader"] for p, state in (await cluster.partitions(TOPIC)).items()}
    logs: dict[int, list[tuple[int, bytes]]] = {}
    for partition, leader in leaders.items():
        served = await read_served(cluster.broker_stub(leader), TOPIC, partition, timeout_s=10)
        logs[partition] = [(r.offset, r.value or b"") for r in decode_batches(served)]

    offsets: dict[bytes, list[int]] = {}
    for partition, records in logs.items():
        for offset, value in records:
            offsets.setdefault(value, []).append(offset)
        numbers = [int(value.split(b"-")[1]) for _, value in records]
        assert numbers == sorted(numbers), (partition, nemesis.done)
    assert [v for v, found in offsets.items() if len(found) > 1] == [], nemesis.done
    lost = {v: o for v, o in acknowledged.items() if offsets.get(v) != [o]}
    assert lost == {}, nemesis.done
    assert sum(map(len, reads.seen.values())) > 0, reads.errors
    for partition, records in reads.seen.items():
        unread = set(records) - set(logs[partition])
        assert unread == set(), (partition, sorted(unread)[:5], nemesis.done)

    # Every replica holds what its leader holds, byte for byte (read from the files), once
    # the HW has reached the leader's log end: every follower has fetched all of it.
    async def caught_up() -> bool:
        for partition, leader in leaders.items():
            ends = []
            for replica_id in (-1, leader):  # a consumer sees the HW, the leader its LEO
                response = await cluster.broker_stub(leader).ListOffsets(
                    list_offsets(TOPIC, partition, pb.OFFSET_SPEC_LATEST, replica_id=replica_id),
                    timeout=10,
                )
                ends.append(response.partitions[0].offset)
            if ends[0] != ends[1]:
                return False
        return True

    await eventually(caught_up, DEADLINE_S)
    for broker in BROKERS:
        cluster.brokers[broker].kill()
    for partition in range(PARTITIONS):
        copies = {broker: stored(tmp_path, broker, partition) for broker in BROKERS}
        assert len(set(copies.values())) == 1, (partition, {b: len(c) for b, c in copies.items()})
