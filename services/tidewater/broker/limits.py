"""The open-file limit a broker runs with.

The active segment of a partition being written holds its log and its two index files open,
so a broker writing 1,000 partitions needs over 3,000 descriptors, while many systems start
processes with a soft limit of 1,024 (Kafka's operations guide asks for 100,000 or more).
The soft limit may be raised up to the hard one without privileges."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)
        return soft
    return hard
