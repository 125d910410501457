"""The code stays ruff clean (pyproject.toml's rules and format), so that CI catches what a
contributor forgot to run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_passes_on_the_sources_and_tests(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "services", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
