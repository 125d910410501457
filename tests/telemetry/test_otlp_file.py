"""The trace file's exporter writes what opentelemetry-exporter-otlp-json-file's FileSpanExporter
writes, span for span: both export the same spans (every kind of attribute value, events, links,
errors, remote and local parents, trace state, two resources and scopes) and the lines compare
equal as JSON."""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from tidewater.client.spans import BatchTrace
from tidewater.local.wait import eventually
from tidewater.telemetry import tracing
from tidewater.telemetry.otlp_file import OtlpJsonFileSpanExporter, OtlpJsonFileSpanProcessor


def spans() -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    for service in ("tidewater-broker", "tidewater-client"):
        provider = TracerProvider(
            resource=Resource.create({"service.name": service, "tidewater.broker.id": 1})
        )
        provider.add_span_processor(SimpleSpanProcessor(memory))
        remote = SpanContext(
            0x0AF7651916CD43DD8448EB211C80319C,
            0xB7AD6B7169203331,
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
            trace_state=TraceState([("vendor", "x1")]),
        )
        tracer = provider.get_tracer("tidewater", "1.2", schema_url="https://example.com/s")
        with tracer.start_as_current_span(
            "Produce",
            context=trace.set_span_in_context(trace.NonRecordingSpan(remote)),
            kind=SpanKind.SERVER,
            attributes={
                "s": "text",
                "empty": "",
                "i": -7,
                "big": 2**62,
                "f": 0.25,
                "nan": float("nan"),
                "inf": float("-inf"),
                "yes": True,
                "no": False,
                "ints": (1, 2),
                "strs": ("a", "b"),
                "none": (),
            },
        ) as produce:
            produce.add_event("parked", {"tidewater.bytes": 10})
            produce.add_event("bare")
            with tracer.start_as_current_span("log.append"):
                pass
            wait = tracer.start_span(
                "replication.wait",
                links=[Link(remote, {"tidewater.follower_id": 2}), Link(remote)],
            )
            wait.set_status(Status(StatusCode.ERROR, "REQUEST_TIMED_OUT"))
            wait.end()
            produce.set_status(Status(StatusCode.OK))
        # Tidewater's own spans of the data path, kept as plain fields (tracing.PlainSpan).
        deferred = tracing.start_span(
            "Fetch",
            SpanKind.SERVER,
            trace.set_span_in_context(trace.NonRecordingSpan(remote)),
            {"tidewater.follower_id": 2, "messaging.system": "tidewater"},
            tracer=tracer,
        )
        assert deferred is not None
        tracing.record_child(
            deferred,
            "log.read",
            time.time_ns(),
            {"tidewater.bytes": 0},
            links=[Link(remote, {"tidewater.fetch_offset": 9})],
            status=Status(StatusCode.ERROR, "NOT_LEADER_OR_FOLLOWER"),
            tracer=tracer,
        )
        deferred.record_exception(ValueError("boom"))
        deferred.end()
        for kind in SpanKind:
            # One key, a value per span: the encoder's cache of encoded attributes keys on both.
            other = provider.get_tracer("other")
            other.start_span(f"kind {kind.name}", kind=kind, attributes={"k": kind.name}).end()
    return list(memory.get_finished_spans())


def test_the_trace_file_is_the_otel_file_exporters_json(tmp_path: Path) -> None:
    recorded = spans()
    assert sum(isinstance(span, tracing.PlainSpan) for span in recorded) == 4
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl"
    for exporter in (OtlpJsonFileSpanExporter(ours), FileSpanExporter(theirs)):
        exporter.export(recorded)
        exporter.export(recorded[:1])
        exporter.shutdown()
    lines = [[json.loads(line) for line in p.read_text().splitlines()] for p in (ours, theirs)]
    assert len(lines[0]) == 2
    assert lines[0] == lines[1]


