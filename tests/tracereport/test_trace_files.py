"""Reading OTLP/JSON trace files: hex ids, attribute types, several files, damaged lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidewater.tracereport.otlp_json import TraceFileError, read_trace_files

TRACE_ID = "5b8efff798038103d269b633813fc60c"


def request(*spans: dict[str, object], service: str = "tidewater-broker") -> str:
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]}
    body = {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": list(spans)}]}]}
    return json.dumps(body)


def span(span_id: str, parent: str = "", **extra: object) -> dict[str, object]:
    return {
        "traceId": TRACE_ID,
        "spanId": span_id,
        "parentSpanId": parent,
        "name": "replication.wait",
        "kind": 1,
        "startTimeUnixNano": "1795000000000000000",
        "endTimeUnixNano": "1795000000004500000",
        **extra,
    }


def test_a_span_with_its_attributes_links_and_resource(tmp_path: Path) -> None:
    attributes = [
        {"key": "tidewater.hw", "value": {"intValue": "9007199254740993"}},  # past a double
        {"key": "ratio", "value": {"doubleValue": 0.5}},
        {"key": "ok", "value": {"boolValue": True}},
        {"key": "topic", "value": {"stringValue": "orders"}},
        {"key": "ids", "value": {"arrayValue": {"values": [{"intValue": "2"}, {"intValue": "3"}]}}},
    ]
    link = {
        "traceId": "00f067aa0ba902b700f067aa0ba902b7",
        "spanId": "00F067AA0BA902B7",
        "attributes": [{"key": "tidewater.follower_id", "value": {"intValue": "3"}}],
    }
    path = tmp_path / "broker-1.jsonl"
    path.write_text(
        request(span("eee19b7ec3c1b174", "53995c3f42cd8ad8", attributes=attributes, links=[link]))
        + "\n"
    )
    [read] = read_trace_files([path]).spans
    assert read.trace_id == TRACE_ID
    assert (read.span_id, read.parent_span_id) == ("eee19b7ec3c1b174", "53995c3f42cd8ad8")
    assert read.duration_ns == 4_500_000
    assert read.service == "tidewater-broker"
    assert read.attributes == {
        "tidewater.hw": 9007199254740993,
        "ratio": 0.5,
        "ok": True,
        "topic": "orders",
        "ids": (2, 3),
    }
    assert read.links[0].span_id == "00f067aa0ba902b7"
    assert read.links[0].attributes == {"tidewater.follower_id": 3}


def test_base64_ids_are_refused_with_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "client.jsonl"
    # What protobuf's json_format writes for bytes: base64, not OTLP/JSON's hex.
    path.write_text(request(span("7uGbfsPBsXQ=")) + "\n" + request(span("7uGbfsPBsXQ=")) + "\n")
    with pytest.raises(TraceFileError, match=r"client\.jsonl:1: .*hex"):
        read_trace_files([path])


def test_a_file_with_no_trace_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "client.jsonl"
    path.write_text("{not json\n[]\n")
    with pytest.raises(TraceFileError, match=r"client\.jsonl:1: not an OTLP/JSON trace line"):
        read_trace_files([path])


def test_damaged_lines_are_left_out_and_counted(tmp_path: Path) -> None:
    """A writer killed mid-line leaves its last line cut; restarted on the same file, it
    appended after it (review 25 M6: a damaged line in the middle failed the whole report)."""
    path = tmp_path / "client.jsonl"
    cut = request(span("1" * 16))[:40]
    whole = request(span("eee19b7ec3c1b174"))
    path.write_text(whole + "\n" + cut + whole.replace("eee19b7ec3c1b174", "2" * 16) + "\n" + cut)
    read = read_trace_files([path])
    assert [s.span_id for s in read.spans] == ["eee19b7ec3c1b174"]
    assert read.damaged_lines == 2


def test_directories_and_files_each_count_once(tmp_path: Path) -> None:
    (tmp_path / "b1").mkdir()
    (tmp_path / "b1" / "broker-1.jsonl").write_text(request(span("1" * 16)) + "\n")
    (tmp_path / "client.jsonl").write_text(request(span("2" * 16), service="app") + "\n")
    (tmp_path / "notes.txt").write_text("not a trace file")
    read = read_trace_files([tmp_path, tmp_path / "client.jsonl"])
    assert sorted(p.name for p in read.files) == ["broker-1.jsonl", "client.jsonl"]
    assert sorted(s.span_id for s in read.spans) == ["1" * 16, "2" * 16]


def test_missing_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(TraceFileError, match=r"absent\.jsonl: no such file"):
        read_trace_files([tmp_path / "absent.jsonl"])
    with pytest.raises(TraceFileError, match=r"no \*\.jsonl trace files"):
        read_trace_files([tmp_path])
