"""Incremental fetch sessions (KIP-227), both ends, as pure state: no broker, no clock."""

from __future__ import annotations

import itertools

import pytest

from tidewater.broker.fetch_session import (
    FetchSessionCache,
    FetchSessionHandler,
    next_epoch,
)
from tidewater.errors import FetchSessionIdNotFound, InvalidFetchSessionEpoch
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

FOLLOWER = 2
CONSUMER = -1


def fp(partition: int, offset: int = 0, topic: str = "t") -> pb.FetchPartition:
    return pb.FetchPartition(topic=topic, partition=partition, fetch_offset=offset)


def request(
    *partitions: pb.FetchPartition,
    session: tuple[int, int] | None = None,
    forgotten: tuple[int, ...] = (),
    replica_id: int = FOLLOWER,
) -> pb.FetchRequest:
    req = pb.FetchRequest(replica_id=replica_id, partitions=partitions)
    if session is not None:
        req.session.id, req.session.epoch = session
    for p in forgotten:
        req.forgotten.add(topic="t", partition=p)
    return req


def answer(partition: int, hw: int, records: bytes = b"") -> pb.FetchPartitionResponse:
    return pb.FetchPartitionResponse(
        topic="t",
        partition=partition,
        high_watermark=hw,
        log_start_offset=0,
        record_batches=records,
    )


def cache(slots: int = 10, eviction_ms: int = 1000) -> FetchSessionCache:
    ids = itertools.count(101)
    return FetchSessionCache(slots, eviction_ms, lambda: next(ids))


def names(partitions: list[pb.FetchPartition]) -> list[int]:
    return [p.partition for p in partitions]


def open_session(c: FetchSessionCache, *partitions: int, now: int = 0) -> int:
    context = c.context(request(*(fp(p) for p in partitions), session=(0, 0)), now)
    context.respond([answer(p, hw=0) for p in partitions])
    return context.session_id


def test_a_fetch_without_a_session_is_answered_in_full() -> None:
    c = cache()
    context = c.context(request(fp(0), fp(1), replica_id=CONSUMER), 0)
    assert context.session_id == 0
    assert names(context.partitions) == [0, 1]
    assert not context.unchanged(("t", 0), False, 0, 0)
    assert c.sessions == {}


def test_a_full_fetch_at_epoch_0_opens_a_session() -> None:
    c = cache()
    context = c.context(request(fp(0), fp(1), session=(0, 0)), 0)
    assert context.session_id == 101
    assert names(context.partitions) == [0, 1]
    assert c.sessions[101].epoch == 1


def test_incremental_fetch_processes_the_session_and_answers_only_news() -> None:
    c = cache()
    session_id = open_session(c, 0, 1, 2)
    context = c.context(request(fp(1, offset=5), session=(session_id, 1)), 10)
    # Every session partition is processed (none is quiet yet), the named one with its new
    # position.
    assert [(p.partition, p.fetch_offset) for p in context.partitions] == [(0, 0), (1, 5), (2, 0)]
    assert not context.unchanged(("t", 1), False, 0, 0)  # named: always answered
    assert context.unchanged(("t", 0), False, 0, 0)  # nothing new
    assert not context.unchanged(("t", 0), True, 0, 0)  # records (or an error) to read
    assert not context.unchanged(("t", 2), False, 7, 0)  # the HW moved
    assert not context.unchanged(("t", 2), False, 0, 3)  # the log start offset moved
    context.respond([answer(1, hw=0), answer(2, hw=7)])
    context = c.context(request(session=(session_id, 2)), 20)
    assert context.unchanged(("t", 2), False, 7, 0)


def test_forgotten_partitions_leave_the_session() -> None:
    c = cache()
    session_id = open_session(c, 0, 1)
    context = c.context(request(fp(3), session=(session_id, 1), forgotten=(0,)), 0)
    assert names(context.partitions) == [1, 3]


def test_partitions_that_got_records_go_to_the_end_of_the_session() -> None:
    c = cache()
    session_id = open_session(c, 0, 1, 2)
    context = c.context(request(session=(session_id, 1)), 0)
    context.served.append(("t", 0))
    context.respond([answer(0, hw=3, records=b"batch")])
    assert names(c.context(request(session=(session_id, 2)), 0).partitions) == [1, 2, 0]


def test_an_error_is_answered_again_until_the_partition_is_named() -> None:
    c = cache()
    session_id = open_session(c, 0)
    context = c.context(request(session=(session_id, 1)), 0)
    failed = pb.FetchPartitionResponse(
        topic="t", partition=0, error_code=ErrorCode.NOT_LEADER_OR_FOLLOWER
    )
    context.respond([failed])
    context = c.context(request(session=(session_id, 2)), 0)
    assert not context.unchanged(("t", 0), False, 0, 0)


