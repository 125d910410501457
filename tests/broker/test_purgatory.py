"""The purgatory with a hand-driven clock: completion, expiry, and no leaks; the delayed
fetch's reads."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.broker.fake_clock import FakeClock
from tidewater.broker.delayed import DelayedFetch
from tidewater.broker.purgatory import DelayedOperation, Purgatory


class WaitFor(DelayedOperation):
    def __init__(self, condition: Callable[[], bool], timeout_ms: int = 1000) -> None:
        super().__init__(timeout_ms)
        self.condition = condition
        self.result: str | None = None
        self.completions = 0

    def try_complete(self) -> bool:
        return self.condition() and self.force_complete()

    def on_expiration(self) -> None:
        self.result = "expired"

    def on_complete(self) -> None:
        self.completions += 1
        self.result = self.result or "done"

    def on_failure(self, error: Exception) -> None:
        self.completions += 1
        self.result = f"failed: {error}"


def test_completes_at_once_when_it_can() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    op = WaitFor(lambda: True)
    assert purgatory.try_complete_else_watch(op, ["a"])
    assert op.result == "done" and purgatory.watched == 0 and not clock.pending


def test_check_and_complete_wakes_watchers_of_that_key_only() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    ready = {"a": False, "b": False}
    op_a = WaitFor(lambda: ready["a"])
    op_b = WaitFor(lambda: ready["b"])
    assert not purgatory.try_complete_else_watch(op_a, ["a"])
    assert not purgatory.try_complete_else_watch(op_b, ["b"])
    ready["a"] = True
    assert purgatory.check_and_complete("b") == 0
    assert purgatory.check_and_complete("a") == 1
    assert op_a.result == "done" and op_b.result is None
    assert purgatory.watched == 1


def test_expiry_completes_once_and_unwatches() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    op = WaitFor(lambda: False)
    purgatory.try_complete_else_watch(op, ["a", "b"])
    clock.advance(0.999)
    assert op.result is None
    clock.advance(0.001)
    assert op.result == "expired" and op.completions == 1
    assert purgatory.watched == 0 and not purgatory._watchers
    assert purgatory.check_and_complete("a") == 0 and op.completions == 1


def test_completion_through_one_key_leaves_no_trace_under_others() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    ready = [False]
    op = WaitFor(lambda: ready[0])
    purgatory.try_complete_else_watch(op, ["a", "b", "c"])
    ready[0] = True
    assert purgatory.check_and_complete("b") == 1
    assert not purgatory._watchers
    assert not purgatory._expiries[1000].ops  # nor in the queue of its timeout
    clock.advance(1.0)
    assert op.completions == 1 and not purgatory._expiries


def test_cancel_all_completes_everything_once() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    ops = [WaitFor(lambda: False) for _ in range(3)]
    for op in ops:
        purgatory.try_complete_else_watch(op, ["a", "b"])
    purgatory.cancel_all()
    assert [op.completions for op in ops] == [1, 1, 1]
    assert purgatory.watched == 0


def test_watch_waits_for_a_change_without_trying_first() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    op = WaitFor(lambda: True)
    purgatory.watch(op, ["a"])
    assert op.result is None and purgatory.watched == 1
    assert purgatory.check_and_complete("a") == 1
    assert op.result == "done"


def test_operations_with_one_timeout_share_a_timer_and_expire_each_at_its_deadline() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    first, second = WaitFor(lambda: False), WaitFor(lambda: False)
    purgatory.watch(first, ["a"])
    clock.advance(0.4)
    purgatory.watch(second, ["a"])
    assert clock.pending == 1
    clock.advance(0.6)
    assert (first.result, second.result) == ("expired", None)
    clock.advance(0.399)
    assert second.result is None
    clock.advance(0.001)
    assert second.result == "expired" and purgatory.watched == 0


def test_a_shorter_timeout_expires_first_whatever_the_order_of_watching() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    slow, fast = WaitFor(lambda: False, timeout_ms=1000), WaitFor(lambda: False, timeout_ms=100)
    purgatory.watch(slow, ["a"])
    purgatory.watch(fast, ["a"])
    clock.advance(0.1)
    assert (slow.result, fast.result) == (None, "expired")
    clock.advance(0.9)
    assert slow.result == "expired"
    assert not purgatory._expiries  # no queue kept for a timeout no operation waits with


def test_completed_operations_do_not_pile_up_behind_one_still_waiting() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    stuck = WaitFor(lambda: False)
    purgatory.watch(stuck, ["stuck"])
    for i in range(1000):
        purgatory.watch(WaitFor(lambda: True), [i])
        assert purgatory.check_and_complete(i) == 1
    assert len(purgatory._expiries[1000].ops) < 100
    clock.advance(1.0)
    assert stuck.result == "expired" and not purgatory._expiries


def test_a_check_that_raises_fails_that_operation_alone() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    ready = [False]

    def broken() -> bool:
        if ready[0]:
            raise KeyError("gone")
        return False

    before, failing, after = (WaitFor(lambda: ready[0]), WaitFor(broken), WaitFor(lambda: ready[0]))
    waiting = WaitFor(lambda: False)
    for op in (before, failing, after, waiting):
        purgatory.watch(op, ["a", "b"])
    ready[0] = True
    # The caller (an append, a follower's fetch) does not see the error; the operations
    # behind the failing one are checked all the same.
    assert purgatory.check_and_complete("a") == 3
    assert [op.result for op in (before, failing, after)] == ["done", "failed: 'gone'", "done"]
    assert failing.completions == 1
    assert purgatory.watched == 1 and purgatory.check_and_complete("b") == 0
    clock.advance(1.0)
    assert waiting.result == "expired" and failing.completions == 1


def test_operations_still_waiting_stay_watched_whatever_a_check_raises() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)

    def interrupted() -> bool:
        raise KeyboardInterrupt

    first, stopping, last = WaitFor(lambda: False), WaitFor(interrupted), WaitFor(lambda: False)
    for op in (first, stopping, last):
        purgatory.watch(op, ["a"])
    with pytest.raises(KeyboardInterrupt):
        purgatory.check_and_complete("a")
    assert purgatory.watched == 3  # none lost, the unchecked one included
    clock.advance(1.0)
    assert [op.result for op in (first, stopping, last)] == ["expired"] * 3


def test_a_cancelled_operation_is_watched_no_more() -> None:
    clock = FakeClock()
    purgatory = Purgatory("test", clock)
    op, other = WaitFor(lambda: False), WaitFor(lambda: False)
    purgatory.watch(op, ["a", "b"])
    purgatory.watch(other, ["b"])
    purgatory.cancel(op)
    assert op.completions == 1 and purgatory.watched == 1
    assert list(purgatory._watchers) == ["b"] and len(purgatory._expiries[1000].ops) == 1
    purgatory.cancel(op)  # once only
    clock.advance(1.0)
    assert op.completions == 1 and other.result == "expired"


class FetchedLog:
    """What a delayed fetch reads: `readable` bytes past its offset, and each read it made;
    one fetch of it waits in a purgatory with a hand-driven timer."""

    def __init__(self, min_bytes: int) -> None:
        self.readable = 0
        self.high_watermark = 0
        self.reads: list[int] = []
        self.error: Exception | None = None
        self.clock = FakeClock()
        self.purgatory = Purgatory("Fetch", self.clock)
        self.fetch: DelayedFetch[str] = DelayedFetch(
            500, min_bytes, self.read, lambda: self.readable > 0, lambda e: f"failed: {e}"
        )
        self.purgatory.watch(self.fetch, ["p"])

    def read(self) -> tuple[str, int, bool]:
        if self.error is not None:
            raise self.error
        self.reads.append(self.readable)
        return f"{self.readable} bytes, HW {self.high_watermark}", self.readable, False

    def changed(self) -> int:
        return self.purgatory.check_and_complete("p")


async def test_a_delayed_fetch_reads_only_once_something_is_readable() -> None:
    log = FetchedLog(min_bytes=10)
    log.high_watermark = 5
    assert log.changed() == 0  # the HW moved: nothing to read
    assert log.reads == []
    log.readable = 4
    assert log.changed() == 0  # fewer than min_bytes
    log.readable = 12
    assert log.changed() == 1
    assert log.reads == [4, 12]
    assert log.fetch.done.result() == "12 bytes, HW 5"  # the read that completed it


async def test_an_expired_delayed_fetch_answers_with_a_read_at_expiry() -> None:
    log = FetchedLog(min_bytes=1)
    log.high_watermark = 7
    log.changed()
    log.clock.advance(0.5)
    assert log.fetch.done.result() == "0 bytes, HW 7"
    assert log.purgatory.watched == 0


async def test_a_delayed_fetch_whose_read_fails_at_expiry_answers_failed() -> None:
    log = FetchedLog(min_bytes=1)
    log.error = OSError("disk gone")
    log.clock.advance(0.5)
    assert log.fetch.done.result() == "failed: disk gone"
