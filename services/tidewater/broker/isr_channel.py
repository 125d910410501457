"""ISR change proposals from this broker's leaders to the controller, batched: every proposal
made while an AlterIsr is in flight goes out together in the next one (one RPC per batch)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc

from tidewater.errors import TidewaterError
from tidewater.replication.partition import AlterIsrProposal, LeaderAndIsr
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1 import controller_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

log = logging.getLogger(__name__)

AlterIsrResultHandler = Callable[
    [AlterIsrProposal, LeaderAndIsr | None, TidewaterError | None], None
]
RPC_TIMEOUT_S = 10.0


class AlterIsrChannel:
    def __init__(
        self,
        broker_id: int,
        controllers: Sequence[str],
        on_result: AlterIsrResultHandler,
        broker_epoch: Callable[[], int] = lambda: 0,
    ) -> None:
        self._broker_id = broker_id
        self._controllers = list(controllers)
        self._active = 0
        self._on_result = on_result
        self._broker_epoch = broker_epoch
        self._pending: dict[tuple[str, int], AlterIsrProposal] = {}
        self._wake = asyncio.Event()
        self.rpcs_sent = 0

    def propose(self, proposal: AlterIsrProposal) -> None:
        self._pending[(proposal.topic, proposal.partition)] = proposal
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = list(self._pending.values()), {}
            if batch:
                await self._send(batch)

    async def _send(self, batch: list[AlterIsrProposal]) -> None:
        if not self._controllers:
            self._fail(batch, "no controller configured (broker config `controllers`)")
            return
        request = cpb.AlterIsrRequest(
            broker_id=self._broker_id,
            broker_epoch=self._broker_epoch(),
            partitions=[
                cpb.AlterIsrPartition(
                    topic=p.topic,
                    partition=p.partition,
                    leader_epoch=p.leader_epoch,
                    new_isr=list(p.new_isr),
                    partition_epoch=p.partition_epoch,
                )
                for p in batch
            ],
        )
        address = self._controllers[self._active]
        try:
            async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
                stub = controller_pb2_grpc.ControllerServiceStub(channel)
                self.rpcs_sent += 1
                response = await stub.AlterIsr(request, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            self._active = (self._active + 1) % len(self._controllers)
            self._fail(batch, f"AlterIsr to {address} failed: {e.code().name} {e.details()}")
            return
        if response.error_code != ErrorCode.NONE:
            if response.error_code == ErrorCode.NOT_CONTROLLER:
                self._follow(response.controller)
            self._fail(batch, response.error_message, response.error_code)
            return
        by_partition = {(r.topic, r.partition): r for r in response.partitions}
        for proposal in batch:
            result = by_partition.get((proposal.topic, proposal.partition))
            if result is None:
                self._on_result(proposal, None, TidewaterError("no answer for the partition"))
            elif result.error_code != ErrorCode.NONE:
                error = TidewaterError(result.error_message, result.error_code)
                tp = (proposal.topic, proposal.partition)
                log.info("ISR change of %s-%d refused: %s", *tp, error)
                self._on_result(proposal, None, error)
            else:
                committed = LeaderAndIsr(
                    leader=result.leader,
                    leader_epoch=result.leader_epoch,
                    isr=tuple(result.isr),
                    replicas=(),
                    partition_epoch=result.partition_epoch,
                )
                self._on_result(proposal, committed, None)

    def _follow(self, controller: object) -> None:
        endpoint = getattr(controller, "endpoint", None)
        if endpoint is not None and endpoint.host:
            address = f"{endpoint.host}:{endpoint.port}"
            if address not in self._controllers:
                self._controllers.append(address)
            self._active = self._controllers.index(address)

    def _fail(
        self, batch: list[AlterIsrProposal], reason: str, code: int = ErrorCode.UNKNOWN_SERVER_ERROR
    ) -> None:
        log.warning("ISR change proposals for %d partitions not committed: %s", len(batch), reason)
        error = TidewaterError(reason, code)
        for proposal in batch:
            self._on_result(proposal, None, error)
