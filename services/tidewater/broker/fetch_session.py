"""Incremental fetch sessions (Kafka's KIP-227): both ends, as pure state with the time as an
argument.

A follower that replicates many idle partitions would otherwise name every one of them in
every fetch, and get every one of them back, twice a second. In a session the leader keeps
each partition's last fetch position; a fetch names only partitions whose position changed
(`FetchSessionHandler`, the fetcher's end) and the answer carries only partitions with news
(`FetchSessionCache` / `FetchContext`, the leader's end). The leader still processes every
session partition on every fetch, as if it had been named again: a follower's progress, ISR
and HW rules see exactly what a full fetch would show them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from tidewater.errors import NO_ERROR, FetchSessionIdNotFound, InvalidFetchSessionEpoch
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

TopicPartition = tuple[str, int]

INITIAL_EPOCH = 0
FINAL_EPOCH = -1
NO_SESSION = 0
_MAX_EPOCH = 2**31 - 1


def next_epoch(epoch: int) -> int:
    """Epochs count 1, 2, ... and wrap to 1 (Kafka's FetchMetadata.nextEpoch)."""
    return 1 if epoch in (INITIAL_EPOCH, _MAX_EPOCH) else epoch + 1


# -- the leader's end -------------------------------------------------------------------------


@dataclass
class CachedPartition:
    """A session partition: the position last named, and what the last answer told about it."""

    fetch: pb.FetchPartition
    high_watermark: int = -1
    log_start_offset: int = -1


@dataclass
class FetchSession:
    id: int
    replica_id: int
    epoch: int  # the epoch the next request must carry
    last_used_ms: int
    partitions: dict[TopicPartition, CachedPartition] = field(default_factory=dict)


@dataclass
class FetchContext:
    """How to answer one fetch: which partitions to process, and which results to send.

    `partitions` is what a full fetch naming the whole session would list. `unchanged` says
    whether a partition may be left out of the answer; `respond` records what is answered."""

    session: FetchSession | None
    partitions: list[pb.FetchPartition]
    named: frozenset[TopicPartition] = frozenset()
    incremental: bool = False
    # Partitions the last read got records of (reading a result's bytes back would copy them).
    served: list[TopicPartition] = field(default_factory=list)
    # Incremental: the session's epoch once this request was taken in.
    epoch: int = INITIAL_EPOCH

    @property
    def session_id(self) -> int:
        return self.session.id if self.session is not None else NO_SESSION

    @property
    def superseded(self) -> bool:
        """Whether a later request of the session came in while this one waited (a client with
        two fetches of one session out at once): the session's partitions and positions are
        no longer the ones this request was taken in with. Kafka's IncrementalFetchContext
        answers it INVALID_FETCH_SESSION_EPOCH ("possible duplicate request"); so does the
        broker, with no partitions, and without reading them."""
        return self.incremental and self.session is not None and self.session.epoch != self.epoch

    def unchanged(
        self, tp: TopicPartition, must_read: bool, high_watermark: int, log_start_offset: int
    ) -> bool:
        """An incremental answer leaves out a partition the request did not name when it has
        nothing to read and its HW and log start offset are as last answered."""
        if not self.incremental or must_read or tp in self.named:
            return False
        assert self.session is not None
        cached = self.session.partitions[tp]
        return cached.high_watermark == high_watermark and (
            cached.log_start_offset == log_start_offset
        )

    def respond(self, results: list[pb.FetchPartitionResponse]) -> list[pb.FetchPartitionResponse]:
        """Remember what the answer tells; partitions that got records go to the end of the
        session, so the next answer under max_bytes starts with the others (fairness)."""
        if self.session is not None:
            partitions = self.session.partitions
            for result in results:
                tp = (result.topic, result.partition)
                cached = partitions.get(tp)
                if cached is None:
                    continue
                failed = result.error_code != NO_ERROR
                cached.high_watermark = -1 if failed else result.high_watermark
                cached.log_start_offset = -1 if failed else result.log_start_offset
            for tp in self.served:
                if tp in partitions:
                    partitions[tp] = partitions.pop(tp)
        return results


def fetch_partition_key(fp: pb.FetchPartition) -> TopicPartition:
    return (fp.topic, fp.partition)


class FetchSessionCache:
    """The leader's sessions (Kafka's FetchSessionCache), at most `max_slots` of them.

    A new session takes a free slot, or that of the session least recently used if it has
    been idle `eviction_ms`; a follower may also take a consumer's slot. Otherwise the fetch is
    answered in full without a session, and the fetcher asks again next time."""

    def __init__(
        self,
        max_slots: int,
        eviction_ms: int,
        new_session_id: Callable[[], int] = lambda: random.randint(1, _MAX_EPOCH),
    ) -> None:
        self.max_slots = max_slots
        self.eviction_ms = eviction_ms
        self._new_session_id = new_session_id
        self.sessions: dict[int, FetchSession] = {}  # least recently used first

    def context(self, request: pb.FetchRequest, now_ms: int) -> FetchContext:
        """Open, use or close the request's session. Raises FetchSessionIdNotFound or
        InvalidFetchSessionEpoch for an incremental fetch the cache cannot serve."""
        if not request.HasField("session"):
            return FetchContext(None, list(request.partitions))
        session_id, epoch = request.session.id, request.session.epoch
        if epoch in (INITIAL_EPOCH, FINAL_EPOCH):
            if session_id != NO_SESSION:
                self._close(session_id, request.replica_id)
            session = None
            if epoch == INITIAL_EPOCH:
                session = self._create(request, now_ms)
            return FetchContext(session, list(request.partitions))
        session = self.sessions.get(session_id)
        if session is None or session.replica_id != request.replica_id:
            raise FetchSessionIdNotFound(f"no fetch session {session_id} on this broker")
        if epoch != session.epoch:
            raise InvalidFetchSessionEpoch(
                f"fetch session {session_id} expects epoch {session.epoch}, got {epoch}"
            )
        session.epoch = next_epoch(epoch)
        self._touch(session, now_ms)
        partitions = session.partitions
        forgotten = request.forgotten
        if forgotten:  # iterating a repeated field costs even when it is empty
            for fp in forgotten:
                partitions.pop((fp.topic, fp.partition), None)
        named = []
        for fp in request.partitions:
            tp = fetch_partition_key(fp)
            named.append(tp)
            cached = partitions.get(tp)
            if cached is None:
                partitions[tp] = CachedPartition(fp)
            else:
                cached.fetch = fp
        return FetchContext(
            session,
            [cached.fetch for cached in partitions.values()],
            frozenset(named),
            incremental=True,
            epoch=session.epoch,
        )

    def _create(self, request: pb.FetchRequest, now_ms: int) -> FetchSession | None:
        if len(self.sessions) >= self.max_slots and not self._evict_one(request.replica_id, now_ms):
            return None
        session_id = self._new_session_id()
        while session_id in self.sessions or session_id == NO_SESSION:
            session_id = self._new_session_id()
        session = FetchSession(session_id, request.replica_id, next_epoch(INITIAL_EPOCH), now_ms)
        for fp in request.partitions:
            session.partitions[fetch_partition_key(fp)] = CachedPartition(fp)
        self.sessions[session_id] = session
        return session

    def _evict_one(self, replica_id: int, now_ms: int) -> bool:
        for session in self.sessions.values():
            stale = now_ms - session.last_used_ms >= self.eviction_ms
            if stale or (replica_id >= 0 > session.replica_id):
                del self.sessions[session.id]
                return True
        return False

    def _close(self, session_id: int, replica_id: int) -> None:
        session = self.sessions.get(session_id)
        if session is not None and session.replica_id == replica_id:
            del self.sessions[session_id]

    def _touch(self, session: FetchSession, now_ms: int) -> None:
        session.last_used_ms = now_ms
        self.sessions[session.id] = self.sessions.pop(session.id)


# -- the fetcher's end ------------------------------------------------------------------------

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


# A NamedTuple, not a frozen dataclass (about three times as dear to make): one per fetch.
class FetchPlan(NamedTuple, Generic[K]):
    """What the next fetch sends: its session id and epoch, the partitions to name, the
    partitions to drop from the session."""

    session_id: int
    epoch: int
    send: list[K]
    forgotten: list[K]

    @property
    def full(self) -> bool:
        return self.epoch == INITIAL_EPOCH


class FetchSessionHandler(Generic[K, V]):
    """A fetcher's side of its session with one leader (Kafka's FetchSessionHandler).

    `build` compares the positions wanted now with those the session holds; `on_response`
    moves to the next epoch, or back to a full fetch after any error or a lost answer."""

    def __init__(self) -> None:
        self.session_id = NO_SESSION
        self.epoch = INITIAL_EPOCH
        self._sent: dict[K, V] = {}

    def build(self, wanted: Mapping[K, V]) -> FetchPlan[K]:
        if self.epoch == INITIAL_EPOCH:  # a full fetch, which closes session_id if not 0
            plan = FetchPlan(self.session_id, INITIAL_EPOCH, list(wanted), [])
        else:
            sent = self._sent
            plan = FetchPlan(
                self.session_id,
                self.epoch,
                [k for k, v in wanted.items() if sent.get(k) != v],
                [k for k in sent if k not in wanted],
            )
        self._sent = dict(wanted)
        return plan

    def on_response(self, plan: FetchPlan[K], error_code: int, session_id: int) -> None:
        if error_code == ErrorCode.FETCH_SESSION_ID_NOT_FOUND:
            self.reset()
            self.session_id = NO_SESSION  # nothing to close
        elif error_code != NO_ERROR or (not plan.full and session_id != plan.session_id):
            self.reset()
        elif plan.full:
            self.session_id = session_id
            self.epoch = next_epoch(INITIAL_EPOCH) if session_id != NO_SESSION else INITIAL_EPOCH
        else:
            self.epoch = next_epoch(self.epoch)

    def successor(self) -> FetchSessionHandler[K, V]:
        """The session handler of a fetcher that replaces this one's (restarted, or the last
        partition it fetched added again): its first full fetch closes this session on the
        leader, which would otherwise hold it until evicted. A new handler, as this one's
        fetcher may still take an answer before it stops."""
        handler: FetchSessionHandler[K, V] = FetchSessionHandler()
        handler.session_id = self.session_id
        return handler

    def reset(self) -> None:
        """Start over with a full fetch: the leader's session may not match ours any more.
        The full fetch names the session, which closes it on the leader (Kafka's
        nextCloseExistingAttemptNew); one with id 0 would leave it holding a cache slot and
        its partitions until evicted."""
        self.epoch = INITIAL_EPOCH
        self._sent = {}
