"""Fixtures of the local cluster tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.local.cluster_cli import kill_recorded


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """The cluster's data dir; whatever it runs is killed at teardown, even after a failure."""
    data_dir = tmp_path / "cluster"
    yield data_dir
    kill_recorded(data_dir)
