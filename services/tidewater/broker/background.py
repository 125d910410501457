"""The broker's background tasks: periodic jobs that outlive a failed run (Kafka's
KafkaScheduler), and tasks that must run until the broker stops, whose end is otherwise a bug
said loudly: a silent end would stall every partition the task serves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


async def every(
    interval_s: float,
    job: Callable[[], Awaitable[None] | None],
    name: str,
    at_once: bool = False,
) -> None:
    """Run `job` every `interval_s` (the first run at once, or after one interval) until
    cancelled; a run that fails is logged, and the next one runs as planned."""
    if not at_once:
        await asyncio.sleep(interval_s)
    while True:
        try:
            if (pending := job()) is not None:
                await pending
        except Exception:
            log.exception("background job %s failed; next run in %g s", name, interval_s)
        await asyncio.sleep(interval_s)


def start(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A task meant to run until cancelled; should it end otherwise, the log says so with the
    exception that ended it."""
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(_report_end)
    return task


def start_every(
    interval_s: float, job: Callable[[], Awaitable[None] | None], name: str
) -> asyncio.Task[None]:
    """`every` as a task of its own."""
    return start(every(interval_s, job, name), name)


def _report_end(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    log.critical(
        "background task %s ended; it should run until the broker stops",
        task.get_name(),
        exc_info=task.exception(),
    )
