"""The README's main command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_round_trip_on_a_local_cluster(tmp_path: Path) -> None:
    data_dir = tmp_path / "demo"
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "tidewater",
                "demo",
                "--records",
                "500",
                "--data-dir",
                str(data_dir),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        # Whatever happened, leave no cluster behind.
        subprocess.run(
            [sys.executable, "-m", "tidewater", "cluster", "down", "--data-dir", str(data_dir)],
            capture_output=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replication factor 3" in result.stdout
    assert "produce-to-ack latency: p50" in result.stdout
    assert "consumed all 500 records back" in result.stdout
    assert "stopped" in result.stdout
    assert "Bootstrap (metadata service): 127.0.0.1:" in result.stdout
    # No hints to reach or stop a cluster the demo stops and deletes itself.
    for hint in ("Running in the background", "Stop:", "Status:"):
        assert hint not in result.stdout