def test_spans_of_resources_and_scopes_in_turn_are_grouped_as_the_exporter_groups_them(
    tmp_path: Path,
) -> None:
    """The encoder keeps the last span's group at hand: spans whose resource or scope change
    from one to the next still land in their own groups."""
    recorded = spans()
    mixed = [span for pair in zip(recorded, reversed(recorded), strict=True) for span in pair]
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl"
    for exporter in (OtlpJsonFileSpanExporter(ours), FileSpanExporter(theirs)):
        exporter.export(mixed)
        exporter.shutdown()
    assert json.loads(ours.read_text()) == json.loads(theirs.read_text())


def test_a_file_a_killed_writer_left_mid_line_gets_whole_lines_after_it(tmp_path: Path) -> None:
    """Review 25 M6: a process killed mid-write, restarted on the same trace file, glued its
    first line to the cut one; the report could read neither."""
    path = tmp_path / "broker-1.jsonl"
    path.write_text('{"resourceSpans": [{"resour')
    exporter = OtlpJsonFileSpanExporter(path)
    exporter.export(spans()[:1])
    exporter.shutdown()
    lines = path.read_text().split("\n")
    assert lines[0] == '{"resourceSpans": [{"resour'
    assert json.loads(lines[1])["resourceSpans"]
    assert lines[2:] == [""]


