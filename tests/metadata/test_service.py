"""The metadata service over real gRPC: health and UNAVAILABLE until the controller's first
FULL view, epoch fencing of UpdateMetadata, reflection, and the `tidewater metadata` process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.metadata.updates import DELTA, FULL, state, update
from tidewater.devtools.protogen import PROTO_ROOT, proto_files
from tidewater.errors import InvalidConfig
from tidewater.local.process import ManagedProcess
from tidewater.metadata.server import MetadataServer
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import cluster_pb2, metadata_pb2, metadata_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

SERVICES = ("tidewater.v1.MetadataService", "tidewater.v1.MetadataControl")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def orders_update(
    kind: int, epoch: int, leader: int = 1, controller_id: int = 1
) -> cluster_pb2.UpdateMetadataRequest:
    """One topic, "orders", with one partition led by `leader` on brokers 1 and 2."""
    partition = state("orders", 0, leader=leader, replicas=[1, 2], leader_epoch=epoch)
    return update(kind, epoch, [partition], brokers=[1, 2], controller_id=controller_id)


class Client:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.metadata = metadata_pb2_grpc.MetadataServiceStub(channel)
        self.control = metadata_pb2_grpc.MetadataControlStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.reflection = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def health_statuses(self) -> set[int]:
        return {
            (await self.health.Check(health_pb2.HealthCheckRequest(service=name))).status
            for name in ("", *SERVICES)
        }


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    server = MetadataServer("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    yield Client(channel)
    await channel.close()
    await server.stop(grace_s=0)


async def test_unavailable_until_the_first_full_view(client: Client) -> None:
    assert await client.health_statuses() == {NOT_SERVING}
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.metadata.GetMetadata(metadata_pb2.GetMetadataRequest())
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # A DELTA has no view to amend: refused, and still not serving.
    response = await client.control.UpdateMetadata(orders_update(DELTA, 1))
    assert response.error_code == ErrorCode.INVALID_UPDATE_VERSION
    assert await client.health_statuses() == {NOT_SERVING}

    response = await client.control.UpdateMetadata(orders_update(FULL, 1))
    assert response.error_code == ErrorCode.NONE
    assert await client.health_statuses() == {SERVING}
    view = await client.metadata.GetMetadata(metadata_pb2.GetMetadataRequest())
    assert view.controller.controller_id == 1
    assert view.controller.endpoint.port == 9093
    assert [b.broker_id for b in view.brokers] == [1, 2]
    [orders] = view.topics
    assert orders.topic == "orders"
    assert [(p.partition, p.leader, list(p.replicas)) for p in orders.partitions] == [
        (0, 1, [1, 2])
    ]


async def test_deposed_controller_is_fenced(client: Client) -> None:
    assert (await client.control.UpdateMetadata(orders_update(FULL, 5, leader=2))).error_code == 0
    for kind in (FULL, DELTA):
        response = await client.control.UpdateMetadata(
            orders_update(kind, 4, leader=1, controller_id=9)
        )
        assert response.error_code == ErrorCode.STALE_CONTROLLER_EPOCH
        assert response.error_message
    view = await client.metadata.GetMetadata(metadata_pb2.GetMetadataRequest(topics=["orders"]))
    assert view.controller.controller_epoch == 5
    assert view.controller.controller_id == 1
    assert view.topics[0].partitions[0].leader == 2
    # The current controller still amends its view.
    assert (await client.control.UpdateMetadata(orders_update(DELTA, 5, leader=1))).error_code == 0
    view = await client.metadata.GetMetadata(metadata_pb2.GetMetadataRequest(topics=["orders"]))
    assert view.topics[0].partitions[0].leader == 1


async def test_reflection_lists_both_services(client: Client) -> None:
    responses = client.reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name async for r in responses for s in r.list_services_response.service}
    assert set(SERVICES) <= names
    assert "grpc.health.v1.Health" in names


async def test_reflection_serves_every_fields_json_name(client: Client) -> None:
    """grpcurl 1.8 prints a field under the json_name of the descriptor reflection serves,
    and under its proto name where it has none (`broker_id`, where newer versions print
    `brokerId`): the grpcurl walkthrough's lowerCamelCase needs every field to have one."""
    names = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    responses = client.reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(file_by_filename=n) for n in names])
    )
    files = {
        f.name: f
        async for r in responses
        for f in map(
            descriptor_pb2.FileDescriptorProto.FromString,
            r.file_descriptor_response.file_descriptor_proto,
        )
    }
    assert set(names) <= set(files)
    without = [
        f"{file.name}: {message.name}.{field.name}"
        for file in files.values()
        if file.name in names
        for message in messages(file.message_type)
        for field in message.field
        if not field.json_name
    ]
    assert not without


def messages(
    declared: Iterable[descriptor_pb2.DescriptorProto],
) -> Iterator[descriptor_pb2.DescriptorProto]:
    """Every message declared, nested ones included."""
    for message in declared:
        yield message
        yield from messages(message.nested_type)


def test_metadata_process_serves_once_fed_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc = ManagedProcess("metadata", ["metadata", "--listen", "127.0.0.1:0"], tmp_path)
    try:
        address = proc.start()
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="")
            assert health.Check(check, timeout=10).status == NOT_SERVING
            control = metadata_pb2_grpc.MetadataControlStub(channel)
            assert control.UpdateMetadata(orders_update(FULL, 1), timeout=10).error_code == 0
            assert health.Check(check, timeout=10).status == SERVING
        assert proc.stop() == 0  # SIGTERM, and a clean exit
        assert f"tidewater metadata listening on {address}" in proc.log_tail()
    finally:
        proc.kill()


@pytest.mark.parametrize("listen", ["9094", "127.0.0.1:", ":9094", "127.0.0.1:port"])
def test_listen_address_must_be_host_and_port(listen: str) -> None:
    with pytest.raises(InvalidConfig):
        MetadataServer(listen)
