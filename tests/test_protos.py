"""The wire contract stays documented: client authors in other languages read the .proto files,
so every service, rpc, message, enum and ErrorCode value carries a comment."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import NamedTuple

import pytest

from tidewater.client.errors import error_for
from tidewater.devtools.protogen import PROTO_ROOT, proto_files
from tidewater.errors import RETRIABLE, TidewaterError
from tidewater.v1.errors_pb2 import ErrorCode

DECLARATION = re.compile(r"^\s*(service|rpc|message|enum)\s+(\w+)")
ENUM_VALUE = re.compile(r"^\s*([A-Z][A-Z0-9_]*)\s*=\s*-?\d+\s*;")
ERRORS_PROTO = PROTO_ROOT / "tidewater" / "v1" / "errors.proto"


class Declaration(NamedTuple):
    file: str
    kind: str
    name: str
    documented: bool


def has_leading_comment(lines: list[str], index: int) -> bool:
    return index > 0 and lines[index - 1].strip().startswith("//")


def declarations(path: Path) -> list[Declaration]:
    lines = path.read_text().splitlines()
    return [
        Declaration(path.name, match[1], match[2], has_leading_comment(lines, i))
        for i, line in enumerate(lines)
        if (match := DECLARATION.match(line))
    ]


def all_declarations() -> list[Declaration]:
    return [d for path in proto_files() for d in declarations(path)]


def described_names(path: Path) -> set[tuple[str, str]]:
    """What protoc compiled from the file: the parse above must see exactly this."""
    module = importlib.import_module(f"tidewater.v1.{path.stem}_pb2")
    file = module.DESCRIPTOR
    names = {("message", name) for name in file.message_types_by_name}
    names |= {("enum", name) for name in file.enum_types_by_name}
    for service in file.services_by_name.values():
        names.add(("service", service.name))
        names |= {("rpc", method.name) for method in service.methods}
    return names


@pytest.mark.parametrize("path", proto_files(), ids=lambda p: p.name)
def test_parse_sees_every_declaration(path: Path) -> None:
    assert {(d.kind, d.name) for d in declarations(path)} == described_names(path)


def test_every_declaration_has_a_leading_comment() -> None:
    undocumented = [f"{d.file}: {d.kind} {d.name}" for d in all_declarations() if not d.documented]
    assert not undocumented, "add a comment saying what it means and when errors are returned"


def test_every_error_code_has_a_comment() -> None:
    lines = ERRORS_PROTO.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("enum ErrorCode"))
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "}")
    values = {
        match[1]: has_leading_comment(lines, i)
        for i in range(start + 1, end)
        if (match := ENUM_VALUE.match(lines[i]))
    }
    assert set(values) == set(ErrorCode.keys())
    assert [name for name, documented in values.items() if not documented] == []


def test_readme_explains_every_error_code() -> None:
    """protos/README.md has one row per ErrorCode, with its number, in its retry table."""
    readme = (PROTO_ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `([A-Z_]+)` \| (\d+) \|", readme, flags=re.MULTILINE)
    assert sorted(rows, key=lambda row: int(row[1])) == [
        (name, str(number)) for name, number in sorted(ErrorCode.items(), key=lambda kv: kv[1])
    ]


def test_the_retriable_codes_are_the_readmes() -> None:
    """Review 32 #11: the SDK's set and the README's retry column disagreed on ten codes."""
    readme = (PROTO_ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `([A-Z_]+)` \| \d+ \|[^|]*\| ([^|]*) \|", readme, flags=re.MULTILINE)
    assert rows
    yes = {ErrorCode.Value(name) for name, retriable in rows if retriable.strip().startswith("yes")}
    assert yes == RETRIABLE


def test_every_error_code_has_its_exception_class() -> None:
    """What a client catches by name (`except TopicAlreadyExists`), as Kafka's exceptions;
    review 32 #11: ten codes came as the base class."""
    for name, code in ErrorCode.items():
        if code in (ErrorCode.NONE, ErrorCode.UNKNOWN_SERVER_ERROR):
            continue
        error = error_for(code, "a test")
        assert type(error) is not TidewaterError, name
        assert (error.code, error.retriable) == (code, code in RETRIABLE)
