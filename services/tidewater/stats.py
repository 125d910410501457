"""Latency statistics shared by the benchmarks, the demo and the trace report."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T", int, float)


def percentile(sorted_values: Sequence[T], q: float) -> T:
    """Nearest-rank percentile of ascending values: always a value that was observed."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]
