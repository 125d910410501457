"""The type of the `logged` fixture (conftest.py): logged(level, *words), whether a record at
`level` whose message holds every word was logged with its exception."""

from __future__ import annotations

from collections.abc import Callable

Logged = Callable[..., bool]
