"""Admin client: topics, partitions, reassignments (made and listed) and leader elections
through the active controller (ControllerService, following NOT_CONTROLLER), and topic
descriptions from a metadata service. Given only metadata addresses, it asks them where the
active controller is, as a Kafka admin client needs only bootstrap servers.

As Kafka's AdminClient retries a retriable error until default.api.timeout.ms, a request the
controller cut short (REQUEST_TIMED_OUT or NOT_CONTROLLER at the top level, with per-item
results: etcd failed or it stepped down part-way, and it resigned) is sent again, after
retry_backoff, to whichever controller is active then, with only the items that were not
answered: those answered before the failure keep their answers, so an item committed is never
sent twice. An item whose write was ambiguous (perhaps applied) may be answered
TOPIC_ALREADY_EXISTS (or INVALID_PARTITIONS, UNKNOWN_TOPIC_OR_PARTITION) by the retry, as in
Kafka. While no controller answers as active (a failover under way, or the one known died),
every call is retried after retry_backoff, a bootstrapped client asking the metadata services
again where the active controller is. When no controller answers by the deadline,
ControllerUnavailable carries the answers already gathered (`answers`)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tidewater.broker.controller_client import ControllerClient
from tidewater.client.errors import MetadataUnavailable, error_for
from tidewater.client.metadata import ClusterMetadata
from tidewater.errors import ControllerUnavailable, InvalidPartitions, InvalidReplicationFactor
from tidewater.v1 import common_pb2, metadata_pb2
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

TopicPartition = tuple[str, int]
# A request (or item) cut short by the controller's resignation: sent again.
RETRY = (ErrorCode.REQUEST_TIMED_OUT, ErrorCode.NOT_CONTROLLER)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionReassignment:
    """A reassignment in progress (Kafka's PartitionReassignment): `replicas`, the partition's
    replicas now (the target's and the original's together); `adding_replicas`, the target's
    not in the original; `removing_replicas`, the original's not in the target, removed once
    every adding replica is in the ISR."""

    replicas: tuple[int, ...]
    adding_replicas: tuple[int, ...]
    removing_replicas: tuple[int, ...]


class Admin:
    def __init__(
        self,
        controllers: Sequence[str],
        bootstrap: Sequence[str] = (),
        request_timeout_s: float = 10.0,
        default_api_timeout_s: float = 60.0,
        retry_backoff_s: float = 0.1,
    ) -> None:
        """`default_api_timeout_s` (Kafka's default.api.timeout.ms) bounds every call in all
        (its attempts, at most `request_timeout_s` each, across the controllers it tries, and
        the waits between them); `retry_backoff_s` is the wait before each retry."""
        if not controllers and not bootstrap:
            raise ValueError("Admin needs controller or metadata service addresses")
        self._controller = ControllerClient(controllers)
        self._metadata = (
            ClusterMetadata(list(bootstrap), request_timeout_s=request_timeout_s)
            if bootstrap
            else None
        )
        self._timeout_s = request_timeout_s
        self._api_timeout_s = default_api_timeout_s
        self._retry_backoff_s = retry_backoff_s

    async def __aenter__(self) -> Admin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._controller.close()
        if self._metadata is not None:
            await self._metadata.close()

    async def _call(self, method: str, request: object) -> object:
        """A request answered whole: sent again while the controller cuts it short (RETRY),
        as the module's docstring says."""
        deadline = self._deadline()
        while True:
            response = await self._ask_controller(method, request, deadline)
            if response.error_code not in RETRY or time.monotonic() >= deadline:
                _raise_if(response.error_code, response.error_message)
                return response
            await self._backoff(deadline)

    async def _ask_controller(
        self,
        method: str,
        request: Any,
        deadline: float,
        partial: Callable[[Any], bool] = lambda response: False,
    ) -> Any:
        """The active controller's answer (ControllerClient.call), asked again after
        retry_backoff while none answers as active, until the deadline (Kafka's AdminClient
        retries until default.api.timeout.ms; review 29 #2: one round over the known
        addresses, in milliseconds, while a failover was under way). Given metadata
        services, it asks them again before each retry where the active controller is now:
        the one it found first may have died."""
        asked = False
        while True:
            if self._metadata is not None and (asked or not self._controller.configured):
                try:
                    await self._find_controller(deadline)
                except ControllerUnavailable:
                    if time.monotonic() + self._retry_backoff_s >= deadline:
                        raise
            if self._controller.configured:
                try:
                    return await self._controller.call(
                        method, request, self._timeout_s, deadline, partial
                    )
                except ControllerUnavailable:
                    if time.monotonic() + self._retry_backoff_s >= deadline:
                        raise
            await self._backoff(deadline)
            asked = True

    async def _call_each(self, method: str, request: Any, items: str, results: str) -> list[Any]:
        """An RPC the controller answers per item (`results` of the response, one for each of
        `items` of the request, in order), retried as the module's docstring says. The
        results, one per item."""
        deadline = self._deadline()
        every = list(getattr(request, items))
        answers: list[Any] = [None] * len(every)
        pending = list(range(len(every)))

        def partial(response: Any) -> bool:
            # A controller that stepped down part-way answers NOT_CONTROLLER with the items
            # it had committed: resending all of them would apply those twice.
            return len(getattr(response, results)) > 0

        while True:
            attempt = type(request)()
            attempt.CopyFrom(request)
            del getattr(attempt, items)[:]
            getattr(attempt, items).extend(every[i] for i in pending)
            try:
                response = await self._ask_controller(method, attempt, deadline, partial)
            except ControllerUnavailable as e:
                answered = len(every) - len(pending)
                if not answered:
                    raise
                raise ControllerUnavailable(
                    f"{e.message} ({answered} of {len(every)} items answered before: see answers)",
                    answers,
                ) from e
            for i, result in zip(pending, getattr(response, results), strict=False):
                answers[i] = result
            # The item etcd failed (or in flight when the controller stepped down) and those
            # never tried carry its code; the others are final.
            pending = [i for i in pending if answers[i] is None or answers[i].error_code in RETRY]
            retrying = response.error_code in RETRY
            if retrying and not pending:
                return answers
            if not retrying or time.monotonic() >= deadline:
                _raise_if(response.error_code, response.error_message)
                return answers
            log.info(
                "%s: %s; retrying %d of %d items at the active controller",
                method,
                response.error_message,
                len(pending),
                len(every),
            )
            await self._backoff(deadline)

    def _deadline(self) -> float:
        """When a call starting now must end (time.monotonic())."""
        return time.monotonic() + self._api_timeout_s

    async def _backoff(self, deadline: float) -> None:
        await asyncio.sleep(min(self._retry_backoff_s, max(deadline - time.monotonic(), 0)))

    async def create_topic(
        self,
        name: str,
        partitions: int = 1,
        replication_factor: int | None = None,
        configs: Mapping[str, str] | None = None,
        assignments: Sequence[Sequence[int]] = (),
        validate_only: bool = False,
    ) -> uuid.UUID | None:
        """Create a topic: `partitions` of `replication_factor` replicas (None: the
        controllers' --default-replication-factor, as Kafka's default.replication.factor),
        placed by the controller (rack aware), or explicit `assignments` (replicas of
        partition 0, 1, ...). Returns its topic id (None with `validate_only`)."""
        # On the wire 0 means "the controller's default": here it is a mistake.
        if not assignments and partitions < 1:
            raise InvalidPartitions(f"a topic needs at least 1 partition, got {partitions}")
        if not assignments and replication_factor is not None and replication_factor < 1:
            raise InvalidReplicationFactor(
                f"replication factor must be at least 1, got {replication_factor}"
            )
        topic = cpb.CreatableTopic(
            name=name,
            num_partitions=0 if assignments else partitions,
            replication_factor=0 if assignments else replication_factor or 0,
            configs=dict(configs or {}),
        )
        for partition, replicas in enumerate(assignments):
            topic.assignments.add(partition=partition, broker_ids=list(replicas))
        [result] = await self._call_each(
            "CreateTopics",
            cpb.CreateTopicsRequest(topics=[topic], validate_only=validate_only),
            "topics",
            "topics",
        )
        _raise_if(result.error_code, result.error_message)
        return uuid.UUID(bytes=result.topic_id) if result.topic_id else None

    async def delete_topics(self, names: Sequence[str]) -> None:
        request = cpb.DeleteTopicsRequest(topic_names=names)
        for result in await self._call_each("DeleteTopics", request, "topic_names", "topics"):
            _raise_if(result.error_code, result.error_message)

    async def create_partitions(self, name: str, count: int) -> None:
        """Grow a topic to `count` partitions."""
        [result] = await self._call_each(
            "CreatePartitions",
            cpb.CreatePartitionsRequest(topics=[cpb.CreatePartitionsTopic(name=name, count=count)]),
            "topics",
            "topics",
        )
        _raise_if(result.error_code, result.error_message)

    async def reassign(self, targets: Mapping[TopicPartition, Sequence[int] | None]) -> None:
        """Move partitions to new replicas; None cancels a reassignment in progress."""
        request = cpb.AlterPartitionReassignmentsRequest()
        for (topic, partition), replicas in targets.items():
            request.partitions.add(
                topic=topic,
                partition=partition,
                replicas=list(replicas or ()),
                cancel=replicas is None,
            )
        for result in await self._call_each(
            "AlterPartitionReassignments", request, "partitions", "partitions"
        ):
            _raise_if(result.error_code, result.error_message)

    async def list_partition_reassignments(
        self, partitions: Sequence[TopicPartition] = ()
    ) -> dict[TopicPartition, PartitionReassignment]:
        """The reassignments in progress, of `partitions` (every partition when none is
        named), as Kafka's AdminClient.listPartitionReassignments: a partition without one, or
        that does not exist, is left out."""
        response = await self._call(
            "ListPartitionReassignments",
            cpb.ListPartitionReassignmentsRequest(
                partitions=[common_pb2.TopicPartition(topic=t, partition=p) for t, p in partitions]
            ),
        )
        return {
            (r.topic, r.partition): PartitionReassignment(
                tuple(r.replicas), tuple(r.adding_replicas), tuple(r.removing_replicas)
            )
            for r in response.reassignments  # type: ignore[attr-defined]
        }

    async def elect_leaders(
        self, unclean: bool = False, partitions: Sequence[TopicPartition] = ()
    ) -> dict[TopicPartition, int]:
        """Preferred (or unclean) leader election; ErrorCode per partition (NONE when elected,
        ELECTION_NOT_NEEDED when already led by the preferred replica, ...)."""
        response = await self._call(
            "ElectLeaders",
            cpb.ElectLeadersRequest(
                election_type=cpb.ELECTION_TYPE_UNCLEAN if unclean else cpb.ELECTION_TYPE_PREFERRED,
                partitions=[common_pb2.TopicPartition(topic=t, partition=p) for t, p in partitions],
            ),
        )
        return {(r.topic, r.partition): r.error_code for r in response.partitions}  # type: ignore[attr-defined]

    async def describe_cluster(self) -> cpb.DescribeClusterResponse:
        return await self._call("DescribeCluster", cpb.DescribeClusterRequest())  # type: ignore[return-value]

    async def describe_configs(
        self, names: Sequence[str] = ()
    ) -> dict[str, list[cpb.DescribeConfigsEntry]]:
        """Each topic's configs (every topic when none is named), by topic name: every key
        with its value and source (CONFIG_SOURCE_DYNAMIC_TOPIC_CONFIG: set on the topic;
        CONFIG_SOURCE_DEFAULT_CONFIG: Kafka's default). UnknownTopicOrPartition for a topic
        that does not exist."""
        response = await self._call("DescribeConfigs", cpb.DescribeConfigsRequest(topics=names))
        described = {}
        for result in response.topics:  # type: ignore[attr-defined]
            _raise_if(result.error_code, result.error_message)
            described[result.topic] = list(result.entries)
        return described

    async def incremental_alter_configs(
        self,
        topic: str,
        set_configs: Mapping[str, str] | None = None,
        delete_configs: Sequence[str] = (),
        validate_only: bool = False,
    ) -> None:
        """Set and delete (back to the default) keys of a topic's configs, all or none;
        keys not named keep their values. InvalidConfig for an unknown key or a bad value."""
        changes = [
            cpb.AlterableConfig(name=k, operation=cpb.CONFIG_OPERATION_SET, value=v)
            for k, v in (set_configs or {}).items()
        ] + [
            cpb.AlterableConfig(name=k, operation=cpb.CONFIG_OPERATION_DELETE)
            for k in delete_configs
        ]
        [result] = await self._call_each(
            "IncrementalAlterConfigs",
            cpb.IncrementalAlterConfigsRequest(
                topics=[cpb.AlterConfigsTopic(topic=topic, configs=changes)],
                validate_only=validate_only,
            ),
            "topics",
            "topics",
        )
        _raise_if(result.error_code, result.error_message)

    async def describe_topics(self, names: Sequence[str] = ()) -> metadata_pb2.GetMetadataResponse:
        """Topic ids, and partitions with leader, epoch, replicas and ISR, from a metadata
        service."""
        if self._metadata is None:
            raise ValueError("describe_topics needs bootstrap (metadata service) addresses")
        return await self._metadata.describe(list(names))

    async def _find_controller(self, deadline: float) -> None:
        """Ask the metadata services, within the call's deadline. None answering is
        ControllerUnavailable, retried as the controller's own silence is (review 33 #1:
        MetadataUnavailable escaped the retries, and the answers gathered with it)."""
        assert self._metadata is not None
        try:
            controller = await asyncio.wait_for(
                self._metadata.find_controller(), deadline - time.monotonic()
            )
        except TimeoutError:
            raise ControllerUnavailable(
                f"no metadata service named the active controller within "
                f"{self._api_timeout_s:g}s (default_api_timeout_s)"
            ) from None
        except MetadataUnavailable as e:
            raise ControllerUnavailable(f"no metadata service named the controller: {e}") from None
        if controller is None:
            raise ControllerUnavailable(
                "the metadata service knows no active controller yet; try again in a moment"
            )
        self._controller.prefer(controller)


def _raise_if(code: int, message: str) -> None:
    if code != ErrorCode.NONE:
        raise error_for(code, message)
