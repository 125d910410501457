"""`--trace-file`'s span exporter: OTLP/JSON lines, one ExportTraceServiceRequest per export,
exactly as opentelemetry-exporter-otlp-json-file's FileSpanExporter writes them (ids in hex,
64-bit integers as strings, empty and default fields left out), but encoded straight from the
SDK's spans into JSON text, every string through json.dumps.

Why not the library's exporter: its encoder builds a dataclass for every span, attribute and
value and then turns each into a dict for the json encoder: about 50 us of CPU for a span of 9
attributes (a leader's `Produce`), at 100% sampling more than creating the span costs. This
one takes about 6 us (a span without attributes: under 4 us, the library 34), best of 7
timeit runs here; tests/benchmarks/bench_span_cost.py measures it per producer batch.
tests/telemetry/test_otlp_file.py holds both to the same output.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.environment_variables import (
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
    OTEL_BSP_MAX_QUEUE_SIZE,
    OTEL_BSP_SCHEDULE_DELAY,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceState
from opentelemetry.trace.span import DEFAULT_TRACE_STATE
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)

PAUSE_EVERY = 32
# The batch span processor's defaults.
DEFAULT_SCHEDULE_DELAY_MS = 5000
DEFAULT_MAX_EXPORT_BATCH_SIZE = 512
DEFAULT_MAX_QUEUE_SIZE = 2048
# SpanFlags: bit 8 says whether the parent's remoteness is known (always), bit 9 that it is.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
UNSET = Status(StatusCode.UNSET)


def _ends_mid_line(path: str | os.PathLike[str]) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


class OtlpJsonFileSpanExporter(SpanExporter):
    """Appends each export as one line to `path` (the BatchSpanProcessor calls it from its
    worker thread; the lock keeps lines whole should anything else call it too)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open until shutdown
        self._lock = threading.Lock()
        if _ends_mid_line(path):
            # A process killed mid-write left a cut line: ours start on a line of their own
            # (review 25 M6: the first was glued to it, and both were lost).
            self._file.write("\n")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            line = encode_line(spans, pause=_let_the_loop_run)
        except Exception:  # an exporter must not raise into the SDK
            log.exception("cannot encode %d spans", len(spans))
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS if self.write(line) else SpanExportResult.FAILURE

    def write(self, line: str) -> bool:
        """Append an encoded line; False when the file is closed or the write failed."""
        try:
            with self._lock:
                if self._file.closed:
                    return False
                self._file.write(line)
                self._file.flush()
        except OSError:
            log.exception("cannot write to the trace file")
            return False
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is flushed as it is written


