"""What a broker does when a log dir's disk fails (Kafka's LogDirFailureChannel).

Once a write, read, fsync, rename or delete in a log dir fails, what the broker holds in
memory about the logs there may no longer match their files, and a retried fsync can report
success for pages the kernel has already dropped. So the first such error takes the log dir
offline for good, and the broker stops at once, as a Kafka broker in KRaft mode does (it has
no JBOD failover): no flush, no checkpoint, no clean shutdown that would write to the failing
disk. To the cluster that is a crash: the controller fences the broker when its session times
out and moves its leaderships to in-sync replicas; acknowledged data lives on there. On its
next start the broker recovers its logs from the files, as after any crash.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tidewater.errors import StorageError

log = logging.getLogger(__name__)

# Kafka's Exit.halt(1) after a log dir failure.
HALT_EXIT_CODE = 1

OnFailure = Callable[[Path, BaseException], None]

_NOT_THE_DISKS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM}


def halt(log_dir: Path, error: BaseException) -> None:
    """Stop the process now, with no clean shutdown (it would write to the failed disk)."""
    log.critical(
        "stopping the broker: log dir %s failed (%s); its leaderships move to in-sync "
        "replicas; fix or replace the disk and start the broker again",
        log_dir,
        error,
    )
    logging.shutdown()  # the message above must reach the log before the process goes
    os._exit(HALT_EXIT_CODE)


class LogDirFailureChannel:
    """Where every part of a broker reports an I/O error in one of its log dirs."""

    def __init__(self, on_failure: OnFailure = halt) -> None:
        self._on_failure = on_failure
        self.offline: set[Path] = set()

    def failed(self, log_dir: Path, error: BaseException) -> None:
        if log_dir in self.offline:
            return
        self.offline.add(log_dir)
        log.critical("log dir %s failed: %s", log_dir, error)
        self._on_failure(log_dir, error)

    @contextlib.contextmanager
    def guard(self, log_dir: Path) -> Iterator[None]:
        """Report an I/O error raised inside, which goes on as a StorageError."""
        try:
            yield
        except BaseException as e:
            if (failure := self.raised(log_dir, e)) is e:
                raise
            raise failure from e

    def raised(self, log_dir: Path, error: BaseException) -> BaseException:
        """What to raise for `error`: reported, and as a StorageError, if it is the disk's;
        else `error` itself."""
        if (cause := io_failure(error)) is None:
            return error
        self.failed(log_dir, cause)
        if isinstance(error, StorageError):
            return error
        return StorageError(f"log dir {log_dir} failed: {error}")


def guarded(
    channel: LogDirFailureChannel | None, log_dir: Path
) -> contextlib.AbstractContextManager[None]:
    """channel.guard(log_dir), or nothing without a channel (a log on its own, in tests)."""
    return contextlib.nullcontext() if channel is None else channel.guard(log_dir)


def io_failure(error: BaseException) -> OSError | None:
    """The OSError behind `error`, if it is the disk's (raised as is or as a StorageError).
    A timeout's or a connection's (OSErrors too) is not, nor the process's own limits (open
    files, memory): those leave the files as they were."""
    if isinstance(error, StorageError):
        error = error.__cause__
    if (
        isinstance(error, OSError)
        and not isinstance(error, ConnectionError | TimeoutError)
        and error.errno not in _NOT_THE_DISKS
    ):
        return error
    return None


class ReportsIoFailures(Protocol):
    @property
    def dir_failures(self) -> LogDirFailureChannel | None: ...

    @property
    def log_dir(self) -> Path: ...


R = TypeVar("R")


def reports_io_failures(method: Callable[..., R]) -> Callable[..., R]:
    """Decorate a method of an object with `dir_failures` and `log_dir`: an I/O error it
    raises is reported to the channel (when there is one) before it goes on."""

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def checked_async(self: ReportsIoFailures, *args: Any, **kwargs: Any) -> Any:
            try:
                return await method(self, *args, **kwargs)
            except BaseException as e:
                if (failure := _raised(self, e)) is e:
                    raise
                raise failure from e

        return checked_async  # type: ignore[return-value]

    # A try, not `with guarded(...)`: these run several times per record on the data path,
    # and a context manager object per call costs a few us there.
    @functools.wraps(method)
    def checked(self: ReportsIoFailures, *args: Any, **kwargs: Any) -> R:
        try:
            return method(self, *args, **kwargs)
        except BaseException as e:
            if (failure := _raised(self, e)) is e:
                raise
            raise failure from e

    return checked


def _raised(owner: ReportsIoFailures, error: BaseException) -> BaseException:
    channel = owner.dir_failures
    return error if channel is None else channel.raised(owner.log_dir, error)
