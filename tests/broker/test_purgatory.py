"""The purgatory with a hand-driven timer: completion, expiry, and no leaks; the delayed
fetch's reads."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tidewater.broker.delayed import DelayedFetch
from tidewater.broker.purgatory import DelayedOperation, Purgatory


class FakeTimers:
    def __init__(self) -> None:
        self.pending: list[tuple[float, Callable[[], None], FakeTimers.Handle]] = []

    class Handle:
        def __init__(self) -> None:
            self.cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    def schedule(self, delay: float, callback: Callable[[], None]) -> FakeTimers.Handle:
        handle = FakeTimers.Handle()
        self.pending.append((delay, callback, handle))
        return handle

    def fire_all(self) -> None:
        for _, callback, handle in self.pending:
            if not handle.cancelled:
                callback()
        self.pending.clear()


class WaitFor(DelayedOperation):
    def __init__(self, condition: Callable[[], bool]) -> None:
        super().__init__(timeout_ms=1000)
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


def test_completes_at_once_when_it_can() -> None:
    timers = FakeTimers()
    purgatory = Purgatory("test", timers.schedule)
    op = WaitFor(lambda: True)
    assert purgatory.try_complete_else_watch(op, ["a"])
    assert op.result == "done" and purgatory.watched == 0 and not timers.pending


def test_check_and_complete_wakes_watchers_of_that_key_only() -> None:
    timers = FakeTimers()
    purgatory = Purgatory("test", timers.schedule)
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
    timers = FakeTimers()
    purgatory = Purgatory("test", timers.schedule)
    op = WaitFor(lambda: False)
    purgatory.try_complete_else_watch(op, ["a", "b"])
    timers.fire_all()
    assert op.result == "expired" and op.completions == 1
    assert purgatory.watched == 0 and not purgatory._watchers
    assert purgatory.check_and_complete("a") == 0 and op.completions == 1


def test_completion_through_one_key_leaves_no_trace_under_others() -> None:
    timers = FakeTimers()
    purgatory = Purgatory("test", timers.schedule)
    ready = [False]
    op = WaitFor(lambda: ready[0])
    purgatory.try_complete_else_watch(op, ["a", "b", "c"])
    ready[0] = True
    assert purgatory.check_and_complete("b") == 1
    assert not purgatory._watchers
    assert timers.pending[0][2].cancelled  # the expiry timer is cancelled too
    timers.fire_all()
    assert op.completions == 1


def test_cancel_all_completes_everything_once() -> None:
    timers = FakeTimers()
    purgatory = Purgatory("test", timers.schedule)
    ops = [WaitFor(lambda: False) for _ in range(3)]
    for op in ops:
        purgatory.try_complete_else_watch(op, ["a", "b"])
    purgatory.cancel_all()
    assert [op.completions for op in ops] == [1, 1, 1]
    assert purgatory.watched == 0


def test_watch_waits_for_a_change_without_trying_first() -> None:
    timers = FakeTimers()
    purgatory = Purgatory("test", timers.schedule)
    op = WaitFor(lambda: True)
    purgatory.watch(op, ["a"])
    assert op.result is None and purgatory.watched == 1
    assert purgatory.check_and_complete("a") == 1
    assert op.result == "done"


class FetchedLog:
    """What a delayed fetch reads: `readable` bytes past its offset, and each read it made;
    one fetch of it waits in a purgatory with a hand-driven timer."""

    def __init__(self, min_bytes: int) -> None:
        self.readable = 0
        self.high_watermark = 0
        self.reads: list[int] = []
        self.error: Exception | None = None
        self.timers = FakeTimers()
        self.purgatory = Purgatory("Fetch", self.timers.schedule)
        self.fetch: DelayedFetch[str] = DelayedFetch(
            500, min_bytes, self.read, lambda: self.readable > 0
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
    log.timers.fire_all()
    assert log.fetch.done.result() == "0 bytes, HW 7"
    assert log.purgatory.watched == 0


async def test_a_delayed_fetch_whose_read_fails_at_expiry_fails() -> None:
    log = FetchedLog(min_bytes=1)
    log.error = OSError("disk gone")
    log.timers.fire_all()
    with pytest.raises(OSError, match="disk gone"):
        log.fetch.done.result()
