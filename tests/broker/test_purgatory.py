"""The purgatory with a hand-driven timer: completion, expiry, and no leaks."""

from __future__ import annotations

from collections.abc import Callable

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
