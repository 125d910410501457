"""A purgatory's clock (an event loop's time() and call_at()) that the test moves by hand."""

from __future__ import annotations

from collections.abc import Callable


class FakeClock:
    """Time that moves only when told to; timers fire, in time order, as it passes them."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[FakeClock.Handle] = []

    class Handle:
        def __init__(self, when: float, callback: Callable[[], None]) -> None:
            self.when = when
            self.callback = callback
            self.cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> FakeClock.Handle:
        handle = FakeClock.Handle(when, callback)
        self.timers.append(handle)
        return handle

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while due := [h for h in self.timers if not h.cancelled and h.when <= self.now]:
            handle = min(due, key=lambda h: h.when)
            self.timers.remove(handle)
            handle.callback()

    @property
    def pending(self) -> int:
        return sum(not h.cancelled for h in self.timers)
