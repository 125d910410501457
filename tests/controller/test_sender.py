"""The controller's requests to a metadata service that is out of reach for a while: the real
BrokerSender and a real MetadataServer on loopback; the controller is a stand-in with what the
sender reads (its model, epoch and configuration). And the topic configs its UpdateMetadata
requests carry to brokers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tidewater.controller import sender as sender_mod
from tidewater.controller.controller import Controller
from tidewater.controller.core import PartitionChange
from tidewater.controller.model import BrokerState, ClusterModel, PartitionRecord, TopicState
from tidewater.controller.sender import BrokerSender
from tidewater.local.tcp_proxy import NOWHERE, TcpProxy
from tidewater.local.wait import eventually
from tidewater.metadata.server import MetadataServer
from tidewater.telemetry import tracing
from tidewater.v1 import broker_pb2, cluster_pb2

TP = ("orders", 0)


def stand_in(address: str) -> Any:
    model = ClusterModel()
    model.topics["orders"] = TopicState("orders", {}, {0: (1,)})
    config = SimpleNamespace(
        controller_id=1, host="127.0.0.1", port=1, metadata_addresses=[address]
    )
    controller = SimpleNamespace(model=model, epoch=1, config=config, in_grace=False)
    set_leader_epoch(controller, 0)
    return controller


def set_leader_epoch(controller: Any, leader_epoch: int) -> None:
    controller.model.partitions[TP] = PartitionRecord(
        leader=-1, leader_epoch=leader_epoch, isr=(), controller_epoch=1
    )


class Recording(MetadataServer):
    """A metadata service that records the leader epoch of each FULL view it applies."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.full_views: list[int] = []
        apply = self.cache.apply

        def recording(request: cluster_pb2.UpdateMetadataRequest) -> None:
            apply(request)
            if request.type == cluster_pb2.UPDATE_METADATA_TYPE_FULL:
                self.full_views.append(request.partition_states[0].leader_epoch)

        self.cache.apply = recording  # type: ignore[method-assign]


@pytest.fixture
async def sender_to() -> AsyncIterator[tuple[TcpProxy, Any, BrokerSender]]:
    """The sender and the metadata service's address it is given: a proxy leading nowhere
    (out of reach) until the test starts the service, on a port of its own, behind it."""
    async with TcpProxy(NOWHERE) as front:
        controller = stand_in(front.address)
        sender = BrokerSender(cast(Controller, controller))
        yield front, controller, sender
        workers = list(sender._workers.values())
        sender.reset()
        await asyncio.gather(*workers, return_exceptions=True)


async def serve_behind(front: TcpProxy) -> Recording:
    server = Recording("127.0.0.1:0")
    await server.start()
    front.retarget(server.address)
    return server


async def test_a_metadata_service_back_from_an_outage_gets_the_current_full_view_once(
    sender_to: tuple[TcpProxy, Any, BrokerSender],
) -> None:
    """Before, every refresh (one a second) queued one more FULL view while the service was
    out of reach, each retried for ~50 s, and the service replayed them all, oldest first,
    when it came back."""
    front, controller, sender = sender_to
    for leader_epoch in range(8):  # eight refreshes while the service is down
        set_leader_epoch(controller, leader_epoch)
        sender.refresh_metadata_services()
        await asyncio.sleep(0)  # the worker takes the first one and waits for the service
    queue = sender._queues[f"metadata {front.address}"]
    assert queue.qsize() <= 1
    server = await serve_behind(front)
    try:
        await eventually(lambda: server.full_views[-1:] == [7] and queue.empty(), 20)
        # At most the view in flight when the service came back, then the current one.
        assert len(server.full_views) <= 2
    finally:
        await server.stop(grace_s=0)


