"""`--trace-file`'s span exporter: OTLP/JSON lines, one ExportTraceServiceRequest per export,
exactly as opentelemetry-exporter-otlp-json-file's FileSpanExporter writes them (ids in hex,
64-bit integers as strings, empty and default fields left out), but encoded straight from the
SDK's spans into dicts for the C json encoder.

Why not the library's exporter: its encoder builds a dataclass for every span, attribute and
value and then turns each into a dict: about 48 us of CPU for a span of 9 attributes (a leader's
`Produce`), at 100% sampling more than span creation costs. This one takes about 24 us (bare
spans: 10 us, the library 14). tests/telemetry/test_otlp_file.py holds both to the same output.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)

PAUSE_EVERY = 32
# SpanFlags: bit 8 says whether the parent's remoteness is known (always), bit 9 that it is.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200


class OtlpJsonFileSpanExporter(SpanExporter):
    """Appends each export as one line to `path` (the BatchSpanProcessor calls it from its
    worker thread; the lock keeps lines whole should anything else call it too)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open until shutdown
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            line = encode_line(spans, pause=_let_the_loop_run)
            with self._lock:
                if self._file.closed:
                    return SpanExportResult.FAILURE
                self._file.write(line)
                self._file.flush()
        except Exception:  # an exporter must not raise into the SDK
            log.exception("cannot write %d spans", len(spans))
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is flushed as it is written


def _let_the_loop_run() -> None:
    # The batch processor's thread encodes up to 512 spans per export while the process's
    # event loop thread waits for the GIL: each time the loop comes back from a system call
    # it would wait the switch interval (5 ms) for it. A zero sleep hands it over at once.
    time.sleep(0)


def encode_line(spans: Sequence[ReadableSpan], pause: Callable[[], None] | None = None) -> str:
    """One ExportTraceServiceRequest as a line of JSON: spans grouped by resource, then by
    scope. Each span is encoded on its own, `pause` called every PAUSE_EVERY spans, so no
    single step holds the GIL for long."""
    # Keyed by identity: a Resource hashes by JSON-encoding its attributes, per span.
    grouped: dict[int, tuple[Resource, dict[Any, list[str]]]] = {}
    for done, span in enumerate(spans, 1):
        _, scopes = grouped.setdefault(id(span.resource), (span.resource, {}))
        scopes.setdefault(span.instrumentation_scope, []).append(_json(_span(span)))
        if pause is not None and done % PAUSE_EVERY == 0:
            pause()
    resource_spans = []
    for resource, scopes in grouped.values():
        scope_spans = []
        for scope, encoded in scopes.items():
            entry: dict[str, Any] = {"scope": _scope(scope)}
            if scope is not None and scope.schema_url:
                entry["schemaUrl"] = scope.schema_url
            scope_spans.append(_with_array(entry, "spans", encoded))
        resource_entry: dict[str, Any] = {"resource": _attributes_entry(resource.attributes)}
        if resource.schema_url:
            resource_entry["schemaUrl"] = resource.schema_url
        resource_spans.append(_with_array(resource_entry, "scopeSpans", scope_spans))
    return _with_array({}, "resourceSpans", resource_spans) + "\n"


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _with_array(fields: dict[str, Any], key: str, encoded: list[str]) -> str:
    """The JSON object of `fields` and `key`, whose value is the array of the JSON texts
    `encoded`."""
    head = _json(fields)[:-1]
    comma = "," if len(head) > 1 else ""
    return f'{head}{comma}"{key}":[{",".join(encoded)}]}}'


def _span(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    parent = span.parent
    out: dict[str, Any] = {}
    if context is not None:
        if context.trace_id:
            out["traceId"] = f"{context.trace_id:032x}"
        if context.span_id:
            out["spanId"] = f"{context.span_id:016x}"
        _trace_state(out, context)
    if parent is not None and parent.span_id:
        out["parentSpanId"] = f"{parent.span_id:016x}"
    out["flags"] = _flags(parent)
    if span.name:
        out["name"] = span.name
    out["kind"] = span.kind.value + 1  # the API's INTERNAL is 0, OTLP's is 1
    if span.start_time:
        out["startTimeUnixNano"] = str(span.start_time)
    if span.end_time:
        out["endTimeUnixNano"] = str(span.end_time)
    if span.attributes:
        out["attributes"] = _attributes(span.attributes)
    if span.dropped_attributes:
        out["droppedAttributesCount"] = span.dropped_attributes
    if span.events:
        out["events"] = [_event(e) for e in span.events]
    if span.dropped_events:
        out["droppedEventsCount"] = span.dropped_events
    if span.links:
        out["links"] = [_link(link) for link in span.links]
    if span.dropped_links:
        out["droppedLinksCount"] = span.dropped_links
    status = span.status
    out["status"] = {}
    if status.description:
        out["status"]["message"] = status.description
    if status.status_code.value:
        out["status"]["code"] = status.status_code.value
    return out


def _trace_state(out: dict[str, Any], context: SpanContext) -> None:
    if context.trace_state:
        out["traceState"] = ",".join(f"{k}={v}" for k, v in context.trace_state.items())


def _flags(parent: SpanContext | None) -> int:
    remote = parent is not None and parent.is_remote
    return _HAS_IS_REMOTE | _IS_REMOTE if remote else _HAS_IS_REMOTE


def _event(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if event.timestamp:
        out["timeUnixNano"] = str(event.timestamp)
    if event.name:
        out["name"] = event.name
    if event.attributes:
        out["attributes"] = _attributes(event.attributes)
    if event.dropped_attributes:
        out["droppedAttributesCount"] = event.dropped_attributes
    return out


def _link(link: Any) -> dict[str, Any]:
    context = link.context
    out: dict[str, Any] = {}
    if context.trace_id:
        out["traceId"] = f"{context.trace_id:032x}"
    if context.span_id:
        out["spanId"] = f"{context.span_id:016x}"
    if link.attributes:
        out["attributes"] = _attributes(link.attributes)
    if link.dropped_attributes:
        out["droppedAttributesCount"] = link.dropped_attributes
    out["flags"] = _flags(context)
    return out


def _scope(scope: Any) -> dict[str, Any]:
    if scope is None:
        return {}
    out: dict[str, Any] = {}
    if scope.name:
        out["name"] = scope.name
    if scope.version:
        out["version"] = scope.version
    if scope.attributes:
        out["attributes"] = _attributes(scope.attributes)
    return out


def _attributes_entry(attributes: Attributes) -> dict[str, Any]:
    return {"attributes": _attributes(attributes)} if attributes else {}


def _attributes(attributes: Attributes) -> list[dict[str, Any]]:
    # copy(): a plain dict of the SDK's BoundedAttributes (or of the proxy around them),
    # whose own items() go key by key through Python.
    plain = attributes.copy() if attributes else {}  # type: ignore[attr-defined]
    return [{"key": k, "value": _value(v)} for k, v in plain.items()]


def _value(value: Any) -> dict[str, Any]:
    kind = type(value)
    if kind is str:
        return {"stringValue": value}
    if kind is int:
        return {"intValue": str(value)}
    # bool before int: a bool is an int.
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": _double(value)}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode()}
    if isinstance(value, Mapping):
        values = [{"key": str(k), "value": _value(v)} for k, v in value.items()]
        return {"kvlistValue": {"values": values} if values else {}}
    if isinstance(value, Sequence):
        values = [_value(v) for v in value]
        return {"arrayValue": {"values": values} if values else {}}
    if value is None:
        return {}
    raise TypeError(f"attribute value of type {type(value).__name__}: {value!r}")


def _double(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value
