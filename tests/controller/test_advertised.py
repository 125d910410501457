"""Advertised addresses (Kafka's advertised.listeners) in a real cluster: every controller and
broker binds 127.0.0.1:P and advertises a TCP proxy in front of it. Followers, the
controller and brokers following a standby's NOT_CONTROLLER hold connections to the proxies and
none to the bound ports (what `ss -tnp` would show an operator); the SDK's clients are told only
the proxies, and work through them."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.controller.cluster import BROKER_SETTINGS, LEASE_TTL_S, SESSION_TIMEOUT_MS
from tidewater.client.admin import Admin
from tidewater.client.consumer import Consumer
from tidewater.client.metadata import ClusterMetadata
from tidewater.client.producer import Producer
from tidewater.controller.server import run_controller
from tidewater.controller.store import ControllerStore
from tidewater.errors import InvalidConfig
from tidewater.local.etcd import EtcdProcess, free_port
from tidewater.local.process import ManagedProcess, ProcessFailed, broker_args, controller_args
from tidewater.local.tcp_proxy import NOWHERE, TcpProxy
from tidewater.local.wait import eventually
from tidewater.metadata.server import MetadataServer

TOPIC = "advertised"
RECORDS = 200
DEADLINE_S = 30.0


@dataclass
class Fronted:
    """A service process bound to `bound`, advertising the proxy in front of it."""

    process: ManagedProcess
    proxy: TcpProxy
    bound: str = ""

    @property
    def advertised(self) -> str:
        return self.proxy.address


@dataclass
class AdvertisedCluster:
    root: Path
    metadata: MetadataServer
    controllers: dict[int, Fronted] = field(default_factory=dict)
    brokers: dict[int, Fronted] = field(default_factory=dict)
    # Everything started, for close() even when a start fails halfway.
    started: list[Fronted] = field(default_factory=list)

    async def front(self, name: str, make_args: Callable[[str, str], list[str]]) -> Fronted:
        """Start a proxy, then the process advertising it on a port the process binds, then
        point the proxy at that port."""
        proxy = TcpProxy(NOWHERE)
        advertised = await proxy.start()
        process = ManagedProcess(name, make_args("127.0.0.1:0", advertised), self.root)
        fronted = Fronted(process, proxy)
        self.started.append(fronted)
        fronted.bound = await asyncio.to_thread(fronted.process.start)
        proxy.retarget(fronted.bound)
        return fronted

    async def close(self) -> None:
        for fronted in self.started:
            fronted.process.kill()
            await fronted.proxy.stop()
        await self.metadata.stop(0)


def dialled(process: ManagedProcess | psutil.Process) -> set[str]:
    """host:port of every peer the process holds an established TCP connection to (gRPC's
    dual-stack sockets name 127.0.0.1 as ::ffff:127.0.0.1)."""
    proc = process if isinstance(process, psutil.Process) else psutil.Process(process.pid)
    peers = set()
    for c in proc.net_connections(kind="tcp"):
        if c.raddr and c.status == psutil.CONN_ESTABLISHED:
            ip = ipaddress.ip_address(c.raddr.ip)
            mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
            peers.add(f"{mapped or ip}:{c.raddr.port}")
    return peers


@pytest.fixture
async def advertised_cluster(
    etcd: EtcdProcess, cluster_name: str, tmp_path: Path
) -> AsyncIterator[AdvertisedCluster]:
    """Controller 1 (active), controller 2 (standby), brokers 1-3 and a metadata service.
    Brokers are configured with the standby's bound address only: the active controller's
    address they can learn only from the standby's NOT_CONTROLLER answer, read from etcd."""
    metadata = MetadataServer("127.0.0.1:0")
    await metadata.start()
    cluster = AdvertisedCluster(tmp_path, metadata)
    store = await ControllerStore.connect([etcd.endpoint], cluster_name)
    try:
        for controller_id in (1, 2):
            cluster.controllers[controller_id] = await cluster.front(
                f"controller-{controller_id}",
                lambda bound, advertised, i=controller_id: controller_args(
                    i,
                    etcd.endpoint,
                    cluster_name,
                    bound,
                    LEASE_TTL_S,
                    SESSION_TIMEOUT_MS,
                    metadata_addresses=(metadata.address,),
                    advertised=advertised,
                ),
            )
            if controller_id == 1:
                await eventually(store.active_controller, DEADLINE_S)
        standby = cluster.controllers[2].bound
        for broker_id in (1, 2, 3):
            cluster.brokers[broker_id] = await cluster.front(
                f"broker-{broker_id}",
                lambda bound, advertised, i=broker_id: broker_args(
                    i,
                    tmp_path / f"broker-{i}",
                    bound,
                    {"controllers": standby, **BROKER_SETTINGS},
                    # Kafka's listener form, as a Kafka user would write it.
                    advertised=f"PLAINTEXT://{advertised}",
                ),
            )
        yield cluster
    finally:
        await store.close()
        await cluster.close()