def test_unknown_session_and_wrong_epoch_are_named_errors() -> None:
    c = cache()
    session_id = open_session(c, 0)
    with pytest.raises(FetchSessionIdNotFound):
        c.context(request(session=(999, 1)), 0)
    with pytest.raises(FetchSessionIdNotFound):  # sessions belong to their replica
        c.context(request(session=(session_id, 1), replica_id=3), 0)
    with pytest.raises(InvalidFetchSessionEpoch):
        c.context(request(session=(session_id, 2)), 0)
    c.context(request(session=(session_id, 1)), 0)
    with pytest.raises(InvalidFetchSessionEpoch):  # a replayed request
        c.context(request(session=(session_id, 1)), 0)


def test_a_request_taken_in_before_a_later_one_of_its_session_is_superseded() -> None:
    c = cache()
    session_id = open_session(c, 0, 1)
    earlier = c.context(request(session=(session_id, 1)), 0)
    assert not earlier.superseded
    later = c.context(request(session=(session_id, 2), forgotten=(0,)), 0)
    # The earlier one's partitions are no longer the session's: it is refused, not read.
    assert earlier.superseded and not later.superseded
    assert not c.context(request(fp(0), session=(0, 0)), 0).superseded  # full fetches never


def test_epoch_minus_1_closes_and_epoch_0_replaces_a_session() -> None:
    c = cache()
    first = open_session(c, 0)
    context = c.context(request(fp(0), session=(first, 0)), 0)
    assert context.session_id not in (0, first)
    assert list(c.sessions) == [context.session_id]
    closing = c.context(request(fp(0), session=(context.session_id, -1)), 0)
    assert closing.session_id == 0
    assert names(closing.partitions) == [0]
    assert c.sessions == {}


def test_a_full_cache_evicts_only_idle_sessions_or_consumers_for_followers() -> None:
    c = cache(slots=1, eviction_ms=1000)
    consumer = c.context(request(fp(0), session=(0, 0), replica_id=CONSUMER), 0).session_id
    # Another consumer finds no room while the first session is in use: no session.
    assert c.context(request(fp(0), session=(0, 0), replica_id=CONSUMER), 500).session_id == 0
    assert list(c.sessions) == [consumer]
    # A follower takes a consumer's slot.
    follower = c.context(request(fp(0), session=(0, 0)), 500).session_id
    assert list(c.sessions) == [follower]
    # Idle for eviction_ms: anyone may take the slot.
    other = c.context(request(fp(0), session=(0, 0), replica_id=3), 1500).session_id
    assert list(c.sessions) == [other]


def test_epochs_wrap_to_1() -> None:
    assert next_epoch(0) == 1
    assert next_epoch(7) == 8
    assert next_epoch(2**31 - 1) == 1


def test_handler_sends_only_changed_positions_and_forgotten_partitions() -> None:
    handler: FetchSessionHandler[int, int] = FetchSessionHandler()
    plan = handler.build({0: 10, 1: 20}, {0, 1})
    assert (plan.session_id, plan.epoch, plan.send, plan.forgotten) == (0, 0, [0, 1], [])
    handler.on_response(plan, ErrorCode.NONE, session_id=7)
    plan = handler.build({0: 10, 1: 20}, {0, 1})
    assert (plan.session_id, plan.epoch, plan.send, plan.forgotten) == (7, 1, [], [])
    handler.on_response(plan, ErrorCode.NONE, session_id=7)
    plan = handler.build({0: 11, 2: 5}, {0, 1, 2})
    assert (plan.epoch, plan.send, plan.forgotten) == (2, [0, 2], [1])


def test_handler_falls_back_to_a_full_fetch() -> None:
    handler: FetchSessionHandler[int, int] = FetchSessionHandler()
    plan = handler.build({0: 10}, {0})
    handler.on_response(plan, ErrorCode.NONE, session_id=0)  # the leader had no room
    assert handler.build({0: 10}, {0}).full
    # The full fetch names the session to close (Kafka's nextCloseExistingAttemptNew),
    # unless the leader has no such session.
    for error, session_id, closes in (
        (ErrorCode.FETCH_SESSION_ID_NOT_FOUND, 0, 0),
        (ErrorCode.INVALID_FETCH_SESSION_EPOCH, 0, 7),
        (ErrorCode.NOT_LEADER_OR_FOLLOWER, 0, 7),
        (ErrorCode.NONE, 8, 7),  # an answer from another session
    ):
        handler.on_response(handler.build({0: 10}, {0}), ErrorCode.NONE, session_id=7)
        plan = handler.build({0: 10}, {0})
        assert not plan.full
        handler.on_response(plan, error, session_id)
        plan = handler.build({0: 10}, {0})
        assert (plan.full, plan.session_id, plan.send) == (True, closes, [0])


