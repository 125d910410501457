"""The Admin client's default_api_timeout_s bounds every call in all, across controllers that
do not answer: finding the controller, the attempts and the waits between them. Stub
controllers stand in for the network: the first answers part of a request and resigns, the
rest never answer; a stub metadata service answers slowly or never."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from tidewater.client import metadata
from tidewater.client.admin import Admin
from tidewater.errors import ControllerUnavailable
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1 import metadata_pb2
from tidewater.v1.errors_pb2 import ErrorCode

CONTROLLERS = ["c1:1", "c2:1", "c3:1"]


class Resigning:
    """Controllers reached through one channel each: the first call deletes a, is cut short
    at b (REQUEST_TIMED_OUT) and resigns; every later call, and every DescribeCluster, goes
    unanswered until its deadline. `timeouts` holds each attempt's."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def stub(self, address: str) -> Resigning:
        return self

    async def DeleteTopics(self, request: cpb.DeleteTopicsRequest, timeout: float) -> Any:
        self.timeouts.append(timeout)
        if len(self.timeouts) == 1:
            response = cpb.DeleteTopicsResponse(error_code=ErrorCode.REQUEST_TIMED_OUT)
            response.topics.add(topic="a", error_code=ErrorCode.NONE)
            response.topics.add(topic="b", error_code=ErrorCode.REQUEST_TIMED_OUT)
            return response
        return await self._unanswered(timeout)

    async def DescribeCluster(self, request: cpb.DescribeClusterRequest, timeout: float) -> Any:
        self.timeouts.append(timeout)
        return await self._unanswered(timeout)

    async def _unanswered(self, timeout: float) -> Any:
        await asyncio.sleep(timeout)
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata()
        )


def admin_of(controllers: Resigning, **timeouts: float) -> Admin:
    admin = Admin(CONTROLLERS, **timeouts)
    admin._controller._stub = controllers.stub  # type: ignore[method-assign,assignment]
    return admin


async def test_the_attempts_fit_in_the_api_timeout_and_the_answers_gathered_are_kept() -> None:
    controllers = Resigning()
    admin = admin_of(
        controllers, request_timeout_s=0.2, default_api_timeout_s=0.5, retry_backoff_s=0.01
    )
    with pytest.raises(ControllerUnavailable) as info:
        await admin.delete_topics(["a", "b"])
    # The unanswered attempts, one after another, wait no longer than the call may (before,
    # each of up to five per retry waited the whole request timeout).
    assert sum(controllers.timeouts[1:]) <= 0.5, controllers.timeouts
    # a was deleted: the error says so (before, its answer was dropped).
    assert [r.error_code for r in info.value.answers] == [
        ErrorCode.NONE,
        ErrorCode.REQUEST_TIMED_OUT,
    ]
    await admin.close()


async def test_the_wait_before_a_retry_ends_at_the_api_timeout() -> None:
    admin = admin_of(Resigning(), default_api_timeout_s=0.3, retry_backoff_s=3600)
    # Before, the call slept the whole backoff.
    with pytest.raises(ControllerUnavailable):
        await asyncio.wait_for(admin.delete_topics(["a", "b"]), 30)
    await admin.close()


async def test_a_call_not_per_item_fits_in_the_api_timeout_too() -> None:
    controllers = Resigning()
    admin = admin_of(controllers, request_timeout_s=0.2, default_api_timeout_s=0.5)
    with pytest.raises(ControllerUnavailable):
        await admin.describe_cluster()
    # Before, each of the five attempts (one per controller, and two more) waited the whole
    # request timeout: 1 s in all.
    assert sum(controllers.timeouts) <= 0.5, controllers.timeouts
    await admin.close()


