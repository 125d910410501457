"""The README's main command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_round_trip_on_a_local_cluster(tmp_path: Path) -> None:
    """Twice on one data dir: the second run's cluster holds the first's topic (review 27 L7:
    it failed on TOPIC_ALREADY_EXISTS), and uses another."""
    data_dir = tmp_path / "demo"
    command = [sys.executable, "-m", "tidewater", "demo", "--records", "500"]
    try:
        for run in (1, 2):
            result = subprocess.run(
                [*command, "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=180
            )
            assert result.returncode == 0, result.stdout + result.stderr
            assert f"created topic {'demo' if run == 1 else 'demo-2'}:" in result.stdout
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
