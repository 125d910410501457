"""A real cluster for the client tests: brokers (in-process servers, or child processes), the
stand-in controller, and a metadata service fed the controller's view, which the test
publishes as the controller's UpdateMetadata would. The `cluster` and `process_cluster`
fixtures (conftest.py) start them."""

from __future__ import annotations

import grpc

from tidewater.broker.server import BrokerServer
from tidewater.local.process import ManagedProcess
from tidewater.local.standin_controller import StandinController
from tidewater.metadata.server import MetadataServer
from tidewater.v1 import cluster_pb2, common_pb2, metadata_pb2_grpc


class Cluster:
    def __init__(
        self,
        controller: StandinController,
        brokers: dict[int, BrokerServer] | dict[int, ManagedProcess],
        meta: MetadataServer,
    ) -> None:
        self.controller = controller
        self.brokers = brokers
        self.metadata = meta
        # Where clients are told a broker listens, when not where it does (a proxy).
        self.advertised: dict[int, str] = {}

    @property
    def bootstrap(self) -> list[str]:
        return [self.metadata.address]

    async def create_topic(self, topic: str, partitions: int = 1) -> None:
        for p in range(partitions):
            await self.controller.elect(topic, p, leader=1 + p % 3, replicas=[1, 2, 3])
        await self.publish()

    async def move_leader(self, topic: str, partition: int, leader: int) -> None:
        await self.controller.elect(topic, partition, leader=leader)
        await self.publish()

    async def kill(self, broker_id: int) -> None:
        """kill -9 a broker process; its partitions move to the first live member of their
        ISR, as the controller would do."""
        broker = self.brokers[broker_id]
        assert isinstance(broker, ManagedProcess)
        broker.kill()
        del self.controller.brokers[broker_id]
        for (topic, partition), state in list(self.controller.states.items()):
            if state.leader == broker_id:
                isr = [b for b in state.isr if b != broker_id]
                await self.controller.elect(topic, partition, leader=isr[0], isr=isr)
        await self.publish()

    async def publish(self) -> None:
        """Push the controller's full view to the metadata service."""
        request = cluster_pb2.UpdateMetadataRequest(
            controller_id=0,
            controller_epoch=1,
            type=cluster_pb2.UPDATE_METADATA_TYPE_FULL,
            live_brokers=[
                common_pb2.BrokerInfo(
                    broker_id=broker_id,
                    endpoint=common_pb2.Endpoint(
                        host=address.rpartition(":")[0], port=int(address.rpartition(":")[2])
                    ),
                )
                for broker_id, address in (
                    (b, self.advertised.get(b, a)) for b, a in self.controller.brokers.items()
                )
            ],
            partition_states=[
                cluster_pb2.UpdateMetadataPartitionState(**state.fields(topic, partition))
                for (topic, partition), state in self.controller.states.items()
            ],
        )
        async with grpc.aio.insecure_channel(self.metadata.address) as channel:
            response = await metadata_pb2_grpc.MetadataControlStub(channel).UpdateMetadata(request)
        assert response.error_code == 0, response.error_message
