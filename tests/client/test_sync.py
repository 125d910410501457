"""The blocking facade, used from a plain thread as a script would."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from tests.client.cluster import Cluster
from tidewater.client.errors import ConsumerClosed
from tidewater.client.sync import Consumer, Producer
from tidewater.errors import InvalidConfig


async def test_blocking_producer_and_consumer_round_trip(cluster: Cluster) -> None:
    await cluster.create_topic("blocking")

    def script() -> tuple[list[int], list[bytes]]:
        with Producer(cluster.bootstrap, linger_ms=1) as producer:
            futures = [producer.send("blocking", f"b{i}".encode(), partition=0) for i in range(50)]
            offsets = [f.result(10).offset for f in futures]
        values: list[bytes] = []
        with Consumer(cluster.bootstrap, auto_offset_reset="earliest") as consumer:
            consumer.assign([("blocking", 0)])
            for _ in range(50):
                values += [r.value for r in consumer.poll(200)]
                if len(values) >= 50:
                    break
        return offsets, values

    # In a thread: the in-process brokers run on this test's event loop.
    offsets, values = await asyncio.to_thread(script)
    assert offsets == list(range(50))
    assert values == [f"b{i}".encode() for i in range(50)]


async def test_the_first_blocking_poll_after_assign_waits_for_the_records(cluster: Cluster) -> None:
    await cluster.create_topic("first")

    def script() -> list[bytes | None]:
        with Producer(cluster.bootstrap) as producer:
            producer.send("first", b"x", partition=0).result(10)
        with Consumer(cluster.bootstrap, auto_offset_reset="earliest") as consumer:
            consumer.assign([("first", 0)])
            # One poll: the first after assign() waits for the records up to its timeout.
            return [r.value for r in consumer.poll(20_000)]

    async with asyncio.timeout(60):
        assert await asyncio.to_thread(script) == [b"x"]


def test_a_closed_facade_leaves_no_file_descriptor_open() -> None:
    """Review 18 L3: close() stopped the facade's loop but never closed it, leaving its
    selector's descriptors open: a script making one a request ran out of them."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        Consumer(["127.0.0.1:1"]).close()
    assert len(os.listdir("/proc/self/fd")) <= before + 2


async def test_a_blocking_poll_in_another_thread_ends_when_the_consumer_closes(
    cluster: Cluster,
) -> None:
    """Review 26 M2: close() stopped the loop under a poll another thread was in, which then
    waited for good. It ends with ConsumerClosed; so does any call after close(), and a
    second close() does nothing."""

    def run() -> tuple[bool, BaseException | None]:
        consumer = Consumer(cluster.bootstrap, auto_offset_reset="earliest")
        consumer.assign([("nosuchtopic", 0)])
        raised: list[BaseException] = []
        polling = threading.Event()
        inner = consumer._inner
        send_requests = inner._send_requests

        def marked() -> None:  # the poll is under way on the facade's loop
            polling.set()
            send_requests()

        inner._send_requests = marked  # type: ignore[method-assign]

        def poll() -> None:
            try:
                consumer.poll(5000)
            except BaseException as e:
                raised.append(e)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        assert polling.wait(10)
        consumer.close()
        poller.join(10)
        consumer.close()
        with pytest.raises(ConsumerClosed):
            consumer.poll(100)
        return poller.is_alive(), raised[0] if raised else None

    alive, raised = await asyncio.to_thread(run)
    assert not alive
    assert isinstance(raised, ConsumerClosed), raised


def test_a_facade_whose_client_refuses_its_config_leaves_no_thread() -> None:
    before = threading.active_count()
    for _ in range(3):
        with pytest.raises(InvalidConfig):
            Consumer(["127.0.0.1:1"], auto_offset_reset="sometimes")
    assert threading.active_count() == before
