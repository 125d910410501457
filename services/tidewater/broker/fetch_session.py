"""Incremental fetch sessions (Kafka's KIP-227): both ends, as pure state with the time as an
argument.

A follower that replicates many idle partitions would otherwise name every one of them in
every fetch, and get every one of them back, twice a second. In a session the leader keeps
each partition's last fetch position; a fetch names only partitions whose position changed
(`FetchSessionHandler`, the fetcher's end) and the answer carries only partitions with news
(`FetchSessionCache` / `FetchContext`, the leader's end). Nor does the leader process every
session partition on every fetch: only those named, and those not quiet (`FetchClock`): a
partition whose last answer told the follower everything, where the follower was caught up
and in sync, is left alone until something in it changes, and its follower's fetch times are
the session's. The follower's progress, ISR and HW rules see exactly what processing every
partition again would show them; an idle session's fetch costs O(1), not O(partitions).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from tidewater.errors import NO_ERROR, FetchSessionIdNotFound, InvalidFetchSessionEpoch
from tidewater.replication.replica import FetchClock
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
    # Its place in the session's order (`FetchSession.partitions`), as a number.
    seq: int = 0
    high_watermark: int = -1
    log_start_offset: int = -1


# What a session's waiting fetch is watched under besides its partitions: a quiet partition
# that changes wakes it through this key (a pair no topic partition can be).
_SESSION_KEY = object()


@dataclass(eq=False)
class FetchSession:
    id: int
    replica_id: int
    epoch: int  # the epoch the next request must carry
    last_used_ms: int
    partitions: dict[TopicPartition, CachedPartition] = field(default_factory=dict)
    # The broker epoch of the replica's last fetch (KIP-903): a fetch with another one is
    # processed whole.
    broker_epoch: int = 0
    # Its time and its partitions that are not quiet (all of them at first).
    clock: FetchClock = field(default_factory=FetchClock)
    _next_seq: int = 0

    @property
    def watch_key(self) -> tuple[object, int]:
        return (_SESSION_KEY, self.id)

    def put_last(self, tp: TopicPartition, fetch: pb.FetchPartition) -> None:
        """Add a partition at the end of the session, not quiet."""
        self._next_seq += 1
        self.partitions[tp] = CachedPartition(fetch, self._next_seq)
        self.clock.unsettled.add(tp)

    def move_last(self, tp: TopicPartition) -> None:
        self._next_seq += 1
        cached = self.partitions[tp] = self.partitions.pop(tp)
        cached.seq = self._next_seq

    def unsettled_fetches(self) -> list[pb.FetchPartition]:
        """The positions of the partitions that are not quiet, in the session's order."""
        partitions = self.partitions
        unsettled = self.clock.unsettled
        if 4 * len(unsettled) >= len(partitions):  # most of them: one pass, in order
            return [cached.fetch for tp, cached in partitions.items() if tp in unsettled]
        chosen = [partitions[tp] for tp in unsettled if tp in partitions]
        chosen.sort(key=lambda cached: cached.seq)
        return [cached.fetch for cached in chosen]


