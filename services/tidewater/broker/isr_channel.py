"""ISR change proposals from this broker's leaders to the controller, batched: every proposal
made while an AlterIsr is in flight goes out together in the next one (one RPC per batch)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tidewater.broker.controller_client import ControllerClient, ControllerUnavailable
from tidewater.errors import TidewaterError
from tidewater.replication.partition import AlterIsrProposal, LeaderAndIsr
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

log = logging.getLogger(__name__)

AlterIsrResultHandler = Callable[
    [AlterIsrProposal, LeaderAndIsr | None, TidewaterError | None], None
]


class AlterIsrChannel:
    def __init__(
        self,
        broker_id: int,
        controller: ControllerClient,
        on_result: AlterIsrResultHandler,
        broker_epoch: Callable[[], int],
    ) -> None:
        self._broker_id = broker_id
        self._controller = controller
        self._on_result = on_result
        self._broker_epoch = broker_epoch
        self._pending: dict[tuple[str, int], AlterIsrProposal] = {}
        self._wake = asyncio.Event()

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
        try:
            response = await self._controller.call("AlterIsr", request)
        except ControllerUnavailable as e:
            self._fail(batch, str(e))
            return
        if response.error_code != ErrorCode.NONE:
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

    def _fail(
        self, batch: list[AlterIsrProposal], reason: str, code: int = ErrorCode.UNKNOWN_SERVER_ERROR
    ) -> None:
        log.warning("ISR change proposals for %d partitions not committed: %s", len(batch), reason)
        error = TidewaterError(reason, code)
        for proposal in batch:
            self._on_result(proposal, None, error)
