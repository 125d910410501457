"""The active controller: one ordered event queue over the cluster model, etcd-fenced commits,
and the requests that bring brokers to the committed state.

Every request handler and timer becomes an event on one queue, processed one at a time, so the
model never sees two decisions interleave. Decisions come from core.py (pure); this module
commits them (store.py, fenced by controller epoch and partition epoch) and sends LeaderAndIsr,
UpdateMetadata and StopReplica (sender.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from opentelemetry import context as otel_context

from tidewater.controller.core import (
    PartitionChange,
    ReassignmentStep,
    changes_for_controlled_shutdown,
    changes_for_offline_partitions,
    changes_for_unrecorded_partitions,
    changes_for_unusable_broker,
    complete_reassignment,
    elr_changes_for_configs,
    preferred_leader_change,
    stale_elr_changes,
    start_reassignment,
)
from tidewater.controller.leader_election import imbalanced_brokers
from tidewater.controller.model import (
    BrokerState,
    ClusterModel,
    PartitionRecord,
    TopicDeletion,
    TopicPartition,
    TopicState,
)
from tidewater.controller.sender import BrokerSender
from tidewater.controller.store import ControllerStore
from tidewater.errors import NotController, StoreUnavailable, TidewaterError
from tidewater.telemetry import tracing
from tidewater.v1.errors_pb2 import ErrorCode

log = logging.getLogger(__name__)
T = TypeVar("T")
# The wait before campaigning again after a load from etcd failed.
LOAD_RETRY_S = 1.0


@dataclass(frozen=True)
class ControllerConfig:
    controller_id: int
    host: str
    port: int
    lease_ttl_s: int = 5
    broker_session_timeout_ms: int = 6000
    session_check_interval_ms: int = 100
    auto_leader_rebalance_enable: bool = True
    leader_imbalance_per_broker_percentage: float = 10
    leader_imbalance_check_interval_s: float = 300
    # Metadata services to keep up to date (MetadataControl), host:port each.
    metadata_addresses: tuple[str, ...] = ()
    metadata_refresh_interval_ms: int = 1000
    # min.insync.replicas for topics without their own (Kafka's controller config of that
    # name), for the ELR rules. It may differ from the brokers' default: their leaders also
    # hold the HW while the ELR committed with the ISR is not empty.
    min_insync_replicas: int = 1
    # default.replication.factor: a topic created without one gets this many replicas, or
    # CreateTopics INVALID_REPLICATION_FACTOR (None: 3, fewer where fewer brokers ever
    # registered, so that a one-broker cluster needs no setting).
    default_replication_factor: int | None = None


class NotActive(TidewaterError):
    code = ErrorCode.NOT_CONTROLLER


@dataclass(frozen=True)
class _Event:
    run: Callable[[], Awaitable[None]]
    done: asyncio.Future[Any]


def _settle(done: asyncio.Future[Any], error: Exception) -> None:
    if not done.done():  # a caller that gave up cancelled it
        done.set_exception(error)


class Controller:
    def __init__(
        self, config: ControllerConfig, store: ControllerStore, time_ms: Callable[[], int]
    ) -> None:
        self.config = config
        self.store = store
        self.time_ms = time_ms
        self.model = self._empty_model()
        self.epoch = -1
        self.active = False
        self.sender = BrokerSender(self)
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._grace_until_ms = 0
        # Set by an event that etcd failed (StoreUnavailable, NotController): what etcd holds
        # may differ from the model, so this controller resigns and whoever wins reloads.
        self._store_failed = asyncio.Event()

    def _empty_model(self) -> ClusterModel:
        return ClusterModel(min_insync_replicas=self.config.min_insync_replicas)

    @property
    def in_grace(self) -> bool:
        """In the grace period after its election: it has not heard from every broker, and
        one session timeout has not passed."""
        return bool(self._grace_until_ms)

    @property
    def endpoint(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    # -- the event queue ---------------------------------------------------------------------

    async def submit(self, event: Callable[[], Awaitable[T]]) -> T:
        """Run `event` on the controller's queue, after every event before it; NotActive if
        this controller is (or becomes) a standby first."""
        if not self.active:
            raise NotActive(f"controller {self.config.controller_id} is not active")
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        # The event's spans are children of the submitter's (an RPC's server span, say).
        trace_context = otel_context.get_current() if tracing.ENABLED else None

        async def run() -> None:
            token = otel_context.attach(trace_context) if trace_context is not None else None
            try:
                result = await event()
            except asyncio.CancelledError:  # stepping down in the middle of it
                _settle(done, NotActive("controller stepped down"))
                raise
            except Exception as e:  # handed to the caller, who answers with it
                if isinstance(e, StoreUnavailable | NotController):
                    log.warning("controller %d: etcd failed: %s", self.config.controller_id, e)
                    self._store_failed.set()
                _settle(done, e)
            else:
                if not done.done():
                    done.set_result(result)
            finally:
                if token is not None:
                    otel_context.detach(token)

        await self._queue.put(_Event(run, done))
        return await done

    async def run(self) -> None:
        """Campaign, lead until the lease is lost or etcd fails a write, step down, repeat."""
        while True:
            campaign_started_ns = time.time_ns()
            self.epoch = await self.store.campaign(
                self.config.controller_id, self.endpoint, self.config.lease_ttl_s
            )
            log.info("controller %d is active at epoch %d", self.config.controller_id, self.epoch)
            try:
                await self._lead(campaign_started_ns)
            finally:
                self._step_down()

    async def _lead(self, campaign_started_ns: int) -> None:
        self._store_failed.clear()
        try:
            await self._load()
            # Before any election: an ELR recorded under a higher min ISR than this
            # controller's (its --min-insync-replicas lowered across a restart) may name
            # replicas the leaders have left behind. Brokers, all fenced until they heartbeat,
            # learn the new state when unfenced.
            cleared = await self.commit_and_send(stale_elr_changes(self.model, self.epoch))
            for change in cleared:
                log.info("%s-%d: ELR cleared, its ISR meets min.insync.replicas", *change.tp)
        except (StoreUnavailable, NotController) as e:
            log.warning("controller %d could not load: %s", self.config.controller_id, e)
            self._step_down()
            await self.store.resign()
            # Not at once again: a load that fails every time would raise the controller
            # epoch several times a second.
            await asyncio.sleep(LOAD_RETRY_S)
            return
        self.active = True
        if tracing.ENABLED:
            # From the campaign to a loaded, active controller.
            tracing.record(
                "controller.election",
                campaign_started_ns,
                attributes={
                    "tidewater.controller.id": self.config.controller_id,
                    "tidewater.controller_epoch": self.epoch,
                    "tidewater.brokers": len(self.model.brokers),
                    "tidewater.partitions": len(self.model.partitions),
                },
            )
        config = self.config
        loops: list[tuple[float, Callable[[], Awaitable[None]], bool]] = [
            (config.session_check_interval_ms / 1000, self._expire_sessions, False)
        ]
        if config.metadata_addresses:
            # A FULL view at once, then a probe every interval so a restarted metadata service
            # gets its view without waiting for the next change.
            loops.append(
                (config.metadata_refresh_interval_ms / 1000, self._refresh_metadata_now, True)
            )
        if config.auto_leader_rebalance_enable:
            loops.append((config.leader_imbalance_check_interval_s, self.rebalance_leaders, False))
        tasks = [asyncio.create_task(self._process_events())]
        tasks += [asyncio.create_task(self._periodically(*loop)) for loop in loops]
        lost = asyncio.create_task(self.store.lost.wait())
        failed = asyncio.create_task(self._store_failed.wait())
        try:
            await asyncio.wait([lost, failed, *tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in [lost, failed, *tasks]:
                task.cancel()
            # Not each under suppress(CancelledError): that would also swallow this task's own
            # cancellation (the process stopping) arriving meanwhile, and it would lead on.
            await asyncio.gather(lost, failed, *tasks, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception():
                raise task.exception()  # type: ignore[misc]
        if self.store.lost.is_set():
            log.warning("controller %d lost its lease: stepping down", self.config.controller_id)
        else:
            log.warning("controller %d resigns after an etcd failure", self.config.controller_id)
            # A standby before the lease goes (review 34 #5: while etcd was slow to take the
            # revoke, it still answered as active, and its senders went on).
            self._step_down()
            await self.store.resign()

    def _step_down(self) -> None:
        """Standby: queued events fail with NOT_CONTROLLER, so their callers go elsewhere."""
        self.active = False
        self.model = self._empty_model()
        while not self._queue.empty():
            _settle(self._queue.get_nowait().done, NotActive("controller stepped down"))
        self.sender.reset()

    async def _process_events(self) -> None:
        while True:
            event = await self._queue.get()
            await event.run()

    async def _load(self) -> None:
        """A new controller's view: everything from etcd; every broker fenced until it
        heartbeats to us. Leaders are not moved during a grace period of one session timeout
        (or until every registered broker has heartbeated), so failover does not cause a
        storm of elections."""
        model = self._empty_model()
        now = self.time_ms()
        for broker_id, value in (await self.store.load_brokers()).items():
            model.brokers[broker_id] = BrokerState(
                broker_id=broker_id,
                host=value["host"],
                port=int(value["port"]),
                rack=value.get("rack", ""),
                incarnation_id=value.get("incarnation_id", ""),
                epoch=int(value["epoch"]),
                last_heartbeat_ms=now,
            )
        for name, value in (await self.store.load_topics()).items():
            topic = model.topics[name] = TopicState.from_json(name, value)
            if "topic_id" not in value:
                # Stored by a version without topic ids: the id from_json gave it is kept.
                await self.store.put_topic(self.epoch, name, topic.to_json())
                log.info("topic %s had no topic id: it is %s now", name, topic.topic_id)
        for tp, (value, revision) in (await self.store.load_partitions()).items():
            model.partitions[tp] = PartitionRecord.from_json(value, revision)
        for name, value in (await self.store.load_deletions()).items():
            model.deletions[name] = TopicDeletion.from_json(value)
        self.model = model
        self._grace_until_ms = now + self.config.broker_session_timeout_ms

    # -- broker liveness -----------------------------------------------------------------------

    async def _periodically(
        self, interval_s: float, event: Callable[[], Awaitable[None]], at_once: bool
    ) -> None:
        """Submit `event` every interval_s (the first at once or after one interval). A
        failed one does not end the loop: an etcd failure has the controller resign (see
        submit), anything else is logged and tried next time."""
        if not at_once:
            await asyncio.sleep(interval_s)
        while True:
            try:
                await self.submit(event)
            except TidewaterError as e:
                log.warning("%s failed: %s", event.__name__, e)
            await asyncio.sleep(interval_s)

    async def _expire_sessions(self) -> None:
        now = self.time_ms()
        in_grace = now < self._grace_until_ms and any(b.fenced for b in self.model.brokers.values())
        if in_grace:
            return
        if self._grace_until_ms:
            self._end_grace()
            # Brokers that never heartbeated to us are gone: take them out of the ISRs (and
            # leaderships) they still hold, as if we had seen their sessions expire.
            for broker in list(self.model.brokers.values()):
                if broker.fenced:
                    await self.commit_and_send(
                        changes_for_unusable_broker(self.model, broker.broker_id, self.epoch)
                    )
            await self.commit_and_send(changes_for_offline_partitions(self.model, self.epoch))
            await self._finish_what_was_cut_short()
        timeout = self.config.broker_session_timeout_ms
        for broker in list(self.model.brokers.values()):
            if not broker.fenced and now - broker.last_heartbeat_ms > timeout:
                await self.fence(broker, "missed its session timeout")

    def has_live_session(self, broker: BrokerState) -> bool:
        """Unfenced, and heard from within the session timeout (Kafka's hasValidSession)."""
        since = self.time_ms() - broker.last_heartbeat_ms
        return not broker.fenced and since <= self.config.broker_session_timeout_ms

    def _end_grace(self) -> None:
        """Leaders may move now: every broker has heartbeated, or one session timeout passed.
        The metadata services get this controller's view."""
        self._grace_until_ms = 0
        self.sender.refresh_metadata_services()
        heard_all = not any(b.fenced for b in self.model.brokers.values())
        why = "every broker has heartbeated" if heard_all else "one session timeout passed"
        log.info("controller %d: grace period over (%s)", self.config.controller_id, why)

    async def fence(
        self,
        broker: BrokerState,
        reason: str,
        unclean_restart: bool = False,
        expected: bool = False,
    ) -> None:
        """Move its leaderships and take it out of ISRs; `unclean_restart`: a new incarnation
        registered without proof of a clean shutdown (see changes_for_unusable_broker);
        `expected`: logged at INFO, a clean restart's (review 37 #5: a WARNING each broker of
        every rolling restart)."""
        log.log(
            logging.INFO if expected else logging.WARNING,
            "fencing broker %d: %s",
            broker.broker_id,
            reason,
        )
        with tracing.span(
            "broker.fence", {"tidewater.broker.id": broker.broker_id, "tidewater.reason": reason}
        ):
            changes = changes_for_unusable_broker(
                self.model,
                broker.broker_id,
                self.epoch,
                unclean_restart=unclean_restart,
                in_grace=self.in_grace,
            )
            broker.fenced = True
            self._announce_brokers(await self.commit_and_send(changes))

    async def begin_shutdown(self, broker: BrokerState) -> None:
        """Kafka's controlled shutdown: the broker leaves the ISRs and its leaderships move
        to other ISR members, while it serves until it stops (and shows live in metadata,
        marked in_controlled_shutdown: leaders let it into no ISR)."""
        broker.shutting_down = True
        self._announce_brokers(
            await self.commit_and_send(
                changes_for_controlled_shutdown(self.model, broker.broker_id, self.epoch)
            )
        )

    def _announce_brokers(self, committed: list[PartitionChange]) -> None:
        """A broker's liveness changed: every broker and metadata service learns it, where
        no change committed for it carried the new list (one where it led or followed
        nothing: it would have shown live, or usable, for good)."""
        if not committed:
            self.sender.update_metadata([])

    async def unfence(self, broker: BrokerState) -> None:
        log.info("broker %d is alive (epoch %d)", broker.broker_id, broker.epoch)
        broker.fenced = False
        grace_ends = self.in_grace and all(not b.fenced for b in self.model.brokers.values())
        if grace_ends:
            self._end_grace()
        # In the grace period too, an offline partition gets an ISR member we have heard from
        # as leader at once (but no unclean leader, and no leader we have not heard from moves).
        changes = changes_for_offline_partitions(self.model, self.epoch, in_grace=self.in_grace)
        committed = await self.commit_and_send(changes)
        # A (re)started broker learns every partition it hosts, not just the changed ones.
        changed = {c.tp for c in committed}
        rest = [tp for tp in self.model.partitions_on(broker.broker_id) if tp not in changed]
        self.sender.leader_and_isr({broker.broker_id}, rest)
        self.sender.update_metadata_full(broker.broker_id)
        # Every other broker learns it is usable again, so leaders let it back into ISRs.
        self.sender.update_metadata([])
        # Logs of topics deleted while it was away (or whose StopReplica it never answered).
        for name, deletion in sorted(self.model.deletions.items()):
            if broker.broker_id in deletion.pending:
                self._send_deletion(name, broker.broker_id)
        if grace_ends:
            await self._finish_what_was_cut_short()

    # -- topic deletion ------------------------------------------------------------------------

    async def delete_topic(self, name: str) -> None:
        """Kafka's topic deletion before topic ids: the topic is gone from etcd and metadata at
        once, but its name stays taken until every replica has confirmed deleting its logs
        (resent to a broker whenever it comes back)."""
        topic = self.model.topics[name]
        deletion = TopicDeletion(
            len(topic.assignment),
            frozenset(b for replicas in topic.assignment.values() for b in replicas),
        )
        await self.store.delete_topic(self.epoch, name, deletion.to_json())
        for tp in self.model.partitions_of(name):
            self.model.partitions.pop(tp, None)
        del self.model.topics[name]
        self.model.deletions[name] = deletion
        self.sender.update_metadata([], deleted=[name])
        for broker_id in sorted(deletion.pending):
            self._send_deletion(name, broker_id)
        log.info("deleted topic %s", name)

    # -- topic configs -------------------------------------------------------------------------

    async def alter_topic_configs(self, name: str, configs: dict[str, str]) -> None:
        """Store a topic's new overrides (already validated) and announce them: every usable
        broker gets them in an UpdateMetadata, and those hosting the topic apply them to their
        logs (a broker fenced meanwhile gets them in its FULL view when unfenced, a restarted
        one in LeaderAndIsr). Enabling unclean.leader.election.enable elects the topic's
        offline partitions at once, as Kafka's controller does."""
        before = self.model.topics[name]
        after = replace(before, configs=configs)
        # A lower min.insync.replicas lets leaders advance the HW past the ELR members: their
        # ELR goes in the same txn as the new value (the first, past etcd's ops per txn), so
        # no broker hears of it while they are still in it, and no failover keeps the old
        # value with an ELR cleared (one that keeps the new value with ELRs left is safe:
        # leaders hold the HW while the ELR is not empty, and the next controller clears them).
        changes = elr_changes_for_configs(self.model, after, self.epoch)
        await self.commit_and_send(changes, after)
        self.sender.update_metadata([], configs_of=[name])
        log.info("topic %s: configs are now %s", name, configs)
        if after.unclean_leader_election_enable and not before.unclean_leader_election_enable:
            changes = changes_for_offline_partitions(self.model, self.epoch, in_grace=self.in_grace)
            await self.commit_and_send([c for c in changes if c.tp[0] == name])

    def _send_deletion(self, name: str, broker_id: int) -> None:
        async def on_answer(ok: bool) -> None:
            if ok:
                # Not ours to answer for once stepped down: the next controller resends.
                with contextlib.suppress(TidewaterError):
                    await self.submit(lambda: self._deleted_on(name, broker_id))

        tps = [(name, p) for p in range(self.model.deletions[name].partitions)]
        self.sender.stop_replica(broker_id, tps, delete=True, on_answer=on_answer)

    async def _deleted_on(self, name: str, broker_id: int) -> None:
        deletion = self.model.deletions.get(name)
        if deletion is None or broker_id not in deletion.pending:
            return
        left = TopicDeletion(deletion.partitions, deletion.pending - {broker_id})
        await self.store.put_deletion(self.epoch, name, left.to_json() if left.pending else None)
        if left.pending:
            self.model.deletions[name] = left
        else:
            del self.model.deletions[name]
            log.info("topic %s: every replica deleted its logs; the name is free", name)

    async def _refresh_metadata_now(self) -> None:
        self.sender.refresh_metadata_services()

    # -- preferred leaders ---------------------------------------------------------------------

    async def rebalance_leaders(self) -> None:
        """auto.leader.rebalance.enable: move leadership back to preferred replicas on brokers
        whose share of lost preferred leaderships exceeds the imbalance percentage."""
        model = self.model
        to_move = imbalanced_brokers(
            {tp: model.replicas(tp) for tp in model.partitions},
            model.partitions,
            model.usable_brokers(),
            self.config.leader_imbalance_per_broker_percentage,
        )
        changes = []
        for tps in to_move.values():
            for tp in tps:
                with contextlib.suppress(TidewaterError):
                    changes.append(preferred_leader_change(model, tp, self.epoch))
        if changes:
            log.info("preferred leader rebalance: moving %d partitions", len(changes))
            await self.commit_and_send(changes)

    # -- reassignment --------------------------------------------------------------------------

    async def reassign(self, tp: TopicPartition, target: tuple[int, ...] | None) -> None:
        """Start moving a partition to `target` replicas (None: cancel, back to the original
        ones). Completes once the targets are in the ISR (maybe_complete_reassignment)."""
        topic = self.model.topics[tp[0]]
        ongoing = topic.reassignments.get(tp[1])
        if target is None:
            if ongoing is None:
                raise TidewaterError(
                    f"{tp[0]}-{tp[1]} has no reassignment in progress",
                    ErrorCode.NO_REASSIGNMENT_IN_PROGRESS,
                )
            target = ongoing.original
        original = ongoing.original if ongoing else topic.assignment[tp[1]]
        step = start_reassignment(self.model, tp, target, self.epoch, in_grace=self.in_grace)
        await self._take_step(step)
        log.info("%s-%d: reassigning %s -> %s", *tp, list(original), list(target))
        await self.maybe_complete_reassignment(tp)

    async def maybe_complete_reassignment(self, tp: TopicPartition) -> None:
        topic = self.model.topics.get(tp[0])
        if topic is None or tp[1] not in topic.reassignments:
            return
        step = complete_reassignment(self.model, tp, self.epoch, in_grace=self.in_grace)
        if step is not None:
            await self._take_step(step)
            log.info("%s-%d: reassignment to %s complete", *tp, list(step.replicas))

    async def _take_step(self, step: ReassignmentStep) -> None:
        """The partition's state and the topic's assignment in one txn (which commits both, or
        raises StoreUnavailable: see ControllerStore.write_partitions), then StopReplica to
        the replicas the step removes."""
        tp = step.change.tp
        topic = self.model.topics[tp[0]]
        reassignments = {p: r for p, r in topic.reassignments.items() if p != tp[1]}
        if step.in_flight is not None:
            reassignments[tp[1]] = step.in_flight
        after = replace(
            topic,
            assignment={**topic.assignment, tp[1]: step.replicas},
            reassignments=reassignments,
        )
        await self.commit_and_send([step.change], after)
        for broker_id in step.stopping:
            self.sender.stop_replica(broker_id, [tp], delete=True)

    async def _finish_what_was_cut_short(self) -> None:
        """Once a new controller's grace period is over (leaders may move): what a predecessor
        left behind. Partitions stored without a LeaderAndIsr start as new ones; every
        reassignment in flight whose targets are in the ISR completes (its predecessor may
        have failed over before the ISR change's)."""
        await self.commit_and_send(changes_for_unrecorded_partitions(self.model, self.epoch))
        for tp in self.model.reassigning():
            await self.maybe_complete_reassignment(tp)

    # -- commits -------------------------------------------------------------------------------

    async def commit_and_send(
        self, changes: list[PartitionChange], topic: TopicState | None = None
    ) -> list[PartitionChange]:
        """Commit partition changes to etcd (fenced) and tell the brokers concerned; returns the
        changes that committed. `topic`: a topic's new state, written with them (see
        ControllerStore.write_partitions) and the model's once written."""
        elections = [c for c in changes if c.before is None or c.before.leader != c.after.leader]
        attributes = {
            "tidewater.partitions": len(elections),
            "tidewater.unclean": sum(c.unclean for c in elections),
        }
        with tracing.span("leader.election", attributes) if elections else contextlib.nullcontext():
            committed = await self.commit(changes, topic)
            if committed:
                self.sender.leader_and_isr_changes(committed)
        return committed

    async def commit(
        self, changes: list[PartitionChange], topic: TopicState | None = None
    ) -> list[PartitionChange]:
        if not changes and topic is None:
            return []
        results = await self.store.write_partitions(
            self.epoch,
            [(c.tp[0], c.tp[1], c.expected_partition_epoch, c.after.to_json()) for c in changes],
            (topic.name, topic.to_json()) if topic is not None else None,
        )
        if topic is not None:
            # Not before: a view built while the write is under way shows what etcd holds.
            self.model.topics[topic.name] = topic
        committed, reloaded = [], []
        for change, result in zip(changes, results, strict=True):
            if not result.ok:
                log.warning("%s-%d: write lost a race; reloading its state", *change.tp)
                if result.current_value is not None:
                    current = PartitionRecord.from_json(
                        result.current_value, result.new_mod_revision
                    )
                    self.model.partitions[change.tp] = current
                    # Only this controller writes at its epoch: that state is an earlier write
                    # of ours that etcd applied though its answer was lost. Announce it.
                    reloaded.append(PartitionChange(change.tp, change.before, current))
                continue
            after = change.after.with_(partition_epoch=result.new_mod_revision)
            self.model.partitions[change.tp] = after
            committed.append(PartitionChange(change.tp, change.before, after, change.unclean))
            if change.unclean:
                log.warning(
                    "%s-%d: UNCLEAN leader election of broker %d: acknowledged data may be lost",
                    *change.tp,
                    after.leader,
                )
        if reloaded:
            self.sender.leader_and_isr_changes(reloaded)
        return committed
