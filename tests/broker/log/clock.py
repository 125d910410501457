"""The log tests' time: a clock the test moves by hand (the `clock` fixture's)."""

from __future__ import annotations

START_MS = 1_700_000_000_000


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: int = START_MS) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now
