"""The test suite's layout holds: any test directories collect together, in any order.

Every test directory is a package (tests.controller.conftest, not conftest), and what tests
share beyond fixtures is imported from named modules (tests.controller.cluster). A test module
that imports `conftest` or another test module by its bare name gets whichever module of that
name was imported first or last, and a run of several directories then fails at collection."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# Scripts run on their own (python tests/benchmarks/bench_x.py), never collected; and data.
NOT_PACKAGES = {TESTS / "benchmarks", TESTS / "tracereport" / "data"}


def suite_files() -> list[Path]:
    return [
        path
        for path in sorted(TESTS.rglob("*.py"))
        if not any(path.is_relative_to(d) for d in NOT_PACKAGES)
    ]


def bare_imports(path: Path) -> list[str]:
    """The modules `path` imports by a bare name that only sys.path tricks resolve: conftest,
    test_*."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [n for n in names if n.split(".")[0] == "conftest" or n.startswith("test_")]
    return found


def test_no_module_imports_conftest_or_a_test_module_by_bare_name() -> None:
    offenders = {
        str(path.relative_to(ROOT)): names
        for path in suite_files()
        if (names := bare_imports(path))
    }
    assert not offenders, (
        f"{offenders}: import shared helpers from a named module (tests.<dir>.<module>); "
        "fixtures reach tests through conftest.py without an import (README, Testing)"
    )


def test_every_test_directory_is_a_package() -> None:
    directories = {path.parent for path in suite_files()}
    missing = sorted(
        str(d.relative_to(ROOT)) for d in directories if not (d / "__init__.py").exists()
    )
    assert not missing, f"add an __init__.py to {missing}"


def conftest_directories() -> list[str]:
    """The directories below tests/ with a conftest.py (tests/'s own is every run's)."""
    return [
        str(p.parent.relative_to(ROOT))
        for p in suite_files()
        if p.name == "conftest.py" and p.parent != TESTS
    ]


@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_the_directories_with_fixtures_collect_together(order: str) -> None:
    """Given together, pytest imports every directory's conftest.py before it collects any
    test module: the last one imported used to be the `conftest` every test module got."""
    directories = conftest_directories()
    if order == "reversed":
        directories.reverse()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *directories,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # The collection errors, not the list of what was collected.
    _, errors, report = result.stdout.partition("= ERRORS =")
    assert result.returncode == 0, (errors + report or result.stdout[-2000:]) + result.stderr
