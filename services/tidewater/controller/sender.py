"""Requests from the controller to brokers: LeaderAndIsr, UpdateMetadata, StopReplica.

One queue and one worker per broker keep each broker's requests in the order the controller
decided them; a failed send is retried a few times, and a broker that comes back after being
unreachable gets its full state on its first heartbeat anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import Message

from tidewater.controller.model import TopicPartition
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2, broker_pb2_grpc, cluster_pb2, common_pb2
from tidewater.v1.errors_pb2 import ErrorCode

if TYPE_CHECKING:
    from tidewater.controller.controller import Controller
    from tidewater.controller.core import PartitionChange

log = logging.getLogger(__name__)
ATTEMPTS = 5
RPC_TIMEOUT_S = 10.0


class BrokerSender:
    def __init__(self, controller: Controller) -> None:
        self._controller = controller
        self._queues: dict[int, asyncio.Queue[Message]] = {}
        self._workers: dict[int, asyncio.Task[None]] = {}
        self.requests_sent = 0

    def reset(self) -> None:
        for task in self._workers.values():
            task.cancel()
        self._workers.clear()
        self._queues.clear()

    # -- what to send --------------------------------------------------------------------------

    def leader_and_isr_changes(self, changes: Iterable[PartitionChange]) -> None:
        """Tell every live replica of each changed partition, then every broker's cache."""
        tps = [c.tp for c in changes]
        model = self._controller.model
        targets = {b for tp in tps for b in model.replicas(tp)} & set(model.brokers)
        self.leader_and_isr(targets, tps, new={c.tp for c in changes if c.before is None})
        self.update_metadata(tps)

    def leader_and_isr(
        self,
        broker_ids: Iterable[int],
        tps: Iterable[TopicPartition],
        new: set[TopicPartition] | None = None,
    ) -> None:
        model = self._controller.model
        tps = list(tps)
        for broker_id in broker_ids:
            broker = model.brokers.get(broker_id)
            mine = [tp for tp in tps if broker_id in model.replicas(tp)]
            if broker is None or broker.fenced or not mine:
                continue
            request = broker_pb2.LeaderAndIsrRequest(
                controller_id=self._controller.config.controller_id,
                controller_epoch=self._controller.epoch,
                broker_epoch=broker.epoch,
            )
            leaders: set[int] = set()
            topics: set[str] = set()
            for tp in mine:
                record = model.partitions[tp]
                request.partition_states.add(
                    topic=tp[0],
                    partition=tp[1],
                    controller_epoch=record.controller_epoch,
                    leader=record.leader,
                    leader_epoch=record.leader_epoch,
                    isr=list(record.isr),
                    partition_epoch=record.partition_epoch,
                    replicas=list(model.replicas(tp)),
                    is_new=bool(new and tp in new),
                )
                leaders.add(record.leader)
                topics.add(tp[0])
            request.live_leaders.extend(self._broker_infos(leaders))
            request.topic_configs.extend(
                common_pb2.TopicConfig(topic=t, configs=model.topics[t].configs) for t in topics
            )
            self._enqueue(broker_id, request)

    def update_metadata(self, tps: Iterable[TopicPartition], deleted: Iterable[str] = ()) -> None:
        """A delta to every usable broker."""
        request = self._update_metadata_request(list(tps), cluster_pb2.UPDATE_METADATA_TYPE_DELTA)
        request.deleted_topics.extend(deleted)
        for broker_id in self._controller.model.usable_brokers():
            self._enqueue(broker_id, self._for_broker(request, broker_id))

    def update_metadata_full(self, broker_id: int) -> None:
        model = self._controller.model
        request = self._update_metadata_request(
            list(model.partitions), cluster_pb2.UPDATE_METADATA_TYPE_FULL
        )
        self._enqueue(broker_id, self._for_broker(request, broker_id))

    def stop_replica(self, broker_id: int, tps: Iterable[TopicPartition], delete: bool) -> None:
        broker = self._controller.model.brokers.get(broker_id)
        if broker is None:
            return
        request = broker_pb2.StopReplicaRequest(
            controller_id=self._controller.config.controller_id,
            controller_epoch=self._controller.epoch,
            broker_epoch=broker.epoch,
        )
        for topic, partition in tps:
            request.partitions.add(
                topic=topic, partition=partition, leader_epoch=-2, delete_partition=delete
            )
        self._enqueue(broker_id, request)

    def _update_metadata_request(
        self, tps: list[TopicPartition], kind: int
    ) -> cluster_pb2.UpdateMetadataRequest:
        model = self._controller.model
        usable = model.usable_brokers()
        request = cluster_pb2.UpdateMetadataRequest(
            controller_id=self._controller.config.controller_id,
            controller_epoch=self._controller.epoch,
            type=kind,
        )
        request.controller_endpoint.host = self._controller.config.host
        request.controller_endpoint.port = self._controller.config.port
        request.live_brokers.extend(self._broker_infos(usable))
        for tp in tps:
            record = model.partitions[tp]
            replicas = model.replicas(tp)
            request.partition_states.add(
                topic=tp[0],
                partition=tp[1],
                controller_epoch=record.controller_epoch,
                leader=record.leader,
                leader_epoch=record.leader_epoch,
                isr=list(record.isr),
                partition_epoch=record.partition_epoch,
                replicas=list(replicas),
                offline_replicas=[b for b in replicas if b not in usable],
            )
        return request

    def _for_broker(
        self, request: cluster_pb2.UpdateMetadataRequest, broker_id: int
    ) -> cluster_pb2.UpdateMetadataRequest:
        copy = cluster_pb2.UpdateMetadataRequest()
        copy.CopyFrom(request)
        copy.broker_epoch = self._controller.model.brokers[broker_id].epoch
        return copy

    def _broker_infos(self, broker_ids: Iterable[int]) -> list[common_pb2.BrokerInfo]:
        model = self._controller.model
        infos = []
        for broker_id in sorted(broker_ids):
            broker = model.brokers.get(broker_id)
            if broker is not None:
                infos.append(
                    common_pb2.BrokerInfo(
                        broker_id=broker_id,
                        endpoint=common_pb2.Endpoint(host=broker.host, port=broker.port),
                        rack=broker.rack,
                    )
                )
        return infos

    # -- how it is sent ------------------------------------------------------------------------

    def _enqueue(self, broker_id: int, request: Message) -> None:
        queue = self._queues.get(broker_id)
        if queue is None:
            queue = self._queues[broker_id] = asyncio.Queue()
            self._workers[broker_id] = asyncio.create_task(self._work(broker_id, queue))
        queue.put_nowait(request)

    async def _work(self, broker_id: int, queue: asyncio.Queue[Message]) -> None:
        channel: grpc.aio.Channel | None = None
        address = ""
        try:
            while True:
                request = await queue.get()
                broker = self._controller.model.brokers.get(broker_id)
                if broker is None:
                    continue
                if broker.address != address:
                    if channel is not None:
                        await channel.close()
                    address = broker.address
                    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
                assert channel is not None
                await self._send(broker_id, broker_pb2_grpc.BrokerControlStub(channel), request)
        finally:
            if channel is not None:
                with contextlib.suppress(Exception):
                    await channel.close()

    async def _send(
        self, broker_id: int, stub: broker_pb2_grpc.BrokerControlStub, request: Message
    ) -> None:
        method = {
            broker_pb2.LeaderAndIsrRequest: stub.LeaderAndIsr,
            broker_pb2.StopReplicaRequest: stub.StopReplica,
            cluster_pb2.UpdateMetadataRequest: stub.UpdateMetadata,
        }[type(request)]
        for attempt in range(ATTEMPTS):
            try:
                self.requests_sent += 1
                response = await method(request, timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.info(
                    "%s to broker %d failed (%s), attempt %d",
                    type(request).__name__,
                    broker_id,
                    e.code().name,
                    attempt + 1,
                )
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            if response.error_code != ErrorCode.NONE:
                log.warning(
                    "broker %d refused %s: %s",
                    broker_id,
                    type(request).__name__,
                    response.error_message,
                )
            elif isinstance(request, broker_pb2.LeaderAndIsrRequest):
                log.info(
                    "LeaderAndIsr for %d partitions accepted by broker %d",
                    len(request.partition_states),
                    broker_id,
                )
            return
