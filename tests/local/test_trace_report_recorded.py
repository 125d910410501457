"""`tidewater trace report` on trace files recorded by real processes (`cluster up --trace`:
three brokers, each with --trace-file; acks=all from a traced client): every batch is one
complete trace, and the report's stages are the spans' own durations, adding up to `send`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.local.traced_cluster import Span, read_spans, record_produce
from tidewater.tracereport.otlp_json import read_trace_files
from tidewater.tracereport.stages import STAGES, TOTAL, latency_report

pytestmark = pytest.mark.timeout(300)
BATCHES = 5


def expected_stages(spans: list[Span], trace_id: str) -> tuple[dict[str, int], int]:
    """The stages read straight off the recorded spans, and the follower the ack waited for."""
    trace = [s for s in spans if s["traceId"] == trace_id]

    def duration(span: Span) -> int:
        return int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])

    def child(parent: Span, name: str) -> Span:
        [found] = [
            s for s in trace if s.get("parentSpanId") == parent["spanId"] and s["name"] == name
        ]
        return found

    [send] = [s for s in trace if s["name"].startswith("send ")]
    produce = max(
        (s for s in trace if s["name"] == "Produce" and s["parentSpanId"] == send["spanId"]),
        key=lambda s: int(s["startTimeUnixNano"]),
    )
    wait = child(produce, "replication.wait")
    stages = {
        "queueing": duration(child(send, "batch.wait")),
        "network": duration(send) - duration(child(send, "batch.wait")) - duration(produce),
        "append": duration(child(produce, "log.append")),
        "replication": duration(wait),
        "response": duration(produce) - duration(child(produce, "log.append")) - duration(wait),
        TOTAL: duration(send),
    }
    return stages, wait["attrs"]["tidewater.last_follower_id"]


def test_report_stages_match_the_recorded_spans(data_dir: Path, tmp_path: Path) -> None:
    traces = record_produce(data_dir, batches=BATCHES)

    page = tmp_path / "latency.html"
    result = subprocess.run(
        [sys.executable, "-m", "tidewater", "trace", "report", str(traces), "--html", str(page)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{BATCHES} complete (acks=all: {BATCHES}), 0 failed, 0 skipped" in result.stdout
    assert page.stat().st_size > 0

    report = latency_report(read_trace_files([traces]).spans)
    spans = read_spans(traces)
    assert len(report.traces) == BATCHES
    last_followers: list[int] = []
    for trace in report.traces:
        stages, last_follower = expected_stages(spans, trace.trace_id)
        assert dict(trace.stages_ns) == stages
        assert sum(trace.stages_ns[s] for s in STAGES) == trace.stages_ns[TOTAL]
        assert trace.last_follower_id == last_follower
        last_followers.append(last_follower)
    assert sorted(report.last_to_ack) == sorted(
        (f, last_followers.count(f)) for f in set(last_followers)
    )
    # What the user reads: each stage's max, in ms, is the largest of those spans.
    rows = {line[:28].strip(): line[28:].split() for line in result.stdout.splitlines()}
    for stage, title in (("replication", "replication wait"), (TOTAL, "total (send to ack)")):
        largest = max(expected_stages(spans, t.trace_id)[0][stage] for t in report.traces)
        assert rows[title][-1] == f"{largest / 1e6:.3f}"
