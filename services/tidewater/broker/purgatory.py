"""Delayed operations and their purgatory (Kafka's DelayedOperationPurgatory).

An operation that cannot complete yet (an acks=all produce waiting for the high watermark,
a fetch waiting for min_bytes) is watched under one key per partition it depends on. Whatever
changes a partition (an append, a high watermark move) calls `check_and_complete(key)`; each
operation also expires after its timeout. Completion happens exactly once, whichever comes
first. The purgatory knows no clock of its own: expiry timers come from an injected scheduler,
so tests can drive it deterministically.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


# (delay in seconds, callback) -> handle; asyncio's loop.call_later fits.
Scheduler = Callable[[float, Callable[[], None]], TimerHandle]


class DelayedOperation(ABC):
    """One waiting request. Subclasses say when they can complete and what completing does."""

    def __init__(self, timeout_ms: int) -> None:
        self.timeout_ms = timeout_ms
        self.completed = False
        self._timer: TimerHandle | None = None
        self._keys: list[Hashable] = []

    @abstractmethod
    def try_complete(self) -> bool:
        """Check the completion condition; if met, call force_complete() and return its result."""

    @abstractmethod
    def on_complete(self) -> None:
        """Produce the operation's result. Runs exactly once, on completion or on expiry."""

    def on_expiration(self) -> None:  # noqa: B027 - an optional hook
        """Hook run just before on_complete() when the timeout fired first."""

    def force_complete(self) -> bool:
        if self.completed:
            return False
        self.completed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.on_complete()
        return True


class Purgatory:
    """Delayed operations watched by key."""

    def __init__(self, name: str, schedule: Scheduler) -> None:
        self.name = name
        self._schedule = schedule
        self._watchers: dict[Hashable, list[DelayedOperation]] = {}

    def try_complete_else_watch(self, op: DelayedOperation, keys: Iterable[Hashable]) -> bool:
        """Complete `op` now if it can; otherwise watch it under every key until it can or expires.

        Returns True when it completed at once.
        """
        if op.try_complete():
            return True
        self.watch(op, keys)
        return False

    def watch(self, op: DelayedOperation, keys: Iterable[Hashable]) -> None:
        """Watch `op` without trying it first: for a caller that has just found it cannot
        complete (nothing can change in between on a single event loop)."""
        op._keys = list(keys)
        for key in op._keys:
            self._watchers.setdefault(key, []).append(op)
        op._timer = self._schedule(op.timeout_ms / 1000.0, lambda: self._expire(op))

    def _expire(self, op: DelayedOperation) -> None:
        op._timer = None
        if not op.completed:
            op.on_expiration()
            op.force_complete()
        self._unwatch(op, skip=None)

    def _unwatch(self, op: DelayedOperation, skip: Hashable | None) -> None:
        """Drop a finished operation from the lists of its other keys, so none leaks."""
        for key in op._keys:
            if key == skip:
                continue
            watched = self._watchers.get(key)
            if watched is None:
                continue
            watched[:] = [other for other in watched if other is not op]
            if not watched:
                del self._watchers[key]

    def check_and_complete(self, key: Hashable) -> int:
        """Try every operation watched under `key`; return how many completed now."""
        ops = self._watchers.pop(key, None)
        if not ops:
            return 0
        completed = 0
        remaining: list[DelayedOperation] = []
        for op in ops:
            if op.completed:
                continue
            if op.try_complete():
                completed += 1
                self._unwatch(op, skip=key)
            else:
                remaining.append(op)
        if remaining:
            self._watchers.setdefault(key, []).extend(remaining)
        return completed

    def cancel_all(self) -> None:
        """Complete every watched operation now (shutdown), each with its current result."""
        ops = {id(op): op for watched in self._watchers.values() for op in watched}
        self._watchers.clear()
        for op in ops.values():
            op.force_complete()

    @property
    def watched(self) -> int:
        """Operations still waiting (Kafka's purgatory size)."""
        return len({id(op) for ops in self._watchers.values() for op in ops if not op.completed})
