"""The one deadline-bounded wait every test uses."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tidewater.errors import TidewaterError
from tidewater.local.wait import eventually

# Far above any timeout_s here: reached only if eventually() misses its own deadline.
HANG_GUARD_S = 10


def cancelled_rpc_error() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "call cancelled"
    )


async def test_returns_the_value_once_a_sync_or_async_condition_holds() -> None:
    polls: list[int] = []

    def third_time() -> str:
        polls.append(1)
        return "third" if len(polls) == 3 else ""

    assert await eventually(third_time, HANG_GUARD_S, poll_interval_s=0) == "third"
    assert len(polls) == 3

    async def offset_now() -> int:
        return 7

    assert await eventually(offset_now, HANG_GUARD_S) == 7


async def test_settling_errors_are_retried_and_named_when_the_deadline_passes() -> None:
    def unavailable() -> bool:
        raise TidewaterError("broker 2 restarting")

    with pytest.raises(AssertionError, match=r"not true within 0.2 s: unavailable .*restarting"):
        await asyncio.wait_for(eventually(unavailable, 0.2), HANG_GUARD_S)


async def test_other_errors_fail_at_once() -> None:
    def broken() -> bool:
        raise ValueError("a bug in the test")

    with pytest.raises(ValueError, match="a bug in the test"):
        await eventually(broken, HANG_GUARD_S)


async def test_a_condition_blocked_past_the_deadline_is_cut_off() -> None:
    async def never() -> bool:
        await asyncio.Event().wait()
        return True

    with pytest.raises(AssertionError, match=r"not true within 0.2 s: never$"):
        await asyncio.wait_for(eventually(never, 0.2), HANG_GUARD_S)


async def test_a_deadline_the_condition_turns_into_an_rpc_error_still_ends_the_wait() -> None:
    # A gRPC call cancelled under the condition can end as AioRpcError(CANCELLED) instead of
    # CancelledError: a "settling" error, after which a wait relying on the cancellation alone
    # polled on forever.
    calls = 0

    async def cancelled_call() -> bool:
        nonlocal calls
        calls += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise cancelled_rpc_error() from None
        return True

    with pytest.raises(
        AssertionError, match=r"(?s)not true within 0.2 s: cancelled_call .*CANCELLED"
    ):
        await asyncio.wait_for(eventually(cancelled_call, 0.2), HANG_GUARD_S)
    assert calls == 1
