"""gRPC servicers of the broker: BrokerService (data plane) and BrokerControl (controller)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

import grpc
from opentelemetry.trace import SpanContext

from tidewater.broker.fetch_answer import FetchAnswer
from tidewater.broker.replica_manager import ReplicaManager, fetch_failed, produce_failed
from tidewater.rpc.handlers import Handlers, add_service
from tidewater.rpc.lifted import Lifted, Lifter
from tidewater.rpc.streams import pipelined
from tidewater.telemetry import tracing
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc, cluster_pb2


def _metadata(context: grpc.aio.ServicerContext) -> object:
    """Where a unary caller's trace context may be; not even read while tracing is off."""
    return context.invocation_metadata() if tracing.ENABLED else None


def _declared(context: grpc.aio.ServicerContext) -> SpanContext | None:
    """The sampled-out parent a data-plane stream declared when it opened, for its messages
    that carry no trace context (tracing.stream_parent). Read whether tracing is on or not:
    once per stream, and a test may set tracing up in a running broker."""
    return tracing.stream_parent(context.invocation_metadata())


class BrokerService(broker_pb2_grpc.BrokerServiceServicer):
    def __init__(self, replica_manager: ReplicaManager) -> None:
        self._rm = replica_manager

    async def Produce(
        self, request: Lifted[pb.ProduceRequest], context: grpc.aio.ServicerContext
    ) -> pb.ProduceResponse:
        return await self._rm.produce(request.message, _metadata(context), request.views)

    async def ProduceStream(
        self,
        request_iterator: AsyncIterator[Lifted[pb.ProduceRequest]],
        context: grpc.aio.ServicerContext,
    ) -> None:
        # The stream's requests append in arrival order, one request's appends after the
        # other's, as Kafka keeps a connection's; their waits for replication overlap.
        in_order = asyncio.Lock()
        declared = _declared(context)

        def produce(request: Lifted[pb.ProduceRequest]) -> Awaitable[pb.ProduceResponse]:
            return self._rm.produce(request.message, None, request.views, in_order, declared)

        def failed(request: Lifted[pb.ProduceRequest], error: Exception) -> pb.ProduceResponse:
            return produce_failed(request.message, error)

        await pipelined(request_iterator, produce, context.write, failed)

    async def Fetch(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> FetchAnswer:
        return await self._rm.fetch(request, _metadata(context))

    async def FetchStream(
        self, request_iterator: AsyncIterator[pb.FetchRequest], context: grpc.aio.ServicerContext
    ) -> None:
        declared = _declared(context)

        def fetch(request: pb.FetchRequest) -> Awaitable[FetchAnswer]:
            return self._rm.fetch(request, None, declared)

        await pipelined(request_iterator, fetch, context.write, fetch_failed)

    async def ListOffsets(
        self, request: pb.ListOffsetsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListOffsetsResponse:
        return self._rm.list_offsets(request)

    async def OffsetForLeaderEpoch(
        self, request: pb.OffsetForLeaderEpochRequest, context: grpc.aio.ServicerContext
    ) -> pb.OffsetForLeaderEpochResponse:
        return self._rm.offset_for_leader_epoch(request)

    async def InitProducerId(
        self, request: pb.InitProducerIdRequest, context: grpc.aio.ServicerContext
    ) -> pb.InitProducerIdResponse:
        return await self._rm.producer_ids.init_producer_id(request)


# Produce requests as gRPC hands them to BrokerService: batches lifted out of large ones.
PRODUCE_LIFTER = Lifter(pb.ProduceRequest, "partitions", "record_batch")


def add_broker_service(servicer: BrokerService, server: grpc.aio.Server) -> None:
    """Registers BrokerService as the generated code would, except that Fetch and FetchStream
    answer FetchAnswers, which gRPC sends with their records spliced in (fetch_answer), and
    Produce and ProduceStream take requests with their batches lifted out (rpc.lifted)."""

    def adjust(handlers: Handlers) -> None:
        # Generated handlers are namedtuples.
        for method in ("Fetch", "FetchStream"):
            handlers[method] = handlers[method]._replace(  # type: ignore[attr-defined]
                response_serializer=FetchAnswer.serialize
            )
        for method in ("Produce", "ProduceStream"):
            handlers[method] = handlers[method]._replace(  # type: ignore[attr-defined]
                request_deserializer=PRODUCE_LIFTER.parse
            )

    add_service(broker_pb2_grpc.add_BrokerServiceServicer_to_server, servicer, server, adjust)


class BrokerControl(broker_pb2_grpc.BrokerControlServicer):
    def __init__(self, replica_manager: ReplicaManager) -> None:
        self._rm = replica_manager

    async def LeaderAndIsr(
        self, request: pb.LeaderAndIsrRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaderAndIsrResponse:
        return await self._rm.become_leader_or_follower(request)

    async def UpdateMetadata(
        self, request: cluster_pb2.UpdateMetadataRequest, context: grpc.aio.ServicerContext
    ) -> cluster_pb2.UpdateMetadataResponse:
        return await self._rm.update_metadata(request)

    async def StopReplica(
        self, request: pb.StopReplicaRequest, context: grpc.aio.ServicerContext
    ) -> pb.StopReplicaResponse:
        return await self._rm.stop_replica(request)