class OtlpJsonFileSpanProcessor(SpanProcessor):
    """`--trace-file`'s span processor: what a BatchSpanProcessor around the exporter writes,
    for less CPU. Each sampled span is encoded as it ends, on the thread that ends it, and
    lines of up to OTEL_BSP_MAX_EXPORT_BATCH_SIZE spans (512) are appended by a thread of its
    own, at the latest OTEL_BSP_SCHEDULE_DELAY ms (5000) after their first span. As with the
    batch processor, at most OTEL_BSP_MAX_QUEUE_SIZE spans (2048) wait for the writer: when the
    disk falls behind, further lines are dropped (and counted in `dropped_spans`), never held
    in memory without bound.

    Why not the batch processor: it keeps every span until the export, long enough for the
    garbage collector to move the spans' objects into its oldest generation, whose full
    collections then cost the broker more than encoding them; and its thread encodes while
    the event loop waits for the GIL. Encoded, a span is a string the collector never looks
    at, and the span itself is freed at once."""

    def __init__(
        self,
        exporter: OtlpJsonFileSpanExporter,
        schedule_delay_millis: float | None = None,
        max_export_batch_size: int | None = None,
        max_queue_size: int | None = None,
    ) -> None:
        self._exporter = exporter
        self._delay_s = (
            schedule_delay_millis or _env_int(OTEL_BSP_SCHEDULE_DELAY, DEFAULT_SCHEDULE_DELAY_MS)
        ) / 1000
        self._max_spans = max_export_batch_size or _env_int(
            OTEL_BSP_MAX_EXPORT_BATCH_SIZE, DEFAULT_MAX_EXPORT_BATCH_SIZE
        )
        max_queue = max_queue_size or _env_int(OTEL_BSP_MAX_QUEUE_SIZE, DEFAULT_MAX_QUEUE_SIZE)
        self._lock = threading.Lock()
        self._pending = EncodedSpans()
        self._lines: queue.Queue[str | None] = queue.Queue(max(1, max_queue // self._max_spans))
        self.dropped_spans = 0
        self._writer = threading.Thread(
            target=self._write_lines, name="OtlpJsonFileSpanWriter", daemon=True
        )
        self._writer.start()
        self._shut = False

    def on_end(self, span: ReadableSpan) -> None:
        if self._shut or span.context is None or not span.context.trace_flags.sampled:
            return
        try:
            encoded = encode_span(span)
        except Exception:  # a processor must not raise into the SDK
            log.exception("cannot encode span %s", span.name)
            return
        self.add(span.resource, span.instrumentation_scope, encoded)

    def add(self, resource: Resource, scope: InstrumentationScope | None, encoded: str) -> None:
        """A sampled span encoded by its maker (encode_fields): Tidewater's own finished
        spans come here without being made ReadableSpans (tracing.record_child)."""
        if self._shut:
            return
        with self._lock:
            self._pending.add(resource, scope, encoded)
            if self._pending.count < self._max_spans:
                return
            line = self._pending.take()
        try:
            self._lines.put_nowait(line)
        except queue.Full:
            if not self.dropped_spans:
                log.warning("the trace file falls behind: dropping spans")
            self.dropped_spans += self._max_spans

    def _take(self) -> str:
        with self._lock:
            return self._pending.take()

    def _write_lines(self) -> None:
        while True:
            try:
                line = self._lines.get(timeout=self._delay_s)
            except queue.Empty:
                line = self._take()
            if line is None:
                return
            if line:
                self._exporter.write(line)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Write what is encoded so far (from this thread, alongside the writer's)."""
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            if line is None:  # shut down
                self._lines.put(None)
                return False
            self._exporter.write(line)
        line = self._take()
        return self._exporter.write(line) if line else True

    def shutdown(self) -> None:
        self._shut = True
        self._lines.put(None)
        self._writer.join()
        self.force_flush()
        self._exporter.shutdown()


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        log.warning("%s is not an integer: using %d", name, default)
        return default


def _let_the_loop_run() -> None:
    # The batch processor's thread encodes up to 512 spans per export while the process's
    # event loop thread waits for the GIL: each time the loop comes back from a system call
    # it would wait the switch interval (5 ms) for it. A zero sleep hands it over at once.
    time.sleep(0)


def encode_line(spans: Sequence[ReadableSpan], pause: Callable[[], None] | None = None) -> str:
    """One ExportTraceServiceRequest as a line of JSON: spans grouped by resource, then by
    scope. Each span is encoded on its own, `pause` called every PAUSE_EVERY spans, so no
    single step holds the GIL for long."""
    lines = EncodedSpans()
    for done, span in enumerate(spans, 1):
        lines.add(span.resource, span.instrumentation_scope, encode_span(span))
        if pause is not None and done % PAUSE_EVERY == 0:
            pause()
    return lines.take()


# No span's resource and scope (None is a scope).
_NO_GROUP: tuple[object, object, list[str]] = (object(), object(), [])


class EncodedSpans:
    """Spans encoded one by one, grouped by resource and then by scope, until taken as one
    ExportTraceServiceRequest line."""

    def __init__(self) -> None:
        # Keyed by identity: a Resource hashes by JSON-encoding its attributes, per span.
        self._grouped: dict[int, tuple[Resource, dict[Any, list[str]]]] = {}
        # The last span's resource, scope and their list: a process's spans mostly share
        # them, and a scope hashes through Python (with the lookups, 0.4 us per span).
        self._last: tuple[object, object, list[str]] = _NO_GROUP
        self.count = 0

    def add(self, resource: Resource, scope: InstrumentationScope | None, encoded: str) -> None:
        last_resource, last_scope, spans = self._last
        if resource is not last_resource or scope is not last_scope:
            _, scopes = self._grouped.setdefault(id(resource), (resource, {}))
            spans = scopes.setdefault(scope, [])
            self._last = (resource, scope, spans)
        spans.append(encoded)
        self.count += 1

    def take(self) -> str:
        """The line of the spans added so far ("" for none); starts over empty."""
        if not self.count:
            return ""
        resource_spans = []
        for resource, scopes in self._grouped.values():
            scope_spans = [
                _object(
                    [
                        f'"scope":{_scope(scope)}',
                        f'"spans":[{",".join(encoded)}]',
                        *_schema_url(scope.schema_url if scope is not None else None),
                    ]
                )
                for scope, encoded in scopes.items()
            ]
            entry = _object(_attributes_field(resource.attributes))
            resource_spans.append(
                _object(
                    [
                        f'"resource":{entry}',
                        f'"scopeSpans":[{",".join(scope_spans)}]',
                        *_schema_url(resource.schema_url),
                    ]
                )
            )
        self._grouped = {}
        self._last = _NO_GROUP
        self.count = 0
        return f'{{"resourceSpans":[{",".join(resource_spans)}]}}\n'


# The encoding below writes JSON text directly, every string through json.dumps: a span's
# attributes repeat from span to span (topic, partition, operation), and their encoded text is
# looked up rather than rebuilt as dicts for the json encoder to walk (half of the cost).


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _object(fields: Sequence[str]) -> str:
    return f"{{{','.join(fields)}}}"


def _schema_url(url: str | None) -> list[str]:
    return [f'"schemaUrl":{_json(url)}'] if url else []


def encode_span(span: ReadableSpan) -> str:
    """A span's OTLP/JSON object (encode_fields), each of its properties read once: they are
    Python calls, the dropped counts isinstance checks against ABCs (which Tidewater's own
    spans answer without: tracing.PlainSpan)."""
    context = span.get_span_context()
    if context is None:
        trace_id, span_id, state = 0, 0, None
    else:
        trace_id, span_id, state = context.trace_id, context.span_id, context.trace_state
    return encode_fields(
        trace_id,
        span_id,
        state,
        span.parent,
        span.name,
        span.kind,
        span.start_time,
        span.end_time,
        span.attributes,
        span.events,
        span.links,
        span.status,
        (span.dropped_attributes, span.dropped_events, span.dropped_links),
    )


def encode_fields(
    trace_id: int,
    span_id: int,
    trace_state: TraceState | None,
    parent: SpanContext | None,
    name: str,
    kind: SpanKind,
    start: int | None,
    end: int | None,
    attributes: Attributes,
    events: Sequence[Event] = (),
    links: Sequence[Link] = (),
    status: Status = UNSET,
    dropped: tuple[int, int, int] = (0, 0, 0),
) -> str:
    """A span's OTLP/JSON object from its fields (`dropped`: attributes, events, links):
    one string built field by field, names, kinds and attributes looked up encoded. A
    finished span of Tidewater's own comes here without being made a ReadableSpan."""
    if trace_id and span_id:
        # bytes.hex(): an int's format spec ("032x") takes twice as long.
        text = (
            f'{{"traceId":"{trace_id.to_bytes(16).hex()}","spanId":"{span_id.to_bytes(8).hex()}",'
        )
    else:
        text = "{" + "".join(f"{field}," for field in _ids(trace_id, span_id))
    # Most spans have the API's one empty state: known without TraceState's Python __len__.
    if trace_state is not DEFAULT_TRACE_STATE and trace_state:
        state = ",".join(f"{k}={v}" for k, v in trace_state.items())
        text += f'"traceState":{_json(state)},'
    if parent is not None and parent.span_id:
        text += f'"parentSpanId":"{parent.span_id.to_bytes(8).hex()}",'
        flags = _HAS_IS_REMOTE | _IS_REMOTE if parent.is_remote else _HAS_IS_REMOTE
    else:
        flags = _flags(parent)
    if name:
        text += f'"name":{_name(name)},'
    if start:
        text += f'"startTimeUnixNano":"{start}",'
    if end:
        text += f'"endTimeUnixNano":"{end}",'
    text += f'"flags":{flags},"kind":{_KINDS[id(kind)]}'
    if attributes:
        text += f",{_attributes_text(attributes)}"
    dropped_attributes, dropped_events, dropped_links = dropped
    if dropped_attributes:
        text += f',"droppedAttributesCount":{dropped_attributes}'
    if events:
        text += f',"events":[{",".join([_event(e) for e in events])}]'
    if dropped_events:
        text += f',"droppedEventsCount":{dropped_events}'
    if links:
        text += f',"links":[{",".join([_link(link) for link in links])}]'
    if dropped_links:
        text += f',"droppedLinksCount":{dropped_links}'
    # UNSET, Tidewater's spans' status unless they failed, spares two property reads (0.7 us).
    if status is not UNSET and (status.description or status.status_code is not StatusCode.UNSET):
        return f'{text},"status":{_json(_status(status))}}}'
    return text + ',"status":{}}'


# The API's INTERNAL is 0, OTLP's is 1. Keyed by identity (the members are singletons): an
# Enum hashes through a Python method, 0.4 us per span.
_KINDS = {id(kind): str(kind.value + 1) for kind in SpanKind}


def _ids(trace_id: int, span_id: int) -> list[str]:
    ids = []
    if trace_id:
        ids.append(f'"traceId":"{trace_id.to_bytes(16).hex()}"')
    if span_id:
        ids.append(f'"spanId":"{span_id.to_bytes(8).hex()}"')
    return ids


def _status(status: Status) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if status.description:
        out["message"] = status.description
    if status.status_code.value:
        out["code"] = status.status_code.value
    return out


def _flags(parent: SpanContext | None) -> int:
    remote = parent is not None and parent.is_remote
    return _HAS_IS_REMOTE | _IS_REMOTE if remote else _HAS_IS_REMOTE


def _event(event: Event) -> str:
    fields = []
    if event.timestamp:
        fields.append(f'"timeUnixNano":"{event.timestamp}"')
    if event.name:
        fields.append(f'"name":{_json(event.name)}')
    fields += _attributes_field(event.attributes, event.dropped_attributes)
    return _object(fields)


def _link(link: Link) -> str:
    context = link.context
    fields = _ids(context.trace_id, context.span_id)
    attributes = link.attributes
    if attributes:
        fields.append(_attributes_text(attributes))
    # Tidewater's links have plain dicts, whose dropped count (an isinstance check) is 0.
    if type(attributes) is not dict and link.dropped_attributes:
        fields.append(f'"droppedAttributesCount":{link.dropped_attributes}')
    fields.append(f'"flags":{_flags(context)}')
    return _object(fields)


def _scope(scope: InstrumentationScope | None) -> str:
    if scope is None:
        return "{}"
    fields = []
    if scope.name:
        fields.append(f'"name":{_json(scope.name)}')
    if scope.version:
        fields.append(f'"version":{_json(scope.version)}')
    fields += _attributes_field(scope.attributes)
    return _object(fields)


def _attributes_field(attributes: Attributes, dropped: int = 0) -> list[str]:
    fields = [_attributes_text(attributes)] if attributes else []
    if dropped:
        fields.append(f'"droppedAttributesCount":{dropped}')
    return fields


def _attributes_text(attributes: Mapping[str, Any]) -> str:
    # copy(): a plain dict of the SDK's BoundedAttributes (or of the proxy around them),
    # whose own items() go key by key through Python. Tidewater's own spans have dicts.
    plain = attributes if type(attributes) is dict else attributes.copy()  # type: ignore[attr-defined]
    # The common kinds inline, not through _key_value: a call per attribute was a third of it.
    encoded = []
    for key, value in plain.items():
        kind = type(value)
        if kind is int:
            encoded.append(f'{_KEYS.get(key) or _key(key)}{{"intValue":"{value}"}}}}')
        elif kind is str:
            encoded.append(_STRINGS.get((key, value)) or _key_value(key, value))
        else:
            encoded.append(_key_value(key, value))
    return f'"attributes":[{",".join(encoded)}]'


# Encoded text by key, by (key, string value) and by span name; emptied when full.
_KEYS: dict[str, str] = {}
_NAMES: dict[str, str] = {}
_STRINGS: dict[tuple[str, str], str] = {}
_CACHED = 4096


def _key_value(key: str, value: Any) -> str:
    kind = type(value)
    if kind is str:
        encoded = _STRINGS.get((key, value))
        if encoded is None:
            encoded = f'{_key(key)}{{"stringValue":{_json(value)}}}}}'
            _remember(_STRINGS, (key, value), encoded)
        return encoded
    if kind is int:
        return f'{_key(key)}{{"intValue":"{value}"}}}}'
    return f"{_key(key)}{_json(_value(value))}}}"


def _name(name: str) -> str:
    encoded = _NAMES.get(name)
    if encoded is None:
        encoded = _json(name)
        _remember(_NAMES, name, encoded)
    return encoded


def _key(key: str) -> str:
    """A KeyValue's text up to its value."""
    encoded = _KEYS.get(key)
    if encoded is None:
        encoded = f'{{"key":{_json(key)},"value":'
        _remember(_KEYS, key, encoded)
    return encoded


def _remember(cache: dict[Any, str], key: Any, encoded: str) -> None:
    if len(cache) >= _CACHED:
        cache.clear()
    cache[key] = encoded


def _value(value: Any) -> dict[str, Any]:
    """An AnyValue for the json encoder (the types other than str and int)."""
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
