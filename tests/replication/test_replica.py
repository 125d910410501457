from __future__ import annotations

from tidewater.replication.replica import UNKNOWN_OFFSET, Replica

T0 = 1_000_000
LAG = 10_000


def fetched(replica: Replica, fetch_offset: int, at_ms: int, leader_end_offset: int) -> Replica:
    replica.update_fetch_state(fetch_offset, 0, at_ms, leader_end_offset, broker_epoch=0)
    return replica


def test_fetch_at_the_leader_leo_is_caught_up_now() -> None:
    replica = fetched(Replica(2), fetch_offset=10, at_ms=T0, leader_end_offset=10)
    assert replica.last_caught_up_time_ms == T0
    assert replica.log_end_offset == 10


def test_fetch_up_to_what_the_leader_had_at_the_previous_fetch_is_caught_up_then() -> None:
    # At T0 the leader had 10; the follower fetched from 4 and got 4..9.
    replica = fetched(Replica(2), fetch_offset=4, at_ms=T0, leader_end_offset=10)
    # At T0+500 it asks for 10, but the leader has moved on to 15 meanwhile: it was caught up
    # at T0, not now.
    fetched(replica, fetch_offset=10, at_ms=T0 + 500, leader_end_offset=15)
    assert replica.last_caught_up_time_ms == T0
    # Keeping pace with the previous fetch keeps moving the caught-up time forward.
    fetched(replica, fetch_offset=15, at_ms=T0 + 1000, leader_end_offset=20)
    assert replica.last_caught_up_time_ms == T0 + 500


def test_fetch_behind_both_leos_leaves_the_caught_up_time() -> None:
    replica = fetched(Replica(2), fetch_offset=10, at_ms=T0, leader_end_offset=10)
    fetched(replica, fetch_offset=10, at_ms=T0 + 100, leader_end_offset=20)
    fetched(replica, fetch_offset=12, at_ms=T0 + 200, leader_end_offset=30)
    assert replica.last_caught_up_time_ms == T0
    assert replica.log_end_offset == 12


def test_fetch_records_the_followers_offsets() -> None:
    replica = Replica(2)
    replica.update_fetch_state(12, 3, T0, 20, broker_epoch=0)
    assert (replica.log_start_offset, replica.log_end_offset) == (3, 12)
    assert (replica.last_fetch_leader_log_end_offset, replica.last_fetch_time_ms) == (20, T0)


def test_caught_up_time_never_moves_back() -> None:
    replica = fetched(Replica(2), fetch_offset=10, at_ms=T0, leader_end_offset=10)
    fetched(replica, fetch_offset=10, at_ms=T0 - 50, leader_end_offset=10)  # a late answer
    assert replica.last_caught_up_time_ms == T0


def test_reset_by_a_new_leader_forgets_the_followers_log() -> None:
    replica = fetched(Replica(2), fetch_offset=10, at_ms=T0, leader_end_offset=10)
    replica.reset(T0 + 100, leader_end_offset=12, is_new_leader=True, in_sync=True)
    assert (replica.log_start_offset, replica.log_end_offset) == (UNKNOWN_OFFSET, UNKNOWN_OFFSET)
    assert replica.last_fetch_leader_log_end_offset == UNKNOWN_OFFSET
    assert replica.last_fetch_time_ms == 0
    # An ISR member gets a full lag window from now to show up.
    assert replica.last_caught_up_time_ms == T0 + 100
    assert replica.is_caught_up(12, T0 + 100 + LAG, LAG)
    assert not replica.is_caught_up(12, T0 + 101 + LAG, LAG)


def test_reset_of_a_replica_outside_the_isr_never_caught_up() -> None:
    replica = fetched(Replica(3), fetch_offset=10, at_ms=T0, leader_end_offset=10)
    replica.reset(T0 + 100, leader_end_offset=12, is_new_leader=True, in_sync=False)
    assert replica.last_caught_up_time_ms == 0
    assert not replica.is_caught_up(12, T0 + 100, LAG)


def test_reset_by_the_same_leader_keeps_the_followers_log() -> None:
    replica = fetched(Replica(2), fetch_offset=8, at_ms=T0, leader_end_offset=10)
    replica.reset(T0 + 100, leader_end_offset=12, is_new_leader=False, in_sync=False)
    assert replica.log_end_offset == 8
    assert replica.last_caught_up_time_ms == 0
    # Reaching what the leader had at the reset counts as caught up at the reset.
    fetched(replica, fetch_offset=12, at_ms=T0 + 300, leader_end_offset=14)
    assert replica.last_caught_up_time_ms == T0 + 100


def test_caught_up_at_the_leader_leo_however_long_ago_it_fetched() -> None:
    replica = fetched(Replica(2), fetch_offset=10, at_ms=T0, leader_end_offset=10)
    assert replica.is_caught_up(10, T0 + 100 * LAG, LAG)
    assert not replica.is_caught_up(11, T0 + 100 * LAG, LAG)


def test_caught_up_within_the_lag_time_and_not_after() -> None:
    replica = fetched(Replica(2), fetch_offset=10, at_ms=T0, leader_end_offset=10)
    assert replica.is_caught_up(20, T0 + LAG, LAG)
    assert not replica.is_caught_up(20, T0 + LAG + 1, LAG)
