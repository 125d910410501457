"""Reading trace files: OTLP/JSON lines, one ExportTraceServiceRequest per line.

Plain `json`, not opentelemetry-proto with google.protobuf.json_format: json_format reads the
bytes fields traceId/spanId as base64, but OTLP/JSON writes them as hex, so ParseDict would turn
every id silently into the wrong bytes (and it costs ~120 µs a span). The report needs a dozen
fields, which are read and checked here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidewater.tracereport import ReportError

AttributeValue = str | int | float | bool | tuple[Any, ...] | None


class TraceFileError(ReportError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Link:
    trace_id: str
    span_id: str
    attributes: Mapping[str, AttributeValue]


@dataclass(frozen=True, slots=True)
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: int  # OTLP SpanKind: 1 INTERNAL, 2 SERVER, 3 CLIENT, 4 PRODUCER, 5 CONSUMER
    start_ns: int
    end_ns: int
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    links: tuple[Link, ...] = ()
    status_code: int = 0  # 0 UNSET, 1 OK, 2 ERROR
    service: str = ""  # the resource's service.name

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True, slots=True)
class TraceFiles:
    spans: list[Span]
    files: list[Path]
    # Lines that are not whole trace lines, left out: cut short, as when a process was killed
    # while writing (and a restart appended after it).
    damaged_lines: int


def trace_file_paths(paths: Iterable[Path]) -> list[Path]:
    """The files named, and every *.jsonl file under the directories named, each once."""
    found: dict[Path, None] = {}
    for path in paths:
        if path.is_dir():
            files = sorted(path.rglob("*.jsonl"))
            if not files:
                raise TraceFileError(f"{path}: no *.jsonl trace files in this directory")
            found.update(dict.fromkeys(p.resolve() for p in files))
        elif path.exists():
            found[path.resolve()] = None
        else:
            raise TraceFileError(f"{path}: no such file or directory")
    return list(found)


def read_trace_files(paths: Iterable[Path]) -> TraceFiles:
    files = trace_file_paths(paths)
    spans: dict[tuple[str, str], Span] = {}
    damaged = 0
    for path in files:
        with path.open("rb") as f:
            lines = f.read().split(b"\n")
        first_error: TraceFileError | None = None
        whole = 0
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                request = json.loads(line)
                batch = list(parse_request(request))
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                # A writer killed mid-line leaves it cut short; one restarted on the same file
                # appends after it (review 25 M6: the whole report failed).
                damaged += 1
                first_error = first_error or TraceFileError(
                    f"{path}:{number}: not an OTLP/JSON trace line: {e}"
                )
                continue
            whole += 1
            for span in batch:
                # The same file given twice, or in a directory and by name, counts once.
                spans.setdefault((span.trace_id, span.span_id), span)
        if first_error is not None and not whole:
            raise first_error  # not a trace file at all
    return TraceFiles(list(spans.values()), files, damaged)


def parse_request(request: Mapping[str, Any]) -> Iterator[Span]:
    """The spans of one ExportTraceServiceRequest."""
    for resource_spans in request["resourceSpans"]:
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", ()))
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                yield _span(span, service)


def _span(span: Mapping[str, Any], service: str) -> Span:
    return Span(
        trace_id=_hex_id(span["traceId"], 32),
        span_id=_hex_id(span["spanId"], 16),
        parent_span_id=_hex_id(span["parentSpanId"], 16) if span.get("parentSpanId") else "",
        name=str(span["name"]),
        kind=int(span.get("kind", 0)),
        start_ns=int(span["startTimeUnixNano"]),
        end_ns=int(span["endTimeUnixNano"]),
        attributes=_attributes(span.get("attributes", ())),
        links=tuple(
            Link(
                _hex_id(link["traceId"], 32),
                _hex_id(link["spanId"], 16),
                _attributes(link.get("attributes", ())),
            )
            for link in span.get("links", ())
        ),
        status_code=int(span.get("status", {}).get("code", 0)),
        service=service,
    )


def _hex_id(value: str, digits: int) -> str:
    if len(value) != digits:
        raise ValueError(f"id {value!r} is not {digits} hex digits")
    bytes.fromhex(value)  # raises ValueError on anything but hex, such as a base64 id
    return value.lower()


def _attributes(pairs: Iterable[Mapping[str, Any]]) -> dict[str, AttributeValue]:
    return {pair["key"]: _value(pair.get("value", {})) for pair in pairs}


def _value(value: Mapping[str, Any]) -> AttributeValue:
    """An OTLP AnyValue; intValue is a decimal string in OTLP/JSON (64-bit)."""
    if "stringValue" in value:
        return str(value["stringValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return tuple(_value(v) for v in value["arrayValue"].get("values", ()))
    return None  # kvlist and bytes values: nothing in the report reads them
