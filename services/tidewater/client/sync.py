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
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from tidewater.client import admin, consumer, producer
from tidewater.client.accumulator import RecordMetadata

T = TypeVar("T")


class _Blocking:
    """Forwards attribute access to an asyncio client living on a private loop thread."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._inner = self._run(_construct(make))

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if inspect.iscoroutinefunction(attribute):
            return lambda *args, **kwargs: self._run(attribute(*args, **kwargs))
        return attribute

    def close(self) -> None:
        try:
            self._run(self._inner.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()  # its selector's file descriptors

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _construct(make: Callable[[], T]) -> T:
    """Clients create their asyncio objects on their own loop."""
    return make()


class Producer(_Blocking):
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
    def __init__(self, bootstrap: list[str], **config: Any) -> None:
        super().__init__(lambda: consumer.Consumer(bootstrap, **config))


class Admin(_Blocking):
    def __init__(self, controllers: list[str], bootstrap: list[str] | None = None) -> None:
        super().__init__(lambda: admin.Admin(controllers, bootstrap or []))
