"""The generated code is current, the distribution ships every package, and the README's
Layout names each one."""

from __future__ import annotations

import filecmp
import re
import tomllib
from pathlib import Path

from tidewater.devtools.protogen import REPO_ROOT, generate

GEN = REPO_ROOT / "gen"


def test_generated_code_is_current(tmp_path: Path) -> None:
    fresh = {p.name: p for p in generate(tmp_path)}
    checked_in = {p.name: p for p in (GEN / "tidewater" / "v1").iterdir() if p.is_file()}
    hint = "gen/ is stale: run python -m tidewater.devtools.protogen"
    assert sorted(checked_in) == sorted(fresh), hint
    stale = [n for n, p in fresh.items() if not filecmp.cmp(p, checked_in[n], shallow=False)]
    assert not stale, f"{hint} ({stale})"


def test_every_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(REPO_ROOT / "services").parts)
        for init in (REPO_ROOT / "services").rglob("__init__.py")
    }
    assert on_disk | {"tidewater.v1"} == listed


def test_readme_layout_names_every_package_and_module() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    layout = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    package = REPO_ROOT / "services" / "tidewater"
    entries = {
        f"{p.name}/" if p.is_dir() else p.name
        for p in package.iterdir()
        if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())
    }
    named = set(re.findall(r"[\w.]+/?", layout))
    assert sorted(entries - named) == []
