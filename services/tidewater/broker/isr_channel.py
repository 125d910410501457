"""ISR change proposals from this broker's leaders to the controller, batched (Kafka's
isr-change-propagation): proposals made within one propagation window, or while an AlterIsr is
in flight, go out together in the next one — one RPC per batch.

The window (isr.change.propagation.window.ms, default 50 ms) is short because an acks=all write
may be waiting on the shrink that drops a dead follower; lag detection already takes
replica.lag.time.max.ms, so 50 ms adds little, while the proposals of hundreds of partitions
whose follower died together still travel in one RPC.

A proposal whose outcome is unknown (no answer, NOT_CONTROLLER after a failover, an error other
than a refusal) may have been committed; while its partition still awaits an answer to it, it
goes out again after a backoff, until the controller answers for certain (Kafka's
AlterPartitionManager)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tidewater.broker.controller_client import ControllerClient
from tidewater.errors import ControllerUnavailable, TidewaterError
from tidewater.replication.partition import AlterIsrProposal, LeaderAndIsr
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

log = logging.getLogger(__name__)

# Delivers the controller's answer (or the failure to get one) to the partition; returns whether
# the partition still awaits an answer to that proposal, so it must be sent again.
AlterIsrResultHandler = Callable[
    [AlterIsrProposal, LeaderAndIsr | None, TidewaterError | None], bool
]
# A proposal, and the controller's committed state or the error it got instead.
AlterIsrAnswer = tuple[AlterIsrProposal, LeaderAndIsr | None, TidewaterError | None]
# Kafka's retry.backoff.ms and retry.backoff.max.ms (KIP-580): doubling between the two.
RETRY_BACKOFF_S = 0.1
RETRY_BACKOFF_MAX_S = 1.0


class AlterIsrChannel:
    def __init__(
        self,
        broker_id: int,
        controller: ControllerClient,
        on_result: AlterIsrResultHandler,
        broker_epoch: Callable[[], int],
        window_ms: int,
    ) -> None:
        self._window_s = window_ms / 1000
        self._broker_id = broker_id
        self._controller = controller
        self._on_result = on_result
        self._broker_epoch = broker_epoch
        self._pending: dict[tuple[str, int], AlterIsrProposal] = {}
        self._wake = asyncio.Event()
        # Batching made visible (metrics): RPCs sent, and the ISR changes they carried.
        self.rpcs_sent = 0
        self.partitions_sent = 0

    def propose(self, proposal: AlterIsrProposal) -> None:
        self._pending[(proposal.topic, proposal.partition)] = proposal
        self._wake.set()

    async def run(self) -> None:
        backoff_s = RETRY_BACKOFF_S
        while True:
            await self._wake.wait()
            await asyncio.sleep(self._window_s)
            self._wake.clear()
            batch, self._pending = list(self._pending.values()), {}
            if not batch:
                continue
            answers = await self._send(batch)
            unanswered = [answer[0] for answer in answers if self._deliver(*answer)]
            if not unanswered:
                backoff_s = RETRY_BACKOFF_S
                continue
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, RETRY_BACKOFF_MAX_S)
            for proposal in unanswered:
                # A newer proposal of the partition (after a LeaderAndIsr) replaces this one.
                self._pending.setdefault((proposal.topic, proposal.partition), proposal)
            self._wake.set()

    def _deliver(
        self,
        proposal: AlterIsrProposal,
        committed: LeaderAndIsr | None,
        error: TidewaterError | None,
    ) -> bool:
        """The answer to the partition; whether to send the proposal again. A failure here is
        that partition's alone: logged, and the proposal goes out again."""
        try:
            return self._on_result(proposal, committed, error)
        except Exception:
            log.exception(
                "%s-%d: applying the AlterIsr answer failed; sending the proposal again",
                proposal.topic,
                proposal.partition,
            )
            return True

    async def _send(self, batch: list[AlterIsrProposal]) -> list[AlterIsrAnswer]:
        """One AlterIsr RPC; each proposal with its committed state or its error."""
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
                    new_isr_broker_epochs=list(p.new_isr_broker_epochs),
                )
                for p in batch
            ],
        )
        try:
            response = await self._controller.call("AlterIsr", request)
        except Exception as e:
            if not isinstance(e, ControllerUnavailable):
                log.exception("AlterIsr failed unexpectedly; its outcome is unknown")
            return self._fail(batch, str(e))
        self.rpcs_sent += 1
        self.partitions_sent += len(batch)
        if response.error_code != ErrorCode.NONE:
            return self._fail(batch, response.error_message, response.error_code)
        by_partition = {(r.topic, r.partition): r for r in response.partitions}
        results: list[AlterIsrAnswer] = []
        for proposal in batch:
            result = by_partition.get((proposal.topic, proposal.partition))
            if result is None:
                results.append((proposal, None, TidewaterError("no answer for the partition")))
                continue
            # The controller's state of the partition: what it committed, or what it refused
            # the proposal against (none when it has no such partition).
            state = LeaderAndIsr(
                leader=result.leader,
                leader_epoch=result.leader_epoch,
                isr=tuple(result.isr),
                replicas=(),
                partition_epoch=result.partition_epoch,
                elr=tuple(result.eligible_leader_replicas),
            )
            if result.error_code == ErrorCode.NONE:
                results.append((proposal, state, None))
                continue
            error = TidewaterError(result.error_message, result.error_code)
            log.info("ISR change of %s-%d refused: %s", proposal.topic, proposal.partition, error)
            results.append((proposal, state if result.partition_epoch else None, error))
        return results

    @staticmethod
    def _fail(
        batch: list[AlterIsrProposal], reason: str, code: int = ErrorCode.UNKNOWN_SERVER_ERROR
    ) -> list[AlterIsrAnswer]:
        log.warning(
            "ISR change proposals for %d partitions not committed (or the answer lost): %s",
            len(batch),
            reason,
        )
        error = TidewaterError(reason, code)
        return [(proposal, None, error) for proposal in batch]
