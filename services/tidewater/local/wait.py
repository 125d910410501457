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


async def eventually(
    condition: Callable[[], Any], timeout_s: float, poll_interval_s: float = POLL_INTERVAL_S
) -> Any:
    """Wait until `condition()` (maybe async) is truthy and return that value; AssertionError
    after timeout_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                result = condition()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return result
        except TimeoutError:
            break
        except SETTLING as e:
            last_error = e
        # The deadline is checked here too, not only by the timeout's cancellation: a condition
        # may turn that cancellation into an error of its own (an RPC ending CANCELLED), which
        # is "settling" and would otherwise poll on with no deadline left.
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        await asyncio.sleep(min(poll_interval_s, remaining))
    raise AssertionError(
        f"not true within {timeout_s} s: {getattr(condition, '__name__', condition)}"
        + (f" (last error: {last_error})" if last_error else "")
    )
