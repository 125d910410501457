"""Kafka's topic naming rules, shared by every service that accepts a topic name."""

from __future__ import annotations

import re

from tidewater.errors import InvalidTopic

MAX_TOPIC_LENGTH = 249
_LEGAL = re.compile(r"[a-zA-Z0-9._-]+")


def validate_topic_name(name: str) -> None:
    """Raise InvalidTopic unless `name` is 1-249 characters of [a-zA-Z0-9._-], not "." or ".."."""
    if not name:
        raise InvalidTopic("topic name is empty")
    if name in (".", ".."):
        raise InvalidTopic(f"topic name cannot be {name!r}")
    if len(name) > MAX_TOPIC_LENGTH:
        raise InvalidTopic(f"topic name is {len(name)} characters, the limit is {MAX_TOPIC_LENGTH}")
    if not _LEGAL.fullmatch(name):
        raise InvalidTopic(f"topic name {name!r} has characters outside [a-zA-Z0-9._-]")
