"""A stand-in for the controller, until the controller service exists: the demo and the tests
play the controller with it. It sends LeaderAndIsr by hand and answers brokers' AlterIsr
proposals the way the controller will (validate leader epoch and partition epoch, commit,
answer with the committed state; a retry of what is committed already gets that state)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from tidewater.controller.service import PRODUCER_ID_BLOCK
from tidewater.rpc.handlers import add_service
from tidewater.rpc.server import CHANNEL_OPTIONS, ServiceHost
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc, common_pb2, controller_pb2, controller_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode


def leader_and_isr_request(
    topic: str,
    partition: int,
    *,
    leader: int,
    leader_epoch: int,
    replicas: Sequence[int],
    isr: Sequence[int] | None = None,
    controller_epoch: int = 1,
    configs: dict[str, str] | None = None,
    leaders: dict[int, str] | None = None,
    topic_id: bytes = b"",
    partition_epoch: int | None = None,
    elr: Sequence[int] = (),
) -> pb.LeaderAndIsrRequest:
    """LeaderAndIsr for one partition; `leaders` maps broker ids to addresses (host:port) so
    followers can reach the leader; `topic_id` empty: none (a controller without ids);
    `partition_epoch` None: the leader epoch; `elr`: the eligible leader replicas."""
    state = PartitionState(
        leader=leader,
        leader_epoch=leader_epoch,
        isr=list(isr if isr is not None else replicas),
        replicas=list(replicas),
        partition_epoch=leader_epoch if partition_epoch is None else partition_epoch,
    )
    return pb.LeaderAndIsrRequest(
        controller_id=0,
        controller_epoch=controller_epoch,
        partition_states=[
            pb.LeaderAndIsrPartitionState(
                **state.fields(topic, partition, controller_epoch),
                is_new=True,
                topic_id=topic_id,
                eligible_leader_replicas=list(elr),
            )
        ],
        topic_configs=[common_pb2.TopicConfig(topic=topic, configs=configs or {})],
        live_leaders=[
            common_pb2.BrokerInfo(
                broker_id=broker_id,
                endpoint=common_pb2.Endpoint(
                    host=address.rpartition(":")[0], port=int(address.rpartition(":")[2])
                ),
            )
            for broker_id, address in (leaders or {}).items()
        ],
    )


async def make_leader(
    channel: grpc.aio.Channel, topic: str, partition: int, **kwargs: object
) -> pb.LeaderAndIsrResponse:
    """Send LeaderAndIsr for one partition; raise if the broker refused it."""
    return await _send(channel, leader_and_isr_request(topic, partition, **kwargs))  # type: ignore[arg-type]


async def _send(
    channel: grpc.aio.Channel, request: pb.LeaderAndIsrRequest
) -> pb.LeaderAndIsrResponse:
    response = await broker_pb2_grpc.BrokerControlStub(channel).LeaderAndIsr(request)
    errors = [response.error_code] + [p.error_code for p in response.partition_errors]
    if any(code != ErrorCode.NONE for code in errors):
        raise RuntimeError(f"LeaderAndIsr refused: {response}")
    return response


@dataclass
class PartitionState:
    leader: int
    leader_epoch: int
    isr: list[int]
    replicas: list[int]
    partition_epoch: int

    def fields(self, topic: str, partition: int, controller_epoch: int = 1) -> dict[str, Any]:
        """The fields a partition's state has in both LeaderAndIsr and UpdateMetadata."""
        return {
            "topic": topic,
            "partition": partition,
            "controller_epoch": controller_epoch,
            "leader": self.leader,
            "leader_epoch": self.leader_epoch,
            "isr": self.isr,
            "partition_epoch": self.partition_epoch,
            "replicas": self.replicas,
        }