class SlowMetadata:
    """A metadata service that names c1:1 as the active controller after `delay_s`
    (None: never answers)."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s

    def __call__(self, channel: object) -> SlowMetadata:
        return self

    async def GetMetadata(self, request: metadata_pb2.GetMetadataRequest, timeout: float) -> Any:
        if self.delay_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s or 0)
        response = metadata_pb2.GetMetadataResponse()
        response.controller.controller_id = 1
        response.controller.endpoint.host, response.controller.endpoint.port = "c1", 1
        return response


def discovering_admin(
    monkeypatch: pytest.MonkeyPatch, service: SlowMetadata, controllers: Resigning, **kw: float
) -> Admin:
    monkeypatch.setattr(metadata.metadata_pb2_grpc, "MetadataServiceStub", service)
    admin = Admin([], bootstrap=["m:1"], **kw)
    admin._controller._stub = controllers.stub  # type: ignore[method-assign,assignment]
    return admin


async def test_finding_the_controller_counts_against_the_api_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controllers = Resigning()
    admin = discovering_admin(
        monkeypatch,
        SlowMetadata(0.3),
        controllers,
        request_timeout_s=0.2,
        default_api_timeout_s=0.5,
    )
    with pytest.raises(ControllerUnavailable):
        await admin.describe_cluster()
    # The controller gets what the metadata service left of the call's 0.5 s (before, its
    # attempts had 0.5 s of their own after the 0.3 s spent finding it).
    assert controllers.timeouts and sum(controllers.timeouts) <= 0.2, controllers.timeouts
    await admin.close()


async def test_a_metadata_service_that_never_answers_ends_at_the_api_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = discovering_admin(
        monkeypatch,
        SlowMetadata(None),
        Resigning(),
        request_timeout_s=3600,
        default_api_timeout_s=0.3,
    )
    # Before, the call waited for the metadata service's request timeout, an hour.
    with pytest.raises(ControllerUnavailable, match="default_api_timeout_s"):
        await asyncio.wait_for(admin.delete_topics(["a"]), 30)
    await admin.close()


class Electing:
    """Controllers in a failover: `active` answers (after `answers_after` calls in all, while
    the election is under way), the others answer NOT_CONTROLLER naming nobody, and those
    `dead` do not answer at all."""

    def __init__(self, active: str, answers_after: int = 0) -> None:
        self.active = active
        self.answers_after = answers_after
        self.dead: set[str] = set()
        self.asked: list[str] = []

    def stub(self, address: str) -> Any:
        electing = self

        class Stub:
            async def DescribeCluster(
                self, request: cpb.DescribeClusterRequest, timeout: float
            ) -> Any:
                electing.asked.append(address)
                if address in electing.dead:
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()
                    )
                response = cpb.DescribeClusterResponse()
                if len(electing.asked) <= electing.answers_after or address != electing.active:
                    response.error_code = ErrorCode.NOT_CONTROLLER
                    response.controller.controller_id = -1
                else:
                    response.controller.controller_id = int(address[1])
                return response

        return Stub()


async def test_a_call_during_a_failover_is_retried_until_a_controller_is_elected() -> None:
    """Review 29 #2: while no controller was active the call went once around the known
    addresses, in milliseconds, and failed; Kafka's AdminClient retries until
    default.api.timeout.ms."""
    controllers = Electing("c2:1", answers_after=20)
    admin = Admin(CONTROLLERS, default_api_timeout_s=30, retry_backoff_s=0.01)
    admin._controller._stub = controllers.stub  # type: ignore[method-assign,assignment]
    try:
        described = await asyncio.wait_for(admin.describe_cluster(), 30)
        assert described.controller.controller_id == 2
        assert len(controllers.asked) > 20
    finally:
        await admin.close()


class Naming:
    """A metadata service naming `controller[0]` as the active controller."""

    def __init__(self, controller: list[str]) -> None:
        self.controller = controller

    def __call__(self, channel: object) -> Naming:
        return self

    async def GetMetadata(self, request: metadata_pb2.GetMetadataRequest, timeout: float) -> Any:
        response = metadata_pb2.GetMetadataResponse()
        host, _, port = self.controller[0].partition(":")
        response.controller.controller_id = int(host[1])
        response.controller.endpoint.host, response.controller.endpoint.port = host, int(port)
        return response


async def test_an_admin_from_bootstrap_asks_again_where_the_controller_is_once_it_died(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 29 #2: the metadata services were asked once, and every call after the
    controller they named had died failed at once, though they named the new one."""
    named = ["c1:1"]
    monkeypatch.setattr(metadata.metadata_pb2_grpc, "MetadataServiceStub", Naming(named))
    controllers = Electing("c1:1")
    admin = Admin([], bootstrap=["m:1"], default_api_timeout_s=30, retry_backoff_s=0.01)
    admin._controller._stub = controllers.stub  # type: ignore[method-assign,assignment]
    try:
        assert (await admin.describe_cluster()).controller.controller_id == 1
        controllers.dead.add("c1:1")
        controllers.active = named[0] = "c2:1"
        described = await asyncio.wait_for(admin.describe_cluster(), 30)
        assert described.controller.controller_id == 2
    finally:
        await admin.close()


class Blinking(Naming):
    """Names its controller once, then answers nothing (restarting)."""

    async def GetMetadata(self, request: metadata_pb2.GetMetadataRequest, timeout: float) -> Any:
        if getattr(self, "answered", False):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()
            )
        self.answered = True
        assert request.no_topics  # the controller's address only, not every topic
        return await super().GetMetadata(request, timeout)


async def test_a_metadata_service_out_of_reach_does_not_end_the_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 33 #1: while the controller failed over and the metadata service restarted,
    MetadataUnavailable from asking where the controller is escaped the retries (and the
    answers gathered), though the known controller answered a moment later."""
    monkeypatch.setattr(metadata.metadata_pb2_grpc, "MetadataServiceStub", Blinking(["c1:1"]))
    controllers = Electing("c1:1", answers_after=6)
    admin = Admin([], bootstrap=["m:1"], default_api_timeout_s=30, retry_backoff_s=0.01)
    admin._controller._stub = controllers.stub  # type: ignore[method-assign,assignment]
    try:
        described = await asyncio.wait_for(admin.describe_cluster(), 30)
        assert described.controller.controller_id == 1
    finally:
        await admin.close()
