"""A local cluster of real processes with tracing on (`tidewater cluster up --trace`), a traced
client's produces on it, and its trace files read back as spans."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.local.cluster_cli import tidewater
from tidewater.client.admin import Admin
from tidewater.client.producer import Producer
from tidewater.local.cluster import ClusterFile

TOPIC = "traced"

Span = dict[str, Any]


def value(attribute: dict[str, Any]) -> Any:
    ((kind, raw),) = attribute["value"].items()
    return int(raw) if kind == "intValue" else raw


def attributes(entry: dict[str, Any]) -> dict[str, Any]:
    return {a["key"]: value(a) for a in entry.get("attributes", [])}


def read_spans(directory: Path) -> list[Span]:
    """Every span of every *.jsonl file, each with its process's resource as `resource`."""
    return [span for path in sorted(directory.glob("*.jsonl")) for span in read_spans_of(path)]


def read_spans_of(path: Path) -> list[Span]:
    spans = []
    for line in path.read_text().splitlines():
        for resource_spans in json.loads(line)["resourceSpans"]:
            resource = attributes(resource_spans["resource"])
            for scope in resource_spans["scopeSpans"]:
                for span in scope["spans"]:
                    spans.append({**span, "resource": resource, "attrs": attributes(span)})
    return spans


class Spans:
    """The spans of every trace file, indexed."""

    def __init__(self, directory: Path) -> None:
        self.all = read_spans(directory)
        self.by_id = {s["spanId"]: s for s in self.all}
        self.children: dict[str, list[Span]] = defaultdict(list)
        for s in self.all:
            if s.get("parentSpanId"):
                self.children[s["parentSpanId"]].append(s)

    def child(self, parent: Span, name: str) -> Span:
        [found] = [c for c in self.children[parent["spanId"]] if c["name"] == name]
        assert found["traceId"] == parent["traceId"]
        return found

    def served_by(self, fan_out: Span) -> set[int]:
        """Brokers with a LeaderAndIsr server span under the fan-out, in its trace."""
        return {
            s["resource"]["tidewater.broker.id"]
            for call in self.children[fan_out["spanId"]]
            if call["name"].endswith("BrokerControl/LeaderAndIsr")
            for s in self.children[call["spanId"]]
            if s["kind"] == 2 and s["traceId"] == fan_out["traceId"]
        }


def run_traced(root: Path, work: Callable[[ClusterFile, Path], Awaitable[None]]) -> Path:
    """`cluster up --trace`, `work`, `cluster down` (which flushes every process's spans);
    returns the directory of every process's trace file."""
    result = tidewater("cluster", "up", "--detach", "--trace", "--data-dir", str(root))
    assert result.returncode == 0, result.stdout + result.stderr
    state = ClusterFile.read(root)
    assert state is not None
    try:
        asyncio.run(work(state, root / "traces"))
    finally:
        down = tidewater("cluster", "down", "--data-dir", str(root))
    assert down.returncode == 0, down.stdout + down.stderr
    return root / "traces"


def admin(state: ClusterFile) -> Admin:
    return Admin(
        [m.address for m in state.find("controller")], [m.address for m in state.find("metadata")]
    )


async def produce(state: ClusterFile, traces: Path, batches: int) -> None:
    async with admin(state) as client:
        await client.create_topic(TOPIC, partitions=1, replication_factor=3)
    provider = TracerProvider(resource=Resource.create({"service.name": "tidewater-client"}))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(traces / "client.jsonl")))
    bootstrap = [m.address for m in state.find("metadata")]
    try:
        async with Producer(bootstrap, acks=-1, tracer_provider=provider) as producer:
            for _ in range(batches):  # one record, one batch, one trace each
                await asyncio.wait_for(producer.send_and_wait(TOPIC, b"hello"), 60)
    finally:
        provider.shutdown()


def record_produce(cluster_dir: Path, batches: int = 1) -> Path:
    """`batches` acks=all produces from a traced client on a traced cluster; returns the
    directory of every process's trace file."""
    return run_traced(cluster_dir, lambda state, traces: produce(state, traces, batches))
