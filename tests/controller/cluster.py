"""A real cluster for the controller tests: two controller processes and three broker
processes on the module's etcd (and, if asked, a metadata service for the SDK's clients), with
clients that talk to them as a user would. The `cluster` and `make_cluster` fixtures
(conftest.py) start them and kill every process at teardown."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aetcd
import grpc

from tidewater.controller.store import ControllerStore
from tidewater.errors import TidewaterError
from tidewater.local.etcd import EtcdProcess
from tidewater.local.fetch import consumer_fetch, read_served
from tidewater.local.process import ManagedProcess, broker_process, controller_args, metadata_args
from tidewater.local.scrape import Scrape, scrape
from tidewater.local.tcp_proxy import NOWHERE, LinkMode, TcpProxy
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch, decode_batches
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc, controller_pb2_grpc
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

LEASE_TTL_S = 2
SESSION_TIMEOUT_MS = 1500
BROKER_SETTINGS = {
    "broker.heartbeat.interval.ms": "200",
    "replica.lag.time.max.ms": "1500",
    "replica.fetch.backoff.ms": "100",
    "replica.fetch.wait.max.ms": "200",
}
RPC_TIMEOUT_S = 5.0

# The `eventually` fixture's type: tidewater.local.wait.eventually.
Eventually = Callable[[Callable[[], Any], float], Awaitable[Any]]


class Cluster:
    """Processes, and clients that talk to them as a user would."""

    lease_ttl_s = LEASE_TTL_S

    def __init__(
        self,
        root: Path,
        etcd: EtcdProcess,
        *,
        controller_ids: Sequence[int] = (1, 2),
        broker_ids: Sequence[int] = (1, 2, 3),
        controller_proxies: Sequence[int] = (),
        inbound_proxies: Sequence[int] = (),
        session_timeout_ms: int = SESSION_TIMEOUT_MS,
        leader_imbalance_check_interval_s: float = 300,
        metrics: bool = False,
        metadata: bool = False,
        min_insync_replicas: int | None = None,
    ) -> None:
        """The processes `start` starts: brokers in `controller_proxies` reach the controllers
        only through proxies (`cut_off`); brokers in `inbound_proxies` are reached (by brokers,
        controllers and clients) through one. `min_insync_replicas`: the controllers'
        --min-insync-replicas (None: theirs)."""
        self.root = root
        self.etcd = etcd
        self.controller_ids = controller_ids
        self.broker_ids = broker_ids
        self.controller_proxies = controller_proxies
        self.inbound_proxies = inbound_proxies
        self.session_timeout_ms = session_timeout_ms
        self.leader_imbalance_check_interval_s = leader_imbalance_check_interval_s
        self.min_insync_replicas = min_insync_replicas
        self.name = f"test-{uuid.uuid4().hex[:8]}"
        self.controllers: dict[int, ManagedProcess] = {}
        self.brokers: dict[int, ManagedProcess] = {}
        # The SDK's bootstrap: a metadata service the controllers keep up to date.
        self.metadata = (
            ManagedProcess("metadata", metadata_args("127.0.0.1:0"), root) if metadata else None
        )
        # Per broker started with `controller_proxies`: one proxy per controller address.
        self.controller_links: dict[int, list[TcpProxy]] = {}
        # Per broker started with `inbound_proxy`: the proxy everyone else reaches it through
        # (its advertised address; `isolate`). Kept across restarts, as is its port.
        self.broker_links: dict[int, TcpProxy] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._store: ControllerStore | None = None
        # With metrics: every process serves them on a port it binds and reports.
        self.metrics_port = 0 if metrics else None

    async def metrics(self, role: str, process_id: int) -> Scrape:
        """What Prometheus would scrape from a process (a cluster made with metrics)."""
        assert self.metrics_port is not None, "make the cluster with metrics=True"
        procs = {"controller": self.controllers, "broker": self.brokers}[role]
        return await scrape(procs[process_id].metrics_port)

    @property
    def bootstrap(self) -> list[str]:
        assert self.metadata is not None, "make the cluster with metadata=True"
        return [self.metadata.address]

    @property
    def store(self) -> ControllerStore:
        assert self._store is not None, "cluster not started"
        return self._store

    async def start(self) -> None:
        """Controllers, then brokers; returns once every broker is alive (unfenced)."""
        if self.metadata is not None:
            await asyncio.to_thread(self.metadata.start)
        for controller_id in self.controller_ids:
            await self.start_controller(controller_id)
        self._store = await ControllerStore.connect([self.etcd.endpoint], self.name)
        await eventually(self.store.active_controller, 10)
        for broker_id in self.broker_ids:
            await self.start_broker(
                broker_id,
                controller_proxies=broker_id in self.controller_proxies,
                inbound_proxy=broker_id in self.inbound_proxies,
            )
        await eventually(lambda: self.has_alive_brokers(set(self.broker_ids)), 30)

    async def start_controller(self, controller_id: int, listen: str = "127.0.0.1:0") -> str:
        """Start a controller process (a restart passes its old address, brokers know it:
        started again while another process holds it for a while, see start_when_free)."""
        proc = ManagedProcess(
            f"controller-{controller_id}",
            controller_args(
                controller_id,
                self.etcd.endpoint,
                self.name,
                listen,
                LEASE_TTL_S,
                self.session_timeout_ms,
                metadata_addresses=() if self.metadata is None else (self.metadata.address,),
                leader_imbalance_check_interval_s=self.leader_imbalance_check_interval_s,
                metrics_port=self.metrics_port,
                min_insync_replicas=self.min_insync_replicas,
            ),
            self.root,
        )
        self.controllers[controller_id] = proc
        return await asyncio.to_thread(proc.start_when_free)

    async def start_broker(
        self,
        broker_id: int,
        controller_proxies: bool = False,
        inbound_proxy: bool = False,
        file_size_limit: int | None = None,
        **settings: str,
    ) -> str:
        """Start (or restart, on the same log dir) a broker process. Its own address (for
        the test's clients) is the one it binds, even behind an inbound proxy. With
        `file_size_limit`, a write that would grow one of its files past it fails."""
        addresses = [p.address for p in self.controllers.values()]
        if controller_proxies:
            # The active controller first: the broker's first call must not be answered
            # NOT_CONTROLLER, which would hand it the active controller's own address.
            active = await self.store.active_controller()
            addresses.sort(key=lambda a: active is None or a != active[1])
            for proxy in self.controller_links.pop(broker_id, []):  # a restart's old ones
                await proxy.stop()
            proxies = [TcpProxy(address) for address in addresses]
            self.controller_links[broker_id] = proxies
            addresses = [await proxy.start() for proxy in proxies]
        advertised, link = "", None
        if inbound_proxy:
            # Leads nowhere until the broker has bound a port of its own.
            link = self.broker_links.get(broker_id) or TcpProxy(NOWHERE)
            if broker_id not in self.broker_links:
                self.broker_links[broker_id] = link
                await link.start()
            link.retarget(NOWHERE)
            advertised = link.address
        proc = broker_process(
            broker_id,
            self.root,
            {"controllers": ",".join(addresses), **BROKER_SETTINGS, **settings},
            metrics_port=self.metrics_port,
            advertised=advertised,
            file_size_limit=file_size_limit,
        )
        self.brokers[broker_id] = proc
        address = await asyncio.to_thread(proc.start)
        if link is not None:
            link.retarget(address)
        return address

    async def crash_controllers_after(self, write: Callable[[int], Awaitable[object]]) -> None:
        """Kill -9 every controller; then `write(controller epoch)` stores in etcd what the
        active one wrote last before it died, and it starts again (at its address) on that."""
        active = await self.store.active_controller()
        assert active is not None, "no active controller"
        controller_id, address, epoch = active
        for proc in self.controllers.values():
            proc.kill()  # returns once it has exited: its address is free again
        await write(epoch)
        await self.start_controller(controller_id, listen=address)

    def cut_off(self, broker_id: int, mode: LinkMode) -> None:
        """Set the link between a broker started with controller proxies and the controllers."""
        for proxy in self.controller_links[broker_id]:
            proxy.set_mode(mode)

    def isolate(self, broker_id: int, mode: LinkMode) -> None:
        """Set the link into a broker started with an inbound proxy: from other brokers (their
        fetches), the controllers (LeaderAndIsr) and clients."""
        self.broker_links[broker_id].set_mode(mode)

    async def close(self) -> None:
        for proc in [*self.brokers.values(), *self.controllers.values(), self.metadata]:
            if proc is not None:
                proc.kill()
        for proxies in [*self.controller_links.values(), self.broker_links.values()]:
            for proxy in proxies:
                await proxy.stop()
        for channel in self._channels.values():
            await channel.close()
        if self._store is not None:
            await self._store.close()

    # -- clients -----------------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return self._channels[address]

    def broker_stub(self, broker_id: int) -> broker_pb2_grpc.BrokerServiceStub:
        return broker_pb2_grpc.BrokerServiceStub(self._channel(self.brokers[broker_id].address))

    def control_stub(self, broker_id: int) -> broker_pb2_grpc.BrokerControlStub:
        """BrokerControl of a broker, as a controller would call it."""
        return broker_pb2_grpc.BrokerControlStub(self._channel(self.brokers[broker_id].address))

    def controller_stub(self, controller_id: int) -> controller_pb2_grpc.ControllerServiceStub:
        address = self.controllers[controller_id].address
        return controller_pb2_grpc.ControllerServiceStub(self._channel(address))

    async def call_controller(self, method: str, request: Any) -> Any:
        """Call the controller that etcd names active (a paused one would just hang), waiting
        up to 10 s for one, as an admin client retries through an election."""
        try:
            active = await eventually(self.store.active_controller, 10)
        except AssertionError:
            raise TidewaterError("no active controller", ErrorCode.NOT_CONTROLLER) from None
        stub = controller_pb2_grpc.ControllerServiceStub(self._channel(active[1]))
        response = await getattr(stub, method)(request, timeout=RPC_TIMEOUT_S)
        if response.error_code == ErrorCode.NOT_CONTROLLER:
            raise TidewaterError(response.error_message, ErrorCode.NOT_CONTROLLER)
        return response

    async def active_controller_log(self) -> str:
        """Everything the active controller has logged so far."""
        active = await self.store.active_controller()
        assert active is not None, "no active controller"
        return self.controllers[active[0]].log_file.read_text(errors="replace")

    async def partitions(self, topic: str) -> dict[int, dict[str, Any]]:
        """Each partition's LeaderAndIsr in etcd."""
        found = await self.store.load_partitions()
        return {p: value for (t, p), (value, _) in found.items() if t == topic}

    async def partition_history(
        self, topic: str, partition: int, since: int, timeout_s: float = RPC_TIMEOUT_S
    ) -> list[dict[str, Any]]:
        """Every LeaderAndIsr committed for a partition after partition epoch `since`, oldest
        first, up to the current one: etcd's history of its key (`partitions/<topic>/<p>`)."""
        _, current = (await self.store.load_partitions())[topic, partition]
        if current == since:
            return []
        host, _, port = self.etcd.endpoint.rpartition(":")
        key = f"/tidewater/{self.name}/partitions/{topic}/{partition}".encode()
        states: list[dict[str, Any]] = []
        async with aetcd.Client(host, int(port)) as client, asyncio.timeout(timeout_s):
            watch = await client.watch(key, start_revision=since + 1)
            async for event in watch:
                assert isinstance(event, aetcd.Event), event  # a broken stream's error
                states.append(json.loads(event.kv.value))
                if event.kv.mod_revision >= current:
                    break
            await watch.cancel()
        return states

    async def broker_statuses(self) -> dict[int, int]:
        """Broker id → BrokerStatus, per the active controller."""
        response = await self.call_controller("DescribeCluster", cpb.DescribeClusterRequest())
        return {b.broker.broker_id: b.status for b in response.brokers}

    async def alive_brokers(self) -> set[int]:
        statuses = await self.broker_statuses()
        return {b for b, status in statuses.items() if status == cpb.BROKER_STATUS_ALIVE}

    async def has_alive_brokers(self, expected: set[int]) -> bool:
        return expected <= await self.alive_brokers()

    async def create_topic(
        self,
        name: str,
        partitions: int = 0,
        rf: int = 0,
        assignments: Sequence[Sequence[int]] = (),
        **configs: str,
    ) -> None:
        """Create a topic: `partitions` of `rf` replicas placed by the controller, or explicit
        `assignments` (replicas of partition 0, 1, ...; preferred leader first)."""
        topic = cpb.CreatableTopic(
            name=name, num_partitions=partitions, replication_factor=rf, configs=configs
        )
        for partition, replicas in enumerate(assignments):
            topic.assignments.add(partition=partition, broker_ids=list(replicas))
        response = await self.call_controller(
            "CreateTopics", cpb.CreateTopicsRequest(topics=[topic])
        )
        result = response.topics[0]
        assert result.error_code == ErrorCode.NONE, result.error_message

    async def send(
        self, broker_id: int, topic: str, partition: int, value: bytes, timeout_ms: int = 5000
    ) -> pb.PartitionProduceResponse | None:
        """acks=all to one broker; its answer, or None if the call itself failed."""
        try:
            response = await self.broker_stub(broker_id).Produce(
                pb.ProduceRequest(
                    acks=-1,
                    timeout_ms=timeout_ms,
                    partitions=[
                        pb.PartitionProduceData(
                            topic=topic,
                            partition=partition,
                            record_batch=build_batch([Record(value=value)]),
                        )
                    ],
                ),
                timeout=timeout_ms / 1000 + 3,
            )
        except grpc.aio.AioRpcError:
            return None
        return response.partitions[0]

    async def produce(self, topic: str, partition: int, value: bytes) -> int | None:
        """acks=all to the partition's leader per etcd; the offset, or None if not
        acknowledged."""
        leader = (await self.partitions(topic))[partition]["leader"]
        if leader not in self.brokers or not self.brokers[leader].running:
            return None
        result = await self.send(leader, topic, partition, value)
        if result is None or result.error_code != ErrorCode.NONE:
            return None
        return result.base_offset

    async def produce_all(
        self, topic: str, partition: int, values: list[bytes]
    ) -> dict[bytes, int]:
        """acks=all, one value after the other, each of which must be acknowledged: value →
        offset."""
        acked = {}
        for value in values:
            offset = await self.produce(topic, partition, value)
            assert offset is not None, value
            acked[value] = offset
        return acked

    async def produced(self, topic: str, partition: int, value: bytes) -> bool:
        return await self.produce(topic, partition, value) is not None

    async def read(self, broker_id: int, topic: str, partition: int) -> dict[bytes, int]:
        """Every committed record a consumer can read from that broker: value → offset."""
        served = await read_served(
            self.broker_stub(broker_id), topic, partition, timeout_s=RPC_TIMEOUT_S
        )
        return {r.value: r.offset for r in decode_batches(served)}

    async def replica_sees(
        self, broker_id: int, topic: str, partition: int, leader: int, leader_epoch: int
    ) -> bool:
        """Whether a replica has applied this leader and leader epoch: the leader answers a
        consumer fetch naming its epoch (an older or newer one is refused), a follower refuses
        it and names the leader and epoch it follows."""
        response = await self.broker_stub(broker_id).Fetch(
            consumer_fetch(topic, partition, 0, leader_epoch=leader_epoch, max_bytes=1),
            timeout=RPC_TIMEOUT_S,
        )
        result = response.partitions[0]
        if result.error_code == ErrorCode.NONE:
            return broker_id == leader
        seen = (result.current_leader.leader_id, result.current_leader.leader_epoch)
        return result.error_code == ErrorCode.NOT_LEADER_OR_FOLLOWER and seen == (
            leader,
            leader_epoch,
        )

    async def applied(self, topics: list[str]) -> bool:
        """Every partition has a leader, and every replica applied that leader and leader
        epoch."""
        for topic in topics:
            assignment = (await self.store.load_topics())[topic]["assignment"]
            for p, state in (await self.partitions(topic)).items():
                if state["leader"] == -1:
                    return False
                for b in assignment[str(p)]:
                    if not await self.replica_sees(
                        b, topic, p, state["leader"], state["leader_epoch"]
                    ):
                        return False
        return True

    async def settled(self, topics: list[str]) -> bool:
        """Applied everywhere, and every ISR is full."""
        assignment = {t: (await self.store.load_topics())[t]["assignment"] for t in topics}
        for topic in topics:
            for p, state in (await self.partitions(topic)).items():
                if sorted(state["isr"]) != sorted(assignment[topic][str(p)]):
                    return False
        return await self.applied(topics)
