"""Waiting on a condition with a deadline, for tests and tools that drive a cluster: never
sleep-and-hope."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import grpc

from tidewater.errors import TidewaterError

# What a condition may raise while the cluster is still settling (a controller moving, a broker
# restarting): "not yet", not a failure.
SETTLING = (grpc.aio.AioRpcError, TidewaterError)
POLL_INTERVAL_S = 0.05


async def eventually(condition: Callable[[], Any], timeout_s: float) -> None:
    """Wait until `condition()` (maybe async) is truthy; AssertionError after timeout_s."""
    last_error: BaseException | None = None

    async def poll() -> None:
        nonlocal last_error
        while True:
            try:
                result = condition()
                if await result if inspect.isawaitable(result) else result:
                    return
            except SETTLING as e:
                last_error = e
            await asyncio.sleep(POLL_INTERVAL_S)

    try:
        async with asyncio.timeout(timeout_s):
            await poll()
    except TimeoutError:
        raise AssertionError(
            f"not true within {timeout_s} s: {getattr(condition, '__name__', condition)}"
            + (f" (last error: {last_error})" if last_error else "")
        ) from None