def test_a_session_given_up_is_closed_on_the_leader() -> None:
    c = cache()
    handler: FetchSessionHandler[tuple[str, int], int] = FetchSessionHandler()
    wanted = {("t", p): 0 for p in range(50)}
    for _ in range(10):
        plan = handler.build(wanted, wanted)
        req = request(*(fp(tp[1]) for tp in plan.send), session=(plan.session_id, plan.epoch))
        handler.on_response(plan, ErrorCode.NONE, c.context(req, 0).session_id)
        handler.reset()  # the stream broke: the answer to the next fetch would be lost
    assert len(c.sessions) == 1  # each full fetch closed the session before it
    assert [len(s.partitions) for s in c.sessions.values()] == [50]


def test_both_ends_together_leave_idle_partitions_out() -> None:
    c = cache()
    handler: FetchSessionHandler[tuple[str, int], int] = FetchSessionHandler()
    positions = {("t", p): 0 for p in range(100)}
    hw = dict.fromkeys(positions, 0)

    def fetch() -> list[int]:
        plan = handler.build(positions, positions)
        req = request(
            *(fp(tp[1], positions[tp]) for tp in plan.send),
            session=(plan.session_id, plan.epoch),
            forgotten=tuple(tp[1] for tp in plan.forgotten),
        )
        context = c.context(req, 0)
        results = [
            answer(p.partition, hw[(p.topic, p.partition)])
            for p in context.partitions
            if not context.unchanged((p.topic, p.partition), False, hw[(p.topic, p.partition)], 0)
        ]
        handler.on_response(plan, ErrorCode.NONE, context.session_id)
        return [r.partition for r in context.respond(results)]

    assert len(fetch()) == 100
    assert fetch() == []
    hw[("t", 42)] = 3
    assert fetch() == [42]
    positions[("t", 7)] = 1
    assert fetch() == [7]
    assert fetch() == []


def test_quiet_partitions_are_processed_again_only_once_named_or_changed() -> None:
    c = cache()
    session_id = open_session(c, 0, 1, 2, 3)
    context = c.context(request(session=(session_id, 1)), 0)
    assert names(context.partitions) == [0, 1, 2, 3]
    for p in (0, 1, 3):
        context.settle(("t", p))  # the leader found nothing to do in them
    assert [key for key in context.watch_keys if key != c.sessions[session_id].watch_key] == [
        ("t", 2)
    ]
    assert names(c.context(request(session=(session_id, 2)), 0).partitions) == [2]
    # Named again, or changed (the broker marks it when its data, HW or role moves).
    named = c.context(request(fp(3, offset=4), session=(session_id, 3)), 0)
    assert names(named.partitions) == [2, 3]
    (session,) = c.holding(("t", 0))
    session.clock.unsettled.add(("t", 0))
    assert names(named.partitions) == [0, 2, 3], "read again while the fetch waits"
    # A fetch of another incarnation of the follower (KIP-903) processes every partition.
    again = request(session=(session_id, 4))
    again.replica_broker_epoch = 9
    assert names(c.context(again, 0).partitions) == [0, 1, 2, 3]


def test_the_sessions_holding_a_partition_are_known_until_it_leaves_them() -> None:
    c = cache()
    first, second = open_session(c, 0, 1), open_session(c, 1)
    assert [s.id for s in c.holding(("t", 1))] == [first, second]
    c.context(request(session=(first, 1), forgotten=(1,)), 0)
    assert [s.id for s in c.holding(("t", 1))] == [second]
    c.context(request(session=(second, -1)), 0)  # closed
    assert list(c.holding(("t", 1))) == []
    assert [s.id for s in c.holding(("t", 0))] == [first]


def test_handler_looks_only_at_the_changed_positions() -> None:
    handler: FetchSessionHandler[int, int] = FetchSessionHandler()
    handler.on_response(handler.build({0: 10, 1: 20}, {0, 1}), ErrorCode.NONE, session_id=7)
    plan = handler.build({0: 11, 1: 21}, {1})
    assert (plan.send, plan.forgotten) == ([1], []), "0 was not said to have changed"
    handler.on_response(plan, ErrorCode.NONE, session_id=7)
    assert handler.build({0: 11}, {0, 1}).send == [0]
