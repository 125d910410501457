"""Delayed operations and their purgatory (Kafka's DelayedOperationPurgatory).

An operation that cannot complete yet (an acks=all produce waiting for the high watermark,
a fetch waiting for min_bytes) is watched under one key per partition it depends on. Whatever
changes a partition (an append, a high watermark move) calls `check_and_complete(key)`; each
operation also expires after its timeout. Completion happens exactly once, whichever comes
first. The purgatory knows no clock of its own: the time and the expiry timers come from an
injected clock (asyncio's event loop fits), so tests can drive it deterministically.

A completion check that raises fails that operation alone: its on_failure answers its waiter
(the data path's with an error per partition, broker/delayed.py), and the caller of
`check_and_complete` (an append, a follower's fetch that moved the HW) and the other
operations under the key go on as if it had completed.

Expiry costs no timer per operation (asyncio's cost some microseconds each, armed and cancelled
for every produce and fetch): operations with the same timeout expire in the order they were
watched, so each timeout has one queue in that order and one timer, for the oldest operation
still waiting (Kafka's timing wheel serves the same purpose).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

# A queue may hold this many completed operations beyond twice those still waiting before it
# is rebuilt: most complete in order and leave from its front at once.
_SLACK = 64

log = logging.getLogger(__name__)


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """The time in seconds and timers at a time of it; asyncio's event loop fits."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle: ...


class DelayedOperation(ABC):
    """One waiting request. Subclasses say when they can complete and what completing does."""

    def __init__(self, timeout_ms: int) -> None:
        self.timeout_ms = timeout_ms
        self.completed = False
        self._keys: list[Hashable] = []
        self._deadline = 0.0
        self._expiry: _Expiry | None = None

    @abstractmethod
    def try_complete(self) -> bool:
        """Check the completion condition; if met, call force_complete() and return its result."""

    @abstractmethod
    def on_complete(self) -> None:
        """Produce the operation's result. Runs exactly once, on completion or on expiry."""

    @abstractmethod
    def on_failure(self, error: Exception) -> None:
        """Hand `error`, which checking the operation raised, to its waiter instead of a
        result. Runs instead of on_complete()."""

    def on_expiration(self) -> None:  # noqa: B027 - an optional hook
        """Hook run just before on_complete() when the timeout fired first."""

    def force_complete(self) -> bool:
        if not self._finish():
            return False
        self.on_complete()
        return True

    def fail(self, error: Exception) -> bool:
        """Complete with `error` instead of a result (on_failure)."""
        if not self._finish():
            return False
        self.on_failure(error)
        return True

    def _finish(self) -> bool:
        """Mark the operation completed, once."""
        if self.completed:
            return False
        self.completed = True
        if self._expiry is not None:
            self._expiry.left()
            self._expiry = None
        return True


class _Expiry:
    """The operations watched with one timeout, oldest first, and the timer of the oldest
    still waiting."""

    __slots__ = ("ops", "timeout_ms", "timer", "waiting")

    def __init__(self, timeout_ms: int) -> None:
        self.timeout_ms = timeout_ms
        self.ops: deque[DelayedOperation] = deque()
        self.waiting = 0
        self.timer: TimerHandle | None = None

    def left(self) -> None:
        """One operation completed: drop the completed ones from the front, and rebuild the
        queue if too many are stuck behind one still waiting."""
        self.waiting -= 1
        ops = self.ops
        while ops and ops[0].completed:
            ops.popleft()
        if len(ops) > 2 * self.waiting + _SLACK:
            waiting = [op for op in ops if not op.completed]
            ops.clear()  # in place: an expiry may be walking the queue
            ops.extend(waiting)


class Purgatory:
    """Delayed operations watched by key."""

    def __init__(self, name: str, clock: Clock) -> None:
        self.name = name
        self._clock = clock
        # Each key's operations in the order watched, as dict keys: a finished one leaves
        # each of its keys in O(1) (review 30 #3: rebuilding a list per key made expiring n
        # idle polls of one partition cost n^2, 4 s for 16,000).
        self._watchers: dict[Hashable, dict[DelayedOperation, None]] = {}
        self._expiries: dict[int, _Expiry] = {}  # by timeout_ms

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
            self._watchers.setdefault(key, {})[op] = None
        expiry = self._expiries.get(op.timeout_ms)
        if expiry is None:
            expiry = self._expiries[op.timeout_ms] = _Expiry(op.timeout_ms)
        op._deadline = self._clock.time() + op.timeout_ms / 1000.0
        op._expiry = expiry
        expiry.ops.append(op)
        expiry.waiting += 1
        if expiry.timer is None:
            self._arm(expiry, op._deadline)

    def _arm(self, expiry: _Expiry, when: float) -> None:
        expiry.timer = self._clock.call_at(when, lambda: self._expire_due(expiry))

    def _expire_due(self, expiry: _Expiry) -> None:
        """Expire the operations whose deadline passed; wait on for the next one."""
        expiry.timer = None
        now = self._clock.time()
        ops = expiry.ops
        while ops and (ops[0].completed or ops[0]._deadline <= now):
            op = ops.popleft()
            if not op.completed:
                op.on_expiration()
                op.force_complete()
                self._unwatch(op, skip=None)
        if ops:
            self._arm(expiry, ops[0]._deadline)
        else:  # clients choose timeouts: keep no queue for each one ever seen
            del self._expiries[expiry.timeout_ms]

    def _unwatch(self, op: DelayedOperation, skip: Hashable | None) -> None:
        """Drop a finished operation from the lists of its other keys, so none leaks."""
        for key in op._keys:
            if key == skip:
                continue
            watched = self._watchers.get(key)
            if watched is None:
                continue
            watched.pop(op, None)
            if not watched:
                del self._watchers[key]

    def check_and_complete(self, key: Hashable) -> int:
        """Try every operation watched under `key`; return how many completed now. Never
        raises for an operation's check: that operation fails with the error (_try_complete)."""
        ops = self._watchers.pop(key, None)
        if not ops:
            return 0
        completed = 0
        try:
            for op in ops:
                if not op.completed and self._try_complete(op):
                    completed += 1
                    self._unwatch(op, skip=key)
        finally:
            # Whatever happened, the operations still waiting stay watched under the key.
            waiting = [op for op in ops if not op.completed]
            if waiting:
                watched = self._watchers.setdefault(key, {})
                watched.update(dict.fromkeys(waiting))
        return completed

    def _try_complete(self, op: DelayedOperation) -> bool:
        """op.try_complete(); if that raises, `op` completes with the error, and only it: the
        caller (an append already in the log, a follower's fetch) and the other operations
        under the key must not fail with it."""
        try:
            return op.try_complete()
        except Exception as e:
            log.exception("%s purgatory: checking a delayed operation failed", self.name)
            op.fail(e)
            return True

    def cancel(self, op: DelayedOperation) -> None:
        """Complete `op` now and watch it no more: whoever waited for it has gone (a client's
        deadline, a disconnect). on_complete runs, its waiter's future already cancelled."""
        if op.force_complete():
            self._unwatch(op, skip=None)

    def cancel_all(self) -> None:
        """Complete every watched operation now (shutdown), each with its current result."""
        ops = {id(op): op for watched in self._watchers.values() for op in watched}
        self._watchers.clear()
        for op in ops.values():
            op.force_complete()
        for expiry in self._expiries.values():
            if expiry.timer is not None:
                expiry.timer.cancel()
        self._expiries.clear()

    @property
    def watched(self) -> int:
        """Operations still waiting (Kafka's purgatory size): each is in one expiry queue."""
        return sum(expiry.waiting for expiry in self._expiries.values())
