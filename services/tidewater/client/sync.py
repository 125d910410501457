"""The blocking facade: the asyncio clients, driven from plain threads.

Each facade runs its client on an event loop in a daemon thread of its own; every coroutine
method becomes a blocking call, and Producer.send returns a concurrent.futures.Future.

    with Producer(["127.0.0.1:9094"]) as producer:
        producer.send("orders", b"hello").result()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from tidewater.client import admin, consumer, producer
from tidewater.client.accumulator import RecordMetadata
from tidewater.client.consumer import ConsumerRecord
from tidewater.client.errors import ClientError, ConsumerClosed, ProducerClosed

T = TypeVar("T")


class _Blocking:
    """Forwards attribute access to an asyncio client living on a private loop thread: its
    methods, coroutine or not, run there (a method run on the caller's thread raced the
    loop's tasks over the client's state: review 26 L1)."""

    _closed_error: type[ClientError] = ClientError

    def __init__(self, make: Callable[[], Any]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        try:
            self._inner = self._run(_construct(make))
        except BaseException:
            self._stop()  # an invalid config left the thread running
            raise

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coroutine.close()
            raise self._closed_error(f"the {type(self).__name__.lower()} is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if inspect.iscoroutinefunction(attribute):
            return lambda *args, **kwargs: self._run(attribute(*args, **kwargs))
        if callable(attribute):
            return lambda *args, **kwargs: self._run(_call(attribute, *args, **kwargs))
        return attribute

    def close(self) -> None:
        """Close the client; calls other threads wait in (a poll) end with its closed error
        (review 26 M2: the loop stopped under them, and they waited for good). Again: nothing."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._inner.close())
            self._run(_others_done())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()  # its selector's file descriptors

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _call(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return function(*args, **kwargs)


async def _others_done() -> None:
    """Wait (a while) for the calls still running on the loop: the client's close() has made
    them end."""
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    if others:
        await asyncio.wait(others, timeout=5)


async def _construct(make: Callable[[], T]) -> T:
    """Clients create their asyncio objects on their own loop."""
    return make()


class Producer(_Blocking):
    _closed_error = ProducerClosed

    def __init__(self, bootstrap: list[str], **config: Any) -> None:
        super().__init__(lambda: producer.Producer(bootstrap, **config))

    def send(
        self, topic: str, value: bytes | None, **kwargs: Any
    ) -> concurrent.futures.Future[RecordMetadata]:
        """Queue a record; the future resolves when the cluster acknowledges it."""
        delivered = self._run(self._inner.send(topic, value, **kwargs))
        return asyncio.run_coroutine_threadsafe(_await(delivered), self._loop)


async def _await(future: Awaitable[T]) -> T:
    return await future


class Consumer(_Blocking):
    _closed_error = ConsumerClosed

    def __init__(self, bootstrap: list[str], **config: Any) -> None:
        super().__init__(lambda: consumer.Consumer(bootstrap, **config))

    def __iter__(self) -> Iterator[ConsumerRecord]:
        """Records as they come, for good (the async client's `async for`)."""
        while True:
            yield from self.poll(self._inner.fetch_max_wait_ms)


class Admin(_Blocking):
    def __init__(self, controllers: list[str], bootstrap: list[str] | None = None) -> None:
        super().__init__(lambda: admin.Admin(controllers, bootstrap or []))
