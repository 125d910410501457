"""`tidewater` run as a user would, and what a local cluster's file says it started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

COMMAND_TIMEOUT_S = 180


def tidewater(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tidewater", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )


def recorded_pids(data_dir: Path) -> set[int]:
    """Every pid the cluster file has named (the supervisor's too)."""
    try:
        document = json.loads((data_dir / "cluster.json").read_text())
    except FileNotFoundError:
        return set()
    return {document["supervisor_pid"], *(p["pid"] for p in document["processes"])}


def kill_recorded(data_dir: Path) -> None:
    for pid in recorded_pids(data_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