async def test_every_service_is_dialled_at_its_advertised_address(
    advertised_cluster: AdvertisedCluster, etcd: EtcdProcess, cluster_name: str
) -> None:
    cluster = advertised_cluster
    controller = cluster.controllers[1]
    brokers = cluster.brokers
    bootstrap = [cluster.metadata.address]
    store = await ControllerStore.connect([etcd.endpoint], cluster_name)
    metadata = ClusterMetadata(bootstrap)
    try:
        assert (await store.active_controller())[:2] == (1, controller.advertised)

        # What clients are told: GetMetadata names the proxies, never a bound port.
        async def every_broker_listed() -> bool:
            await metadata.refresh()
            return len(metadata.brokers) == 3

        await eventually(every_broker_listed, DEADLINE_S)
        assert metadata.brokers == {i: b.advertised for i, b in brokers.items()}
        assert metadata.controller == controller.advertised

        # The admin client finds the controller through the metadata service: at its proxy.
        async with Admin([], bootstrap) as admin:
            await admin.create_topic(TOPIC, partitions=1, replication_factor=3)

        async def leader_known() -> int:
            await metadata.refresh([TOPIC])
            info = metadata.partitions.get((TOPIC, 0))
            return info.leader if info is not None and info.leader >= 0 else 0

        leader_id = await eventually(leader_known, DEADLINE_S)
    finally:
        await metadata.close()
        await store.close()
    leader = brokers[leader_id]

    async with Producer(bootstrap, acks=-1, linger_ms=1) as producer:
        sent = [await producer.send(TOPIC, str(i).encode(), partition=0) for i in range(RECORDS)]
        assert [(await ack).offset for ack in sent] == list(range(RECORDS))
        # The producer, in this process, holds a connection to the leader's proxy.
        assert leader.advertised in dialled(psutil.Process())
    async with Consumer(bootstrap, auto_offset_reset="earliest") as consumer:
        consumer.assign([(TOPIC, 0)])
        values: list[bytes] = []

        async def all_read() -> bool:
            values.extend(r.value for r in await consumer.poll(200))
            return len(values) >= RECORDS

        await eventually(all_read, DEADLINE_S)
        assert values == [str(i).encode() for i in range(RECORDS)]
        assert leader.advertised in dialled(psutil.Process())

    # Followers fetch from the leader's proxy, never from its bound port.
    for broker_id, follower in brokers.items():
        if broker_id != leader_id:
            await eventually(lambda f=follower: leader.advertised in dialled(f.process), DEADLINE_S)
            assert leader.bound not in dialled(follower.process)
    # Given the standby only, each broker followed its NOT_CONTROLLER answer to the proxy.
    for broker in brokers.values():
        await eventually(lambda b=broker: controller.advertised in dialled(b.process), DEADLINE_S)
        assert controller.bound not in dialled(broker.process)
    # The controller sends LeaderAndIsr and UpdateMetadata to what the brokers registered.
    await eventually(
        lambda: {b.advertised for b in brokers.values()} <= dialled(controller.process),
        DEADLINE_S,
    )
    assert not {b.bound for b in brokers.values()} & dialled(controller.process)


@pytest.mark.parametrize(
    ("listen", "advertised", "message"),
    [
        (
            "0.0.0.0:0",  # were a regression to let it bind: no fixed port, nothing taken
            "",
            "--listen binds the wildcard address 0.0.0.0, which nobody can dial: "
            "set --advertised-address to",
        ),
        ("[::]:0", "", "--listen binds the wildcard address"),
        ("127.0.0.1:0", "0.0.0.0:9093", "--advertised-address cannot be the wildcard address"),
        ("127.0.0.1:0", "c1:0", "--advertised-address needs the port others dial, not 0"),
        ("127.0.0.1:0", "c1", "--advertised-address must be HOST:PORT"),
        ("127.0.0.1:0", "c1:9093,c2:9093", "--advertised-address .*one listener"),
        ("127.0.0.1:0", "SSL://c1:9093", "--advertised-address .*no SSL listener"),
    ],
)
async def test_controller_refuses_to_publish_an_address_nobody_can_dial(
    listen: str, advertised: str, message: str
) -> None:
    # Refused before it binds or reaches etcd (nothing listens at the etcd address).
    with pytest.raises(InvalidConfig, match=message):
        await run_controller(
            1, listen, [f"127.0.0.1:{free_port()}"], "x", 5, 6000, advertised_address=advertised
        )


@pytest.mark.parametrize("role", ["broker", "controller"])
def test_a_wildcard_bind_without_an_advertised_address_stops_the_service(
    role: str, tmp_path: Path
) -> None:
    args = (
        broker_args(1, tmp_path / "broker-1", "0.0.0.0:0", {})
        if role == "broker"
        else controller_args(1, f"127.0.0.1:{free_port()}", "x", "0.0.0.0:0")
    )
    process = ManagedProcess(role, args, tmp_path)
    try:
        with pytest.raises(ProcessFailed, match="exited with 1") as failed:
            process.start()
    finally:
        process.kill()  # were it to start after all
    assert "tidewater: INVALID_CONFIG: " in str(failed.value)
    assert "binds the wildcard address 0.0.0.0" in str(failed.value)
    assert "--advertised-address" in str(failed.value)
