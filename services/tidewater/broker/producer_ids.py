"""Producer ids for idempotent producers (Kafka's ProducerIdManager and the non-transactional
InitProducerId).

The broker hands out ids from a block the controller reserved for it (AllocateProducerIds,
1000 ids); blocks never overlap, so no two brokers give out the same id. Every call gets a new
id at epoch 0, whatever id and epoch it names, as Kafka's InitProducerId without a
transactional id: a producer bumps its epoch itself (KIP-360), and a request could otherwise
take over another producer's id at the next epoch, fencing it (review 32 #3: proto3's empty
request named producer 0, epoch 0).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tidewater.broker.controller_client import ControllerClient
from tidewater.errors import ControllerUnavailable, ProducerIdAllocationFailed, TidewaterError
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode


class ProducerIdManager:
    def __init__(
        self, controller: ControllerClient, broker_id: int, broker_epoch: Callable[[], int]
    ) -> None:
        self._controller = controller
        self._broker_id = broker_id
        self._broker_epoch = broker_epoch
        self._next_id = 0
        self._block_end = 0
        # One AllocateProducerIds at a time: concurrent callers share the block it brings.
        self._lock = asyncio.Lock()

    async def init_producer_id(
        self, request: pb.InitProducerIdRequest
    ) -> pb.InitProducerIdResponse:
        try:
            producer_id = await self.next_producer_id()
        except TidewaterError as e:
            return pb.InitProducerIdResponse(
                error_code=e.code, error_message=e.message, producer_id=-1, producer_epoch=-1
            )
        return pb.InitProducerIdResponse(producer_id=producer_id, producer_epoch=0)

    async def next_producer_id(self) -> int:
        """The next id of this broker's block, reserving a new block when it is used up."""
        async with self._lock:
            if self._next_id >= self._block_end:
                await self._allocate_block()
            producer_id = self._next_id
            self._next_id += 1
            return producer_id

    async def _allocate_block(self) -> None:
        try:
            response = await self._controller.call(
                "AllocateProducerIds",
                cpb.AllocateProducerIdsRequest(
                    broker_id=self._broker_id, broker_epoch=self._broker_epoch()
                ),
            )
        except ControllerUnavailable as e:
            raise ProducerIdAllocationFailed(f"no producer id block: {e}") from None
        if response.error_code != ErrorCode.NONE:
            raise ProducerIdAllocationFailed(
                f"the controller reserved no producer id block: "
                f"{ErrorCode.Name(response.error_code)} {response.error_message}"
            )
        self._next_id = response.first_producer_id
        self._block_end = response.first_producer_id + response.producer_id_count
