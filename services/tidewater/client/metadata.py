"""The client's cache of the cluster view: live brokers and each partition's leader, from
any live metadata service, refreshed on demand with backoff, and in the background once the
view is older than its max age (Kafka's metadata.max.age.ms): a view no error corrects, a
topic grown or created again under its name, is not kept for good.

A partition's leader epoch only moves forward in the cache (a lagging metadata service may
answer with an older one), within one life of its topic: a topic deleted and created again
under the same name has a new topic id and starts again at leader epoch 0, so what is cached
of a topic is dropped when its id changes, as in Kafka (KIP-516). An answer that the topic does
not exist takes its leaders, not its epochs or id: it may come from a metadata service that has
not applied the topic yet."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import grpc

from tidewater.client.errors import MetadataUnavailable
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.telemetry import tracing
from tidewater.v1 import metadata_pb2, metadata_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

TopicPartition = tuple[str, int]


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    leader: int
    leader_epoch: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    error_code: int
    # The state's version in the controller's store: it only grows, across lives of a topic.
    partition_epoch: int = 0


@dataclass(frozen=True, slots=True)
class TopicInfo:
    error_code: int
    error_message: str
    num_partitions: int
    # 16 bytes; the last one known when the topic does not exist; empty when never known (or
    # from a version without topic ids).
    topic_id: bytes = b""


class ClusterMetadata:
    """GetMetadata over a list of metadata addresses: the last one that answered is asked
    first, the others in turn when it does not; every call has a deadline."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        request_timeout_s: float = 10.0,
        retry_backoff_s: float = 0.1,
        max_age_s: float | None = None,
    ) -> None:
        """`max_age_s`: refresh in the background once the last view is that old (None:
        only on demand)."""
        if not addresses:
            raise ValueError("at least one metadata address is needed")
        self.addresses = list(addresses)
        self.request_timeout_s = request_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.brokers: dict[int, str] = {}
        self.partitions: dict[TopicPartition, PartitionInfo] = {}
        self.topics: dict[str, TopicInfo] = {}
        # Ids of topics deleted and created again under their name: never used again, so an
        # answer naming one comes from a metadata service that lags. Of two ids, the older is
        # the one whose partition epochs are smaller (review 29 #1: the one seen second was
        # taken for the newer, so a lagging answer seen after the new topic's put the client
        # back on the deleted topic for good).
        self._retired_ids: set[bytes] = set()
        # The active controller's address as the metadata service last heard of it.
        self.controller: str | None = None
        self._wanted: set[str] = set()
        # The topics the latest refresh asked for.
        self._asked: frozenset[str] = frozenset()
        self._current = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._refreshing: asyncio.Task[None] | None = None
        self._last_refresh = 0.0
        self.max_age_s = max_age_s
        self._last_view = 0.0  # when a metadata service last answered
        self._aging: asyncio.Task[None] | None = None

    def add_topics(self, topics: Iterable[str]) -> None:
        """Keep `topics` in every refresh from now on."""
        self._wanted.update(topics)

    def forget_topic(self, topic: str) -> None:
        """Ask for `topic` no more (a name it refused: INVALID_TOPIC)."""
        self._wanted.discard(topic)
        self.topics.pop(topic, None)

    async def refresh(self, topics: Iterable[str] = ()) -> None:
        """Fetch the view of `topics` (plus every topic asked for before) now; concurrent
        callers share one request. MetadataUnavailable when no address answers."""
        topics = list(topics)
        self._wanted.update(topics)
        self._keep_fresh()
        while True:
            refreshing = self.refreshing
            if refreshing is None:
                self._refreshing = asyncio.ensure_future(self._fetch_wanted())
                await asyncio.shield(self._refreshing)
                if any(map(self._lacks_leaders, topics)):
                    # The service may lag (not heard from the controller of late): the next
                    # refresh asks another (review 29 #4: the same one was asked for good).
                    self._next_address()
                return
            # Review 29 #5: a fetch under way asked before these topics were wanted need not
            # answer for them: another follows it.
            covered = not self._asked or self._asked >= self._wanted  # none: every topic
            await asyncio.shield(refreshing)
            if covered:
                return

    def request_refresh(self) -> None:
        """A response said the view is stale: refresh in the background, at most once per
        retry backoff."""
        self._keep_fresh()
        if self.refreshing is not None:
            return
        delay = max(0.0, self._last_refresh + self.retry_backoff_s - time.monotonic())
        self._refreshing = asyncio.ensure_future(self._delayed_fetch(delay))

    @property
    def refreshing(self) -> asyncio.Future[object] | None:
        """The refresh under way, if any."""
        refreshing = self._refreshing
        return refreshing if refreshing is not None and not refreshing.done() else None

    async def refreshed(self, timeout_s: float) -> None:
        """Wait until the refresh under way ends, for at most `timeout_s` (all of it when
        none is under way); its failure is not raised."""
        refreshing = self._refreshing
        if refreshing is None or refreshing.done():
            await asyncio.sleep(timeout_s)
        else:
            await asyncio.wait([refreshing], timeout=timeout_s)

    async def _delayed_fetch(self, delay: float) -> None:
        await asyncio.sleep(delay)
        # On failure the next stale answer asks again.
        with contextlib.suppress(MetadataUnavailable):
            before = dict(self.partitions)
            await self._fetch_wanted()
            if self.partitions == before:
                # A broker said the view is stale and this service's answer changed nothing:
                # it may have stopped hearing from the controller; the next refresh asks
                # another (review 26 M3: a stale one was asked first for good).
                self._next_address()

    def _next_address(self) -> None:
        """Ask the next metadata address first from now on."""
        self._current = (self._current + 1) % len(self.addresses)

    def _keep_fresh(self) -> None:
        """Start the background refresh by age, with the first use of the cache."""
        if self.max_age_s is not None and self._aging is None:
            self._aging = asyncio.ensure_future(self._refresh_by_age(self.max_age_s))

    async def _refresh_by_age(self, max_age_s: float) -> None:
        """Refresh whenever the view is max_age_s old (retried after the backoff while no
        metadata service answers), as Kafka's clients do without any error to say so."""
        while True:
            due = max(self._last_view + max_age_s, self._last_refresh + self.retry_backoff_s)
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())
                continue
            with contextlib.suppress(MetadataUnavailable):  # asked again after the backoff
                await self.refresh()

    def _lacks_leaders(self, topic: str) -> bool:
        """Whether the view knows no such topic, or a partition of it without a leader."""
        info = self.topics.get(topic)
        if info is None or info.error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION:
            return True
        return any(p.leader < 0 for tp, p in self.partitions.items() if tp[0] == topic)

    async def _fetch_wanted(self) -> None:
        self._asked = frozenset(self._wanted)
        await self._fetch(sorted(self._asked))

    async def describe(self, topics: list[str]) -> metadata_pb2.GetMetadataResponse:
        """The metadata service's answer for `topics` (all when empty), as it is."""
        return await self._fetch(topics)

    async def find_controller(self) -> str | None:
        """Where the metadata service last heard of the active controller, asking for no
        topic (review 33 #1: an admin client asked for every topic each time)."""
        await self._fetch([], no_topics=True)
        return self.controller

    async def _fetch(
        self, topics: list[str], no_topics: bool = False
    ) -> metadata_pb2.GetMetadataResponse:
        errors: list[tuple[str, grpc.StatusCode, str]] = []
        for _ in range(len(self.addresses)):
            address = self.addresses[self._current]
            stub = metadata_pb2_grpc.MetadataServiceStub(self._channel(address))
            try:
                response = await stub.GetMetadata(
                    metadata_pb2.GetMetadataRequest(topics=topics, no_topics=no_topics),
                    timeout=self.request_timeout_s,
                )
            except grpc.aio.AioRpcError as e:
                errors.append((address, e.code(), e.details() or ""))
                self._next_address()
                continue
            self._last_refresh = self._last_view = time.monotonic()
            self._apply(response)
            return response
        self._last_refresh = time.monotonic()
        # "within Ns" only when the deadline is what ran out: a refused connection fails at
        # once, and saying it took the deadline would mislead.
        timed_out = all(code == grpc.StatusCode.DEADLINE_EXCEEDED for _, code, _ in errors)
        within = f" within {self.request_timeout_s:g}s" if timed_out else ""
        raise MetadataUnavailable(
            f"no metadata service answered{within}: "
            # With the service's reason: one without a view yet says so (review 27 L4).
            + ", ".join(_failure(address, code, details) for address, code, details in errors)
        )

    def _apply(self, response: metadata_pb2.GetMetadataResponse) -> None:
        endpoint = response.controller.endpoint
        if response.controller.controller_id >= 0 and endpoint.host:
            self.controller = f"{endpoint.host}:{endpoint.port}"
        self.brokers = {
            b.broker_id: f"{b.endpoint.host}:{b.endpoint.port}" for b in response.brokers
        }
        for topic in response.topics:
            if topic.topic_id in self._retired_ids:
                continue
            known_topic = self.topics.get(topic.topic)
            known_id = known_topic.topic_id if known_topic is not None else b""
            if known_id and topic.topic_id and known_id != topic.topic_id:
                if self._older_life(topic):
                    self._retired_ids.add(topic.topic_id)
                    continue
                self._retired_ids.add(known_id)
                self._forget_partitions(topic.topic)
            elif topic.error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION:
                # Deleted, or not applied yet by a lagging metadata service: no leader, but
                # the epochs stay, so an older view from another lagging one is still refused.
                self._forget_leaders(topic.topic)
            self.topics[topic.topic] = TopicInfo(
                topic.error_code,
                topic.error_message,
                len(topic.partitions),
                topic.topic_id or known_id,  # an "unknown" answer carries no id
            )
            for p in topic.partitions:
                tp = (topic.topic, p.partition)
                known = self.partitions.get(tp)
                # A lagging metadata service may still serve an older leader.
                if known is not None and p.leader_epoch < known.leader_epoch:
                    continue
                self.partitions[tp] = PartitionInfo(
                    p.leader,
                    p.leader_epoch,
                    tuple(p.replicas),
                    tuple(p.isr),
                    p.error_code,
                    p.partition_epoch,
                )

    def _older_life(self, topic: metadata_pb2.TopicMetadata) -> bool:
        """Whether `topic`, under another id than the cached one, is of an earlier life of
        the topic: its partitions' states are older than those cached (unknown from a
        version without partition epochs: taken as the newer, as before)."""
        answered = max((p.partition_epoch for p in topic.partitions), default=0)
        cached = max(
            (info.partition_epoch for tp, info in self.partitions.items() if tp[0] == topic.topic),
            default=0,
        )
        return 0 < answered < cached

    def _forget_partitions(self, topic: str) -> None:
        """The topic is gone, or is another topic now: its leader epochs no longer apply."""
        for tp in [tp for tp in self.partitions if tp[0] == topic]:
            del self.partitions[tp]

    def _forget_leaders(self, topic: str) -> None:
        for tp, info in self.partitions.items():
            if tp[0] == topic:
                self.partitions[tp] = replace(info, leader=-1)

    def update_leader(self, tp: TopicPartition, leader: int, leader_epoch: int) -> None:
        """A broker named a newer leader (current_leader in its answer): use it at once."""
        known = self.partitions.get(tp)
        if known is not None and leader >= 0 and leader_epoch > known.leader_epoch:
            self.partitions[tp] = replace(
                known, leader=leader, leader_epoch=leader_epoch, error_code=ErrorCode.NONE
            )

    def topic_id(self, topic: str) -> bytes:
        """The topic's id as last known, for requests to name (empty: not known)."""
        info = self.topics.get(topic)
        return info.topic_id if info is not None else b""

    def leader(self, tp: TopicPartition) -> tuple[int, str, int] | None:
        """(broker id, address, leader epoch) of the partition's leader, None when unknown."""
        info = self.partitions.get(tp)
        if info is None or info.leader < 0:
            return None
        address = self.brokers.get(info.leader)
        if address is None:
            return None
        return info.leader, address, info.leader_epoch

    def channel_for(self, address: str) -> grpc.aio.Channel:
        """One channel per broker address, shared by the producer or consumer using it."""
        return self._channel(address)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = tracing.insecure_channel(address, CHANNEL_OPTIONS)
        return channel

    async def close(self) -> None:
        tasks = [task for task in (self._refreshing, self._aging) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def _failure(address: str, code: grpc.StatusCode, details: str) -> str:
    """How one metadata address failed; gRPC's own texts for a refused connection or a
    deadline say nothing the code does not."""
    said = details if details and code != grpc.StatusCode.DEADLINE_EXCEEDED else ""
    if said.startswith(("failed to connect", "Deadline Exceeded")):
        said = ""
    return f"{address}: {code.name}" + (f" ({said})" if said else "")