def test_an_export_of_no_spans_writes_no_line(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl"
    OtlpJsonFileSpanExporter(ours).export([])
    FileSpanExporter(theirs).export([])
    assert ours.read_text() == theirs.read_text() == ""


def test_the_trace_files_processor_writes_the_exporters_lines(tmp_path: Path) -> None:
    recorded = spans()
    ours, exported = tmp_path / "ours.jsonl", tmp_path / "exported.jsonl"
    exporter = OtlpJsonFileSpanExporter(exported)
    exporter.export(recorded)
    exporter.export(recorded[:3])
    exporter.shutdown()
    # A line per max_export_batch_size spans, the rest at shutdown.
    processor = OtlpJsonFileSpanProcessor(
        OtlpJsonFileSpanExporter(ours), max_export_batch_size=len(recorded)
    )
    for span in [*recorded, *recorded[:3]]:
        processor.on_end(span)
    processor.shutdown()
    processor.on_end(recorded[0])  # after shutdown: dropped
    assert [json.loads(line) for line in ours.read_text().splitlines()] == [
        json.loads(line) for line in exported.read_text().splitlines()
    ]


def test_the_trace_files_processor_skips_spans_sampled_out(tmp_path: Path) -> None:
    span = next(s for s in spans() if s.name == "log.append")
    context = span.context
    assert context is not None
    unsampled = ReadableSpan(
        "unsampled",
        SpanContext(context.trace_id, context.span_id, is_remote=False),
        resource=span.resource,
    )
    processor = OtlpJsonFileSpanProcessor(OtlpJsonFileSpanExporter(tmp_path / "spans.jsonl"))
    processor.on_end(unsampled)
    processor.on_end(span)
    processor.shutdown()
    [line] = (tmp_path / "spans.jsonl").read_text().splitlines()
    assert "unsampled" not in line and '"name":"log.append"' in line


async def test_the_trace_files_processor_writes_a_spans_line_within_the_schedule_delay(
    tmp_path: Path,
) -> None:
    path = tmp_path / "spans.jsonl"
    processor = OtlpJsonFileSpanProcessor(OtlpJsonFileSpanExporter(path), schedule_delay_millis=50)
    try:
        processor.on_end(spans()[0])
        await eventually(lambda: path.read_text().count("\n") == 1, 5)
    finally:
        processor.shutdown()


def test_the_trace_files_processor_drops_lines_when_the_disk_falls_behind(tmp_path: Path) -> None:
    class StalledExporter(OtlpJsonFileSpanExporter):
        def write(self, line: str) -> bool:
            released.wait(30)
            return super().write(line)

    released = threading.Event()
    path = tmp_path / "spans.jsonl"
    span = spans()[0]
    # Lines of one span, at most two waiting: the writer holds one, two wait, the rest drop.
    processor = OtlpJsonFileSpanProcessor(
        StalledExporter(path), max_export_batch_size=1, max_queue_size=2
    )
    try:
        for _ in range(10):
            processor.on_end(span)
        assert processor.dropped_spans >= 7
    finally:
        released.set()
        processor.shutdown()
    assert path.read_text().count("\n") == 10 - processor.dropped_spans


def spans_of(path: Path) -> list[dict[str, Any]]:
    """The spans of a trace file, their events' times left out (the SDK's own clock)."""
    spans = [
        span
        for line in path.read_text().splitlines()
        for resource in json.loads(line)["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    ]
    for span in spans:
        for event in span.get("events", ()):
            event.pop("timeUnixNano")
    return spans


def record_spans(trace_file: Path, straight: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker's spans through setup()'s trace file, written straight from their fields
    (`straight`, the file being the provider's only processor) or made ReadableSpans for
    the processor; ids and times the same each time."""
    random.seed(7)
    monkeypatch.setattr(time, "time_ns", itertools.count(1_763_850_000_000_000_000, 1_000).__next__)
    assert tracing.setup("tidewater-broker", trace_file)
    try:
        if not straight:
            # Not the provider's only processor: the spans go through the processors.
            tracing._provider.add_span_processor(SpanProcessor())  # type: ignore[union-attr]
        remote = SpanContext(7, 8, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        fetch = tracing.start_span(
            "Fetch",
            SpanKind.SERVER,
            trace.set_span_in_context(trace.NonRecordingSpan(remote)),
            {"tidewater.follower_id": 2},
        )
        assert fetch is not None
        tracing.record_child(fetch, "log.read", time.time_ns(), {"tidewater.bytes": 5})
        tracing.record_child(
            fetch,
            "replication.wait",
            time.time_ns(),
            links=[Link(remote, {"tidewater.fetch_offset": 9})],
            status=Status(StatusCode.ERROR, "REQUEST_TIMED_OUT"),
        )
        fetch.record_exception(ValueError("boom"))
        fetch.set_status(Status(StatusCode.ERROR, "boom"))
        fetch.end()
        root = tracing.start_span("replica.fetch", SpanKind.CLIENT, Context(), {})
        assert root is not None
        root.end()
    finally:
        tracing.shutdown()
        monkeypatch.undo()


def test_spans_written_straight_to_the_trace_file_are_those_the_processor_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight, processed = tmp_path / "straight.jsonl", tmp_path / "processed.jsonl"
    record_spans(straight, True, monkeypatch)
    record_spans(processed, False, monkeypatch)
    written = spans_of(straight)
    assert [span["name"] for span in written] == [
        "log.read",
        "replication.wait",
        "Fetch",
        "replica.fetch",
    ]
    assert written == spans_of(processed)


def batch_spans(trace_file: Path, straight: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer's spans of one batch through an application's provider whose only
    processor is the trace file's (`straight`), else beside another processor; ids and times
    the same each time. Straight, no ReadableSpan is made."""
    random.seed(7)
    monkeypatch.setattr(time, "time_ns", itertools.count(1_763_850_000_000_000_000, 1_000).__next__)
    provider = TracerProvider(resource=Resource.create({"service.name": "application"}))
    provider.add_span_processor(OtlpJsonFileSpanProcessor(OtlpJsonFileSpanExporter(trace_file)))
    if straight:
        monkeypatch.setattr(tracing, "PlainSpan", None)
    else:
        provider.add_span_processor(SpanProcessor())
    try:
        tracer = provider.get_tracer("tidewater.client")
        batch = BatchTrace(tracer, tracing.NewTraces(), "orders", 3, -1)
        batch.drained()
        batch.end(2, 120, 40, None)
    finally:
        provider.shutdown()
        monkeypatch.undo()


def test_the_sdks_spans_go_straight_to_an_applications_trace_file_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As setup()'s: a tracer whose provider's only processor is the trace file's hands it
    its spans encoded from their fields, the lines those of the processor's path."""
    straight, processed = tmp_path / "straight.jsonl", tmp_path / "processed.jsonl"
    batch_spans(straight, True, monkeypatch)
    batch_spans(processed, False, monkeypatch)
    written = spans_of(straight)
    assert [span["name"] for span in written] == ["batch.wait", "send orders"]
    assert written == spans_of(processed)