@dataclass
class FetchContext:
    """How to answer one fetch: which partitions to process, and which results to send.

    `partitions` is what to process: what the fetch names, or of an incremental fetch, the
    session's partitions that are named or not quiet. `unchanged` says whether a partition
    may be left out of the answer, `settle` that it is quiet now; `respond` records what is
    answered."""

    session: FetchSession | None
    # The partitions of a fetch that is not incremental.
    full: list[pb.FetchPartition]
    named: frozenset[TopicPartition] = frozenset()
    incremental: bool = False
    # Partitions the last read got records of (reading a result's bytes back would copy them).
    served: list[TopicPartition] = field(default_factory=list)
    # Incremental: the session's epoch once this request was taken in.
    epoch: int = INITIAL_EPOCH
    # The session was made by this request (its first answer tells the client of it).
    created: bool = False

    @property
    def session_id(self) -> int:
        return self.session.id if self.session is not None else NO_SESSION

    @property
    def clock(self) -> FetchClock | None:
        return self.session.clock if self.session is not None else None

    @property
    def partitions(self) -> list[pb.FetchPartition]:
        """Read again while the fetch waits: a quiet partition that changes joins them."""
        if not self.incremental:
            return self.full
        assert self.session is not None
        return self.session.unsettled_fetches()

    @property
    def watch_keys(self) -> list[Hashable]:
        """What a waiting fetch is watched under: its partitions, and its session."""
        keys: list[Hashable] = [(fp.topic, fp.partition) for fp in self.partitions]
        if self.incremental:
            assert self.session is not None
            keys.append(self.session.watch_key)
        return keys

    def settle(self, tp: TopicPartition) -> None:
        """`tp` is quiet: unchanged (as last answered), its follower too (if a follower
        fetches); it is processed again once it changes."""
        assert self.session is not None
        self.session.clock.unsettled.discard(tp)

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
                    self.session.move_last(tp)
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
        # The sessions holding each partition: a change to it is news to them.
        self._holding: dict[TopicPartition, dict[int, FetchSession]] = {}

    def holding(self, tp: TopicPartition) -> Iterable[FetchSession]:
        held = self._holding.get(tp)
        return list(held.values()) if held else ()

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
            return FetchContext(session, list(request.partitions), created=session is not None)
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
        unsettled = session.clock.unsettled
        forgotten = request.forgotten
        if forgotten:  # iterating a repeated field costs even when it is empty
            for fp in forgotten:
                tp = (fp.topic, fp.partition)
                if partitions.pop(tp, None) is not None:
                    self._release(tp, session)
                unsettled.discard(tp)
        named = []
        for fp in request.partitions:
            tp = fetch_partition_key(fp)
            named.append(tp)
            cached = partitions.get(tp)
            if cached is None:
                session.put_last(tp, fp)
                self._holding.setdefault(tp, {})[session.id] = session
            else:
                cached.fetch = fp
                unsettled.add(tp)
        if request.replica_broker_epoch != session.broker_epoch:
            # Another incarnation of the replica (KIP-903): every partition sees it.
            session.broker_epoch = request.replica_broker_epoch
            unsettled.update(partitions)
        return FetchContext(session, [], frozenset(named), incremental=True, epoch=session.epoch)

    def _create(self, request: pb.FetchRequest, now_ms: int) -> FetchSession | None:
        if len(self.sessions) >= self.max_slots and not self._evict_one(request.replica_id, now_ms):
            return None
        session_id = self._new_session_id()
        while session_id in self.sessions or session_id == NO_SESSION:
            session_id = self._new_session_id()
        session = FetchSession(
            session_id,
            request.replica_id,
            next_epoch(INITIAL_EPOCH),
            now_ms,
            broker_epoch=request.replica_broker_epoch,
        )
        for fp in request.partitions:
            tp = fetch_partition_key(fp)
            session.put_last(tp, fp)
            self._holding.setdefault(tp, {})[session_id] = session
        self.sessions[session_id] = session
        return session

    def _evict_one(self, replica_id: int, now_ms: int) -> bool:
        for session in self.sessions.values():
            stale = now_ms - session.last_used_ms >= self.eviction_ms
            if stale or (replica_id >= 0 > session.replica_id):
                self._remove(session)
                return True
        return False

    def discard(self, session: FetchSession | None) -> None:
        """Remove a session no answer told its client of."""
        if session is not None and self.sessions.get(session.id) is session:
            self._remove(session)

    def _close(self, session_id: int, replica_id: int) -> None:
        session = self.sessions.get(session_id)
        if session is not None and session.replica_id == replica_id:
            self._remove(session)

    def _remove(self, session: FetchSession) -> None:
        del self.sessions[session.id]
        for tp in session.partitions:
            self._release(tp, session)

    def _release(self, tp: TopicPartition, session: FetchSession) -> None:
        held = self._holding.get(tp)
        if held is not None:
            held.pop(session.id, None)
            if not held:
                del self._holding[tp]

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

    def build(self, wanted: Mapping[K, V], changed: Iterable[K]) -> FetchPlan[K]:
        """`changed`: the keys whose position in `wanted`, or absence from it, may differ from
        the last build's (the others are not looked at: a fetcher's idle round costs O(1))."""
        sent = self._sent
        if self.epoch == INITIAL_EPOCH:  # a full fetch, which closes session_id if not 0
            self._sent = dict(wanted)
            return FetchPlan(self.session_id, INITIAL_EPOCH, list(wanted), [])
        send, forgotten = [], []
        for k in changed:
            v = wanted.get(k)
            if v is None:
                if sent.pop(k, None) is not None:
                    forgotten.append(k)
            elif sent.get(k) != v:
                sent[k] = v
                send.append(k)
        return FetchPlan(self.session_id, self.epoch, send, forgotten)

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