async def test_deltas_behind_one_a_metadata_service_missed_are_dropped(
    sender_to: tuple[TcpProxy, Any, BrokerSender], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, each queued delta was retried in turn to the unreachable service (and the FULL
    view it needs waited behind all of them)."""
    monkeypatch.setattr(sender_mod, "RPC_TIMEOUT_S", 0.5)
    monkeypatch.setattr(sender_mod, "ATTEMPTS", 1)
    front, _, sender = sender_to
    address = front.address
    server = await serve_behind(front)
    sender.refresh_metadata_services()
    await eventually(lambda: address in sender._metadata_current, 20)
    await server.stop(grace_s=0)
    front.retarget(NOWHERE)
    sent = sender.requests_sent
    for _ in range(5):  # empty deltas, probing whether the service restarted
        sender.refresh_metadata_services()
    queue = sender._queues[f"metadata {address}"]
    await eventually(lambda: address not in sender._metadata_current and queue.empty(), 20)
    assert sender.requests_sent - sent == 1


def test_update_metadata_carries_changed_configs_and_a_full_view_every_topics(
    sender_to: tuple[TcpProxy, Any, BrokerSender], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config change reaches the brokers in a DELTA; a broker that missed it (fenced then)
    gets every topic's configs in the FULL view it is sent when unfenced. Before, neither
    request to a broker carried any."""
    _, controller, sender = sender_to
    model = controller.model
    model.topics["orders"].configs = {"retention.ms": "1000"}
    model.topics["plain"] = TopicState("plain", {}, {0: (1,)})
    model.partitions["plain", 0] = model.partitions[TP]
    model.brokers[1] = BrokerState(1, "127.0.0.1", 1, "", "i", epoch=7, fenced=False)
    sent: list[tuple[int | str, Any]] = []
    monkeypatch.setattr(
        sender, "_enqueue", lambda target, request, *_: sent.append((target, request))
    )

    sender.update_metadata([], configs_of=["orders"])
    [delta] = [r for target, r in sent if target == 1]
    assert delta.type == cluster_pb2.UPDATE_METADATA_TYPE_DELTA
    assert {c.topic: dict(c.configs) for c in delta.topic_configs} == {
        "orders": {"retention.ms": "1000"}
    }
    sent.clear()
    sender.update_metadata_full(1)
    [(_, full)] = sent
    assert full.type == cluster_pb2.UPDATE_METADATA_TYPE_FULL
    assert {c.topic: dict(c.configs) for c in full.topic_configs} == {
        "orders": {"retention.ms": "1000"},
        "plain": {},
    }


def test_leader_and_isr_carries_the_elr_committed_with_the_isr(
    sender_to: tuple[TcpProxy, Any, BrokerSender], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader holds the HW while the ELR that comes with its ISR is not empty: LeaderAndIsr
    carries it, as UpdateMetadata does (before, only UpdateMetadata, which brokers do not
    read for it)."""
    _, controller, sender = sender_to
    model = controller.model
    model.topics["orders"] = TopicState("orders", {}, {0: (1, 2, 3)})
    model.partitions[TP] = PartitionRecord(1, 4, (1,), 1, partition_epoch=9, elr=(2, 3))
    for b in (1, 2, 3):
        model.brokers[b] = BrokerState(b, "127.0.0.1", 1, "", "i", epoch=7, fenced=False)
    sent: list[tuple[int | str, Any]] = []
    monkeypatch.setattr(
        sender, "_enqueue", lambda target, request, *_: sent.append((target, request))
    )

    sender.leader_and_isr_changes([PartitionChange(TP, None, model.partitions[TP])])
    leader_and_isr = {
        target: request.partition_states
        for target, request in sent
        if isinstance(request, broker_pb2.LeaderAndIsrRequest)
    }
    assert sorted(leader_and_isr) == [1, 2, 3]
    for [state] in leader_and_isr.values():
        assert (list(state.isr), list(state.eligible_leader_replicas)) == ([1], [2, 3])
    updates = [r for _, r in sent if isinstance(r, cluster_pb2.UpdateMetadataRequest)]
    assert updates
    for update in updates:
        assert list(update.partition_states[0].eligible_leader_replicas) == [2, 3]


async def test_requests_queued_for_a_previous_incarnation_are_dropped_unsent() -> None:
    """Review 20 L1: a broker restarted at another address re-registered while requests for
    its previous life were queued: each was tried against the old address until the RPC
    timeout (10 s), and the new incarnation's state waited behind them. They are dropped now
    (it gets its whole state when unfenced), and their callbacks told."""
    async with TcpProxy(NOWHERE) as old_address:
        controller = stand_in(old_address.address)
        host, port = old_address.address.rsplit(":", 1)
        broker = BrokerState(1, host, int(port), "", "first", epoch=5, fenced=False)
        controller.model.brokers[1] = broker
        sender = BrokerSender(cast(Controller, controller))
        answers: list[bool] = []

        async def answered(ok: bool) -> None:
            answers.append(ok)

        try:
            sender.stop_replica(1, [TP], delete=True, on_answer=answered)
            # It registers again, elsewhere, before the queued request goes out.
            controller.model.brokers[1] = BrokerState(
                1, "127.0.0.1", 1, "", "second", epoch=9, fenced=True
            )
            await eventually(lambda: answers == [False], 5)
            assert sender.requests_sent == 0
        finally:
            workers = list(sender._workers.values())
            sender.reset()
            await asyncio.gather(*workers, return_exceptions=True)


async def test_a_fan_out_still_sending_at_a_step_down_ends() -> None:
    """Review 25 L2: a step-down (reset) cancelled the workers of a LeaderAndIsr fan-out still
    sending: its `leader_and_isr.send` span never ended, and the requests' spans it parents
    pointed at a span no file held."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        async with TcpProxy(NOWHERE) as unreachable:
            controller = stand_in(unreachable.address)
            host, port = unreachable.address.rsplit(":", 1)
            for broker_id in (1, 2):
                controller.model.brokers[broker_id] = BrokerState(
                    broker_id, host, int(port), "", "x", epoch=5, fenced=False
                )
            controller.model.topics["orders"] = TopicState("orders", {}, {0: (1, 2)})
            sender = BrokerSender(cast(Controller, controller))
            sender.leader_and_isr({1, 2}, [TP])
            await asyncio.sleep(0)  # one worker is sending, maybe both, maybe none
            workers = list(sender._workers.values())
            sender.reset()
            await asyncio.gather(*workers, return_exceptions=True)
        [fan_out] = [s for s in exporter.get_finished_spans() if s.name == "leader_and_isr.send"]
        assert fan_out.attributes["tidewater.brokers_failed"] == 2
    finally:
        tracing.shutdown()


async def test_a_request_that_fails_to_build_leaves_the_worker_sending(
    sender_to: tuple[TcpProxy, Any, BrokerSender], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 34 #7: an error other than gRPC's while handling one request ended its target's
    worker, and every later request to that target queued up, unsent, for the rest of the
    controller's term. Logged and dropped now; the next one goes."""
    front, controller, sender = sender_to
    server = await serve_behind(front)
    full_view = sender._full_view
    calls = []

    def failing_once() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("a bug")
        return full_view()

    monkeypatch.setattr(sender, "_full_view", failing_once)
    try:
        sender.refresh_metadata_services()
        await eventually(lambda: len(calls) == 1, 20)
        set_leader_epoch(controller, 5)
        sender.refresh_metadata_services()
        await eventually(lambda: server.full_views[-1:] == [5], 20)
    finally:
        await server.stop(grace_s=0)