@dataclass
class StandinController(controller_pb2_grpc.ControllerServiceServicer):
    """Keeps each partition's LeaderAndIsr and drives brokers at known addresses."""

    brokers: dict[int, str]
    configs: dict[str, dict[str, str]] = field(default_factory=dict)
    states: dict[tuple[str, int], PartitionState] = field(default_factory=dict)
    # Every committed ISR change, in order: (topic, partition, new ISR).
    isr_changes: list[tuple[str, int, list[int]]] = field(default_factory=list)
    host: ServiceHost | None = None
    next_producer_id: int = 0
    # AllocateProducerIds calls to answer NOT_CONTROLLER, as during a controller election.
    refuse_producer_ids: int = 0
    # AlterIsr calls whose answer is lost after the commit (the RPC fails UNAVAILABLE), as when
    # the connection drops or the controller loses its lease before answering.
    lose_alter_isr_answers: int = 0
    # BrokerHeartbeat calls answered so far.
    heartbeats: int = 0

    async def start(self) -> str:
        """Serve ControllerService (AlterIsr) on 127.0.0.1; returns the address."""
        self.host = ServiceHost(
            [controller_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name]
        )
        add_service(
            controller_pb2_grpc.add_ControllerServiceServicer_to_server, self, self.host.server
        )
        port = self.host.bind("127.0.0.1", 0)
        await self.host.start()
        await self.host.set_serving()
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.host is not None:
            await self.host.stop(0)

    async def elect(
        self,
        topic: str,
        partition: int,
        leader: int,
        replicas: Sequence[int] | None = None,
        isr: Sequence[int] | None = None,
    ) -> None:
        """A new leader epoch with `leader`, sent to every live replica (brokers listed in
        `brokers`; the others are skipped as dead)."""
        tp = (topic, partition)
        old = self.states.get(tp)
        replicas = list(replicas if replicas is not None else old.replicas if old else [leader])
        state = PartitionState(
            leader=leader,
            leader_epoch=old.leader_epoch + 1 if old else 1,
            isr=list(isr if isr is not None else old.isr if old else replicas),
            replicas=replicas,
            partition_epoch=old.partition_epoch + 1 if old else 1,
        )
        self.states[tp] = state
        for broker_id in replicas:
            address = self.brokers.get(broker_id)
            if address is None:
                continue
            async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
                request = leader_and_isr_request(
                    topic,
                    partition,
                    leader=leader,
                    leader_epoch=state.leader_epoch,
                    replicas=replicas,
                    isr=state.isr,
                    configs=self.configs.get(topic),
                    leaders={leader: self.brokers[leader]} if leader in self.brokers else {},
                )
                request.partition_states[0].partition_epoch = state.partition_epoch
                await _send(channel, request)

    async def RegisterBroker(
        self, request: controller_pb2.RegisterBrokerRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.RegisterBrokerResponse:
        return controller_pb2.RegisterBrokerResponse(broker_epoch=1)

    async def BrokerHeartbeat(
        self, request: controller_pb2.BrokerHeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.BrokerHeartbeatResponse:
        self.heartbeats += 1
        return controller_pb2.BrokerHeartbeatResponse()

    async def ControlledShutdown(
        self, request: controller_pb2.ControlledShutdownRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.ControlledShutdownResponse:
        """The stand-in moves no leadership: the test decides who leads."""
        return controller_pb2.ControlledShutdownResponse()

    async def AllocateProducerIds(
        self,
        request: controller_pb2.AllocateProducerIdsRequest,
        context: grpc.aio.ServicerContext,
    ) -> controller_pb2.AllocateProducerIdsResponse:
        """Blocks from a counter: unique within this stand-in's life, as the tests need."""
        if self.refuse_producer_ids > 0:
            self.refuse_producer_ids -= 1
            return controller_pb2.AllocateProducerIdsResponse(error_code=ErrorCode.NOT_CONTROLLER)
        first = self.next_producer_id
        self.next_producer_id += PRODUCER_ID_BLOCK
        return controller_pb2.AllocateProducerIdsResponse(
            first_producer_id=first, producer_id_count=PRODUCER_ID_BLOCK
        )

    async def AlterIsr(
        self, request: controller_pb2.AlterIsrRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.AlterIsrResponse:
        response = controller_pb2.AlterIsrResponse()
        for p in request.partitions:
            result = response.partitions.add(topic=p.topic, partition=p.partition)
            state = self.states.get((p.topic, p.partition))
            if state is None:
                result.error_code = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
            elif p.leader_epoch != state.leader_epoch or request.broker_id != state.leader:
                result.error_code = ErrorCode.FENCED_LEADER_EPOCH
            elif p.partition_epoch != state.partition_epoch:
                # Kafka's rule for a retry whose first attempt committed: answer the state.
                if list(p.new_isr) != state.isr:
                    result.error_code = ErrorCode.INVALID_UPDATE_VERSION
            else:
                state.isr = list(p.new_isr)
                state.partition_epoch += 1
                self.isr_changes.append((p.topic, p.partition, list(p.new_isr)))
            if state is not None:
                result.leader = state.leader
                result.leader_epoch = state.leader_epoch
                result.isr.extend(state.isr)
                result.partition_epoch = state.partition_epoch
        if self.lose_alter_isr_answers > 0:
            self.lose_alter_isr_answers -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the answer was lost")
        return response
