"""Fixtures of the broker tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.broker.logged import Logged
from tidewater.local.standin_controller import StandinController


@pytest.fixture
async def standin() -> AsyncIterator[tuple[StandinController, str]]:
    """The stand-in controller on 127.0.0.1, and its address. Ask for it before brokers that
    use it, so that it stops after them."""
    controller = StandinController(brokers={})
    address = await controller.start()
    yield controller, address
    await controller.stop()


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Logged:
    """logged(level, *words): whether a record at `level` whose message holds every word was
    logged with its exception."""

    def check(level: int, *words: str) -> bool:
        return any(
            r.levelno == level and r.exc_info and all(w in r.getMessage() for w in words)
            for r in caplog.records
        )

    return check
