"""The tracing set-up's pure parts: which exporters the environment asks for, which RPCs the
interceptors trace, where a message's parent context comes from, and how replication.wait
picks its links."""

from __future__ import annotations

import asyncio
import gc
import itertools
import random
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags, TraceState

from tidewater.broker.spans import (
    FetchTrace,
    ProduceTrace,
    ReplicaFetchTrace,
    ReplicationWaits,
    fetch_link,
)
from tidewater.client.errors import DeliveryTimeout
from tidewater.client.spans import BatchTrace
from tidewater.telemetry import tracing
from tidewater.telemetry.otlp_file import OtlpJsonFileSpanExporter
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def kinds(trace_file: Path | None = None) -> list[type]:
    return [type(e) for e in tracing._exporters(trace_file)]


def test_nothing_to_export_to_means_tracing_stays_off(env: pytest.MonkeyPatch) -> None:
    assert kinds() == []
    assert tracing.setup("tidewater-broker") is False
    assert not tracing.ENABLED


def test_exporters_follow_the_flag_and_the_otel_variables(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert kinds(tmp_path / "spans.jsonl") == [OtlpJsonFileSpanExporter]
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert kinds() == [OTLPSpanExporter]
    env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert kinds() == [HttpSpanExporter]
    env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert kinds(tmp_path / "spans.jsonl") == [OtlpJsonFileSpanExporter]


def test_an_unknown_otlp_protocol_is_refused(env: pytest.MonkeyPatch) -> None:
    env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="carrier-pigeon"):
        tracing._exporters(None)


def test_otel_sdk_disabled_wins(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.setup("tidewater-broker", tmp_path / "spans.jsonl") is False
    assert not tracing.ENABLED


@pytest.mark.parametrize(
    ("method", "traced"),
    [
        ("/tidewater.v1.ControllerService/AlterIsr", True),
        ("/tidewater.v1.BrokerControl/LeaderAndIsr", True),
        ("/tidewater.v1.MetadataService/GetMetadata", True),
        # Traced per message by the broker and the clients instead.
        ("/tidewater.v1.BrokerService/Produce", False),
        ("/tidewater.v1.BrokerService/ProduceStream", False),
        ("/tidewater.v1.BrokerService/Fetch", False),
        ("/tidewater.v1.BrokerService/FetchStream", False),
        ("/grpc.health.v1.Health/Check", False),
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", False),
    ],
)
def test_which_calls_the_interceptors_trace(method: str, traced: bool) -> None:
    assert tracing._traced(SimpleNamespace(method=method)) is traced


def test_unary_calls_are_intercepted_and_the_data_planes_streams_are_not(
    exporter: InMemorySpanExporter,
) -> None:
    # A stream-stream interceptor would route every write of the ProduceStream and FetchStream
    # through a queue and a task of grpc.aio's, though it traces none of them.
    interceptors = tracing.client_interceptors()
    assert any(isinstance(i, grpc.aio.UnaryUnaryClientInterceptor) for i in interceptors)
    assert not any(isinstance(i, grpc.aio.StreamStreamClientInterceptor) for i in interceptors)


def parent_of(parent: object) -> SpanContext:
    context = tracing.context_of(parent)  # type: ignore[arg-type]
    return trace.get_current_span(context).get_span_context()


def test_a_messages_own_context_wins_over_the_calls_metadata() -> None:
    other = "00-11111111111111111111111111111111-2222222222222222-01"
    data = pb.PartitionProduceData(trace_context={"traceparent": TRACEPARENT})
    parent = parent_of(tracing.extract(data.trace_context, [("traceparent", other)]))
    assert parent.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert parent.is_remote and parent.trace_flags.sampled
    from_metadata = parent_of(
        tracing.extract(pb.PartitionProduceData().trace_context, [("traceparent", other)])
    )
    assert from_metadata.trace_id == 0x11111111111111111111111111111111
    assert not parent_of(tracing.extract(pb.PartitionProduceData().trace_context)).is_valid


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.shutdown()


def fetch_span(n: int) -> Callable[[], SpanContext]:
    """A fetch's span context, as ReplicationWaits.follower_fetched asks for it."""
    return lambda: SpanContext(n, n, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def traced(data: pb.PartitionProduceData) -> ProduceTrace:
    produce = ProduceTrace.start(data, -1, None)
    assert produce is not None
    return produce


def test_replication_wait_links_each_followers_first_fetch_that_holds_the_batch(
    exporter: InMemorySpanExporter,
) -> None:
    data = pb.PartitionProduceData(topic="t", partition=0)
    waits = ReplicationWaits()
    [wait] = waits.start([data], [traced(data)], {("t", 0): 10}).values()
    # (partition, follower, fetch offset, HW after the fetch, fetch span)
    waits.follower_fetched(("t", 0), 2, 7, 7, fetch_span(1))  # follower 2 does not hold it yet
    waits.follower_fetched(("t", 0), 2, 10, 7, fetch_span(2))  # 3 holds the HW at 7
    waits.follower_fetched(("t", 1), 3, 10, 10, fetch_span(3))  # another partition
    waits.follower_fetched(("t", 0), 2, 12, 7, fetch_span(4))  # follower 2 again
    waits.follower_fetched(("t", 0), 3, 10, 10, fetch_span(5))  # the HW covers the batch
    # Out of the ISR, say: after the HW moved, nothing the ack waited for.
    waits.follower_fetched(("t", 0), 4, 10, 10, fetch_span(6))
    waits.finish({("t", 0): wait}, pb.ProduceResponse(partitions=[{"topic": "t"}]), lambda tp: 10)
    waits.follower_fetched(("t", 0), 5, 10, 10, fetch_span(7))  # after the wait: not linked

    [span] = [s for s in exporter.get_finished_spans() if s.name == "replication.wait"]
    assert [link.context.span_id for link in span.links] == [2, 5]
    assert [dict(link.attributes) for link in span.links] == [
        {"tidewater.follower_id": 2, "tidewater.fetch_offset": 10},
        {"tidewater.follower_id": 3, "tidewater.fetch_offset": 10},
    ]
    assert span.attributes["tidewater.last_follower_id"] == 3
    assert span.attributes["tidewater.hw"] == 10


def test_a_replication_wait_the_isr_shrink_ended_names_no_follower(
    exporter: InMemorySpanExporter,
) -> None:
    """Review 25 M5: follower 3 lagged and was dropped from the ISR, which moved the HW past
    the batch; follower 2, linked earlier, was named the one the ack waited for."""
    data = pb.PartitionProduceData(topic="t", partition=0)
    waits = ReplicationWaits()
    [wait] = waits.start([data], [traced(data)], {("t", 0): 10}).values()
    waits.follower_fetched(("t", 0), 2, 10, 7, fetch_span(1))
    waits.finish({("t", 0): wait}, pb.ProduceResponse(partitions=[{"topic": "t"}]), lambda tp: 10)
    [span] = [s for s in exporter.get_finished_spans() if s.name == "replication.wait"]
    assert [link.context.span_id for link in span.links] == [1]
    assert "tidewater.last_follower_id" not in span.attributes


def test_a_timed_out_replication_wait_is_an_error_child_of_its_produce(
    exporter: InMemorySpanExporter,
) -> None:
    data = pb.PartitionProduceData(topic="t", partition=0)
    produce = traced(data)
    waits = ReplicationWaits()
    started = waits.start([data], [produce], {("t", 0): 10})
    timed_out = {"topic": "t", "error_code": ErrorCode.REQUEST_TIMED_OUT, "error_message": "late"}
    response = pb.ProduceResponse(partitions=[timed_out])
    waits.finish(started, response, lambda tp: 4)

    [span] = exporter.get_finished_spans()
    assert span.name == "replication.wait"
    assert span.parent is not None
    assert span.parent.span_id == produce.span.get_span_context().span_id
    assert span.context.trace_id == produce.span.get_span_context().trace_id
    assert span.start_time is not None and span.end_time is not None
    assert span.start_time <= span.end_time
    assert span.attributes["tidewater.error_code"] == "REQUEST_TIMED_OUT"
    assert span.attributes["tidewater.hw"] == 4
    assert span.status.status_code == StatusCode.ERROR and span.status.description == "late"


UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def test_a_sampled_out_produce_makes_no_span(exporter: InMemorySpanExporter) -> None:
    for flags in ("00", "02"):  # 02: the trace id is random, and still not sampled
        traceparent = UNSAMPLED[:-2] + flags
        data = pb.PartitionProduceData(trace_context={"traceparent": traceparent})
        assert tracing.extract(data.trace_context) is None
        assert ProduceTrace.start(data, -1, None) is None
        assert tracing.extract({}, [("traceparent", traceparent)]) is None
    sampled = pb.PartitionProduceData(trace_context={"traceparent": UNSAMPLED[:-2] + "03"})
    assert ProduceTrace.start(sampled, -1, None) is not None


DECLARED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-02"


@pytest.mark.parametrize(
    ("metadata", "declared"),
    [
        ((("tidewater-sampled-out-parent", DECLARED),), True),
        ((("x", "y"), ("tidewater-sampled-out-parent", UNSAMPLED)), True),
        (None, False),
        ((), False),
        ((("traceparent", DECLARED),), False),  # the call's parent: unary calls only
        ((("tidewater-sampled-out-parent", DECLARED[:-2] + "03"),), False),  # sampled
        ((("tidewater-sampled-out-parent", DECLARED[:-1]),), False),
        ((("tidewater-sampled-out-parent", "01" + DECLARED[2:]),), False),
    ],
)
def test_a_stream_declares_only_a_sampled_out_parent(metadata: Any, declared: bool) -> None:
    parent = tracing.stream_parent(metadata)
    if not declared:
        assert parent is None
        return
    assert parent is not None and parent.is_remote and not parent.trace_flags.sampled
    assert (parent.trace_id, parent.span_id) == (
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
    )


def produce_request(*contexts: dict[str, str]) -> pb.ProduceRequest:
    return pb.ProduceRequest(
        acks=-1,
        partitions=[
            pb.PartitionProduceData(topic="t", partition=p, trace_context=context)
            for p, context in enumerate(contexts)
        ],
    )


def test_a_produce_on_a_declaring_stream_traces_only_batches_that_carry_a_context(
    exporter: InMemorySpanExporter,
) -> None:
    """The leader's sampler (parent-based always-on) keeps every trace it starts itself: a
    batch without context on a stream that declared nothing starts one, as before; on one
    that declared its sampled-out parent it makes nothing, and the produce no list."""
    declared = tracing.stream_parent((("tidewater-sampled-out-parent", DECLARED),))
    bare = produce_request({}, {}, {})
    assert ProduceTrace.start_all(bare, None, declared) is None
    undeclared = ProduceTrace.start_all(bare, None, None)
    assert undeclared is not None and all(undeclared)
    carrying = produce_request({}, {"traceparent": TRACEPARENT}, {"traceparent": UNSAMPLED})
    traces = ProduceTrace.start_all(carrying, None, declared)
    assert traces is not None and [t is not None for t in traces] == [False, True, False]
    assert traces[1] is not None
    assert traces[1].span.get_span_context().trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert FetchTrace.start(pb.FetchRequest(replica_id=2), None, declared) is None
    assert FetchTrace.start(pb.FetchRequest(replica_id=2), None, None) is not None


@pytest.mark.parametrize("declared", [False, True], ids=["carried", "declared"])
def test_a_sampler_that_ignores_the_parent_decides_on_a_sampled_out_one(declared: bool) -> None:
    """A not sampled parent, carried in the message or declared by its stream."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        if declared:
            request = produce_request({})
            parent = tracing.stream_parent((("tidewater-sampled-out-parent", DECLARED),))
        else:
            request, parent = produce_request({"traceparent": UNSAMPLED}), None
        traces = ProduceTrace.start_all(request, None, parent)
        assert traces is not None and traces[0] is not None
        traces[0].end(pb.PartitionProduceResponse())
        [span] = exporter.get_finished_spans()
        assert span.parent is not None and span.parent.span_id == 0xB7AD6B7169203331
        assert span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    finally:
        tracing.shutdown()


@pytest.mark.parametrize(
    ("traceparent", "sampled_out"),
    [
        (UNSAMPLED, True),
        (UNSAMPLED[:-2] + "01", False),
        (UNSAMPLED[:-2] + "0b", False),
        (UNSAMPLED[:-2] + "0a", True),
        # Other forms are the propagator's to read.
        (UNSAMPLED[:-2] + "0A", False),
        ("01" + UNSAMPLED[2:] + "-future", False),
        (UNSAMPLED[:-1], False),
        (None, False),
    ],
)
def test_which_traceparents_are_read_as_sampled_out_from_their_flags(
    traceparent: str | None, sampled_out: bool
) -> None:
    assert tracing._sampled_out(traceparent) is sampled_out


def test_an_untraced_follower_fetch_is_linked_by_the_context_it_carries(
    exporter: InMemorySpanExporter,
) -> None:
    data = pb.PartitionProduceData(topic="t", partition=0)
    waits = ReplicationWaits()
    started = waits.start([data], [traced(data)], {("t", 0): 10})
    sampled_out = pb.FetchRequest(replica_id=2, trace_context={"traceparent": UNSAMPLED})
    assert FetchTrace.start(sampled_out, None) is None
    waits.follower_fetched(("t", 0), 2, 10, 7, fetch_link(sampled_out, None))
    # A follower that does not trace: counted, but nothing to link to.
    waits.follower_fetched(("t", 0), 3, 10, 10, fetch_link(pb.FetchRequest(replica_id=3), None))
    waits.finish(started, pb.ProduceResponse(partitions=[{"topic": "t"}]), lambda tp: 10)

    [span] = [s for s in exporter.get_finished_spans() if s.name == "replication.wait"]
    [link] = span.links
    assert link.context.span_id == 0xB7AD6B7169203331
    assert not link.context.trace_flags.sampled
    assert dict(link.attributes or {}) == {
        "tidewater.follower_id": 2,
        "tidewater.fetch_offset": 10,
    }
    assert span.attributes is not None
    assert span.attributes["tidewater.last_follower_id"] == 3


def test_a_produce_span_reaches_the_processors_once_as_the_sdk_would_record_it(
    exporter: InMemorySpanExporter,
) -> None:
    data = pb.PartitionProduceData(
        topic="t", partition=3, trace_context={"traceparent": TRACEPARENT}
    )
    produce = traced(data)
    assert produce.span.is_recording()
    result = pb.PartitionProduceResponse(
        error_code=ErrorCode.NOT_LEADER_OR_FOLLOWER, error_message="moved"
    )
    produce.end(result)
    produce.end(result)

    [span] = exporter.get_finished_spans()
    assert (span.name, span.kind) == ("Produce", trace.SpanKind.SERVER)
    assert span.parent is not None and span.parent.span_id == 0xB7AD6B7169203331
    assert span.parent.is_remote
    assert span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert span.context.trace_flags.sampled
    assert span.instrumentation_scope is not None
    assert span.instrumentation_scope.name == tracing.SCOPE
    assert span.attributes["messaging.destination.partition.id"] == "3"
    assert span.attributes["tidewater.error_code"] == "NOT_LEADER_OR_FOLLOWER"
    assert span.status.status_code == StatusCode.ERROR and span.status.description == "moved"
    assert span.start_time is not None and span.end_time is not None
    assert span.start_time <= span.end_time


def test_a_fetch_of_a_follower_starts_a_trace_its_sampler_decides_on() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        request = pb.FetchRequest(replica_id=2)
        new_traces = tracing.NewTraces()
        # Sampled out, it carries nothing: its stream declared the fetcher's (not sampled)
        # constant, which the leader's parent-based sampler follows, recording nothing.
        assert ReplicaFetchTrace.start(request, 1, new_traces) is None
        assert not request.trace_context
        declared = tracing.stream_parent(new_traces.metadata)
        assert declared is not None and not declared.trace_flags.sampled
        assert FetchTrace.start(request, None, declared) is None
        assert exporter.get_finished_spans() == ()
    finally:
        tracing.shutdown()


@pytest.fixture
def seeded() -> Iterator[None]:
    """The random bits trace ids are drawn from, the same in every run; restored after."""
    state = random.getstate()
    random.seed(6)
    yield
    random.setstate(state)


@pytest.mark.parametrize(
    "sampler",
    [
        ParentBased(ALWAYS_OFF),
        ParentBasedTraceIdRatio(0.0),
        ParentBasedTraceIdRatio(0.01),
        TraceIdRatioBased(0.5),
        ParentBasedTraceIdRatio(1.0),
        ParentBased(ALWAYS_ON),
    ],
    ids=lambda sampler: sampler.get_description(),
)
def test_a_fetchers_fetch_is_sampled_as_its_sdk_sampler_decides_on_the_same_id(
    exporter: InMemorySpanExporter, seeded: None, sampler: Sampler
) -> None:
    """With the SDK's ids and a ratio-based or always-off sampler, a fetch draws the low 64
    bits its sampler reads and the high ones only when it keeps the trace; the decision and
    the trace id are those the SDK's sampler and ids would make of the same random bits."""
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    new_traces = tracing.NewTraces()
    kept = 0
    for _ in range(3000):
        state = random.getstate()
        trace_id = random.getrandbits(64) | random.getrandbits(64) << 64
        random.setstate(state)
        expected = sampler.should_sample(None, trace_id, "replica.fetch").decision.is_sampled()
        request = pb.FetchRequest(replica_id=2)
        fetch = ReplicaFetchTrace.start(request, 1, new_traces)
        assert (fetch is not None) is expected, hex(trace_id)
        if fetch is None:
            assert not request.trace_context  # its stream declared the constant
            continue
        kept += 1
        carried = tracing.carried_span_context(request.trace_context)
        assert carried.trace_flags.sampled and carried.trace_flags.random_trace_id
        assert carried.trace_id == trace_id
        assert sampler.should_sample(None, carried.trace_id, "x").decision.is_sampled()
        span = fetch.span.get_span_context()
        assert (span.trace_id, span.span_id, span.trace_flags) == (
            carried.trace_id,
            carried.span_id,
            carried.trace_flags,
        )
        fetch.span.end()
    spans = exporter.get_finished_spans()
    assert len(spans) == kept
    assert all((s.name, s.kind) == ("replica.fetch", trace.SpanKind.CLIENT) for s in spans)
    bound = tracing._facts(tracing.TRACER).new_trace_bound
    assert (kept == 0) is (bound == 0)
    assert (kept == 3000) is (bound == 1 << 64)


def test_a_sampled_out_fetch_carries_nothing_and_the_leader_follows_its_streams_constant(
    exporter: InMemorySpanExporter, seeded: None
) -> None:
    """The leader (here with parent-based always-on, the default) records no `Fetch` for a
    fetch that carries nothing on a stream that declared its fetcher's constant, and
    replication.wait links that constant."""
    fetchers = {2: tracing.NewTraces(), 3: tracing.NewTraces()}
    assert fetchers[2].traceparent != fetchers[3].traceparent
    declared = {f: tracing.stream_parent(new_traces.metadata) for f, new_traces in fetchers.items()}
    requests = []
    tracing.install(TracerProvider(sampler=ParentBasedTraceIdRatio(0.01)))
    try:
        for follower_id, new_traces in fetchers.items():
            for _ in range(20):
                request = pb.FetchRequest(replica_id=follower_id)
                if ReplicaFetchTrace.start(request, 1, new_traces) is None:
                    assert not request.trace_context
                    requests.append(request)
    finally:
        tracing.shutdown()
    assert {r.replica_id for r in requests} == {2, 3}

    leader = TracerProvider()
    leader.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(leader)
    data = pb.PartitionProduceData(topic="t", partition=0)
    waits = ReplicationWaits()
    started = waits.start([data], [traced(data)], {("t", 0): 10})
    for request in requests:
        stream = declared[request.replica_id]
        carried = tracing.carried_span_context(request.trace_context, stream)
        new_traces = fetchers[request.replica_id]
        assert (carried.trace_id, carried.span_id) == (new_traces.trace_id, new_traces.span_id)
        assert not carried.trace_flags.sampled
        fetch = FetchTrace.start(request, None, stream)
        assert fetch is None
        link = fetch_link(request, fetch, stream)
        waits.follower_fetched(("t", 0), request.replica_id, 10, 7, link)
    waits.finish(started, pb.ProduceResponse(partitions=[{"topic": "t"}]), lambda tp: 10)

    assert [s.name for s in exporter.get_finished_spans()] == ["replication.wait"]
    [wait] = exporter.get_finished_spans()
    assert [(link.context.span_id, dict(link.attributes or {})) for link in wait.links] == [
        (fetchers[f].span_id, {"tidewater.follower_id": f, "tidewater.fetch_offset": 10})
        for f in (2, 3)
    ]


class Asked(Sampler):
    """A sampler of the application's own that drops everything and counts its calls."""

    def __init__(self) -> None:
        self.asked = 0

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        self.asked += 1
        return SamplingResult(Decision.DROP)

    def get_description(self) -> str:
        return "Asked"


def test_another_sampler_is_asked_for_every_fetch_which_carries_a_context_of_its_own() -> None:
    sampler = Asked()
    tracing.install(TracerProvider(sampler=sampler))
    try:
        new_traces = tracing.NewTraces()
        requests = [pb.FetchRequest(replica_id=2) for _ in range(5)]
        for request in requests:
            assert ReplicaFetchTrace.start(request, 1, new_traces) is None
        assert sampler.asked == 5
        carried = [tracing.carried_span_context(r.trace_context) for r in requests]
        assert len({c.trace_id for c in carried}) == 5
        assert new_traces.trace_id not in {c.trace_id for c in carried}
        assert not any(c.trace_flags.sampled for c in carried)
    finally:
        tracing.shutdown()


def test_another_id_generator_makes_every_fetchs_trace_id() -> None:
    """A ratio sampler with ids of the application's: each fetch's trace id is the
    generator's, decided by the sampler's rule on it, as start_span decides any new trace."""
    provider = TracerProvider(sampler=RATIO, id_generator=Ids(EDGE_IDS, random=True))
    tracing.install(provider)
    try:
        new_traces = tracing.NewTraces()
        for trace_id in EDGE_IDS:
            request = pb.FetchRequest(replica_id=2)
            fetch = ReplicaFetchTrace.start(request, 1, new_traces)
            expected = RATIO.should_sample(None, trace_id, "replica.fetch").decision.is_sampled()
            assert (fetch is not None) is expected
            carried = tracing.carried_span_context(request.trace_context)
            assert (carried.trace_id, carried.trace_flags.sampled) == (trace_id, expected)
    finally:
        tracing.shutdown()


@pytest.mark.parametrize("state", [TraceState(), TraceState([("vendor", "x1")])])
@pytest.mark.parametrize("flags", [0, 1, 2, 3])
def test_a_context_is_written_as_the_propagators_write_it(state: TraceState, flags: int) -> None:
    context = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
        is_remote=False,
        trace_flags=TraceFlags(flags),
        trace_state=state,
    )
    ours: dict[str, str] = {}
    tracing._write_context(context.trace_id, context.span_id, flags, state, ours)
    theirs: dict[str, str] = {}
    propagate.inject(theirs, context=trace.set_span_in_context(trace.NonRecordingSpan(context)))
    assert ours == theirs
    assert ours["traceparent"].endswith(f"-0{flags}")


class Marker(TextMapPropagator):
    """A propagator of another kind than W3C's: it marks every carrier it injects into."""

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        return context

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        carrier["x-marker"] = "1"

    @property
    def fields(self) -> set[str]:
        return {"x-marker"}


def test_other_propagators_than_w3c_write_every_context() -> None:
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([before, Marker()]))
    try:
        carrier: dict[str, str] = {}
        tracing._write_context(1, 2, 0, TraceState(), carrier)
        assert carrier["x-marker"] == "1"
        assert carrier["traceparent"] == f"00-{1:032x}-{2:016x}-00"
    finally:
        propagate.set_global_textmap(before)


def test_with_other_propagators_than_w3c_a_sampled_out_fetch_carries_nothing_too() -> None:
    """Its stream's declaration is a traceparent of Tidewater's own metadata key, which
    brokers read whatever the propagators."""
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([before, Marker()]))
    tracing.install(TracerProvider(sampler=ParentBased(ALWAYS_OFF)))
    try:
        new_traces = tracing.NewTraces()
        carrier: dict[str, str] = {}
        span = tracing.start_span(
            "replica.fetch", trace.SpanKind.CLIENT, Context(), {}, carrier, new_traces=new_traces
        )
        assert span is None
        assert carrier == {}
        assert new_traces.metadata == ((tracing.SAMPLED_OUT_PARENT, new_traces.traceparent),)
    finally:
        tracing.shutdown()
        propagate.set_global_textmap(before)


def test_the_send_span_of_a_failed_batch_records_its_exception_as_the_sdk_does() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tidewater.client")
    error = DeliveryTimeout("no ack in time")
    with tracer.start_as_current_span("application") as application:
        batch = BatchTrace(tracer, tracing.NewTraces(), "t", 2, -1)
    batch.drained()
    batch.end(3, 120, None, error)

    spans = {s.name: s for s in exporter.get_finished_spans()}
    send, wait = spans["send t"], spans["batch.wait"]
    assert (send.name, send.kind) == ("send t", trace.SpanKind.PRODUCER)
    assert send.parent is not None
    assert send.parent.span_id == application.get_span_context().span_id
    assert batch.carrier["traceparent"].split("-")[2] == f"{send.context.span_id:016x}"
    assert wait.parent is not None
    assert wait.parent.span_id == send.context.span_id
    assert send.status.status_code == StatusCode.ERROR
    assert send.attributes is not None
    assert send.attributes["messaging.batch.message_count"] == 3
    [event] = send.events
    sdk = provider.get_tracer("x").start_span("x")
    sdk.record_exception(error)
    [expected] = sdk.events  # type: ignore[attr-defined]
    assert event.name == "exception"
    assert dict(event.attributes or {}) == dict(expected.attributes)


def test_sampled_out_batches_make_no_span_and_carry_their_decision() -> None:
    """Outside any span of the application's, a producer's sampled-out batches carry nothing
    (its streams declare its constant context), as a fetcher's fetches do; inside one, they
    carry their context in that span's trace."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tidewater.client")
    new_traces = tracing.NewTraces()
    batches = [BatchTrace(tracer, new_traces, "t", 0, -1) for _ in range(2)]
    with tracer.start_as_current_span("application") as application:
        inside = BatchTrace(tracer, new_traces, "t", 0, -1)
    for batch in (*batches, inside):
        batch.drained()
        batch.end(1, 10, 0, None)
        assert batch.span is None
    assert [b.carrier for b in batches] == [{}] * 2
    carried = tracing.carried_span_context(inside.carrier)
    assert carried.is_valid and not carried.trace_flags.sampled
    assert carried.trace_id == application.get_span_context().trace_id
    assert carried.span_id != new_traces.span_id
    assert exporter.get_finished_spans() == ()


class Ids(IdGenerator):
    """Trace ids from a list (those of a new trace decide its sampling), span ids counted."""

    def __init__(self, trace_ids: list[int], random: bool) -> None:
        self.trace_ids = iter(trace_ids)
        self.span_ids = itertools.count(1)
        self.random = random

    def generate_trace_id(self) -> int:
        return next(self.trace_ids)

    def generate_span_id(self) -> int:
        return next(self.span_ids)

    def is_trace_id_random(self) -> bool:
        return self.random


class Picky(Sampler):
    """A sampler of the application's own: keeps the spans it is told to, by name."""

    def should_sample(
        self, parent_context: Any, trace_id: int, name: str, *args: Any, **kwargs: Any
    ) -> SamplingResult:
        keep = name.endswith("keep")
        return SamplingResult(Decision.RECORD_AND_SAMPLE if keep else Decision.DROP)

    def get_description(self) -> str:
        return "Picky"


RATIO = TraceIdRatioBased(0.25)
# Low 64 bits around the ratio's bound; high bits that a wrong mask would read.
EDGE_IDS = [
    (high << 64) | low
    for high in (0, 0xFFFF_FFFF_FFFF_FFFF)
    for low in (1, RATIO.bound - 1, RATIO.bound, RATIO.bound + 1, (1 << 64) - 1)
]


SAMPLERS = [
    ParentBasedTraceIdRatio(0.25),
    ParentBased(RATIO),
    RATIO,
    ParentBased(ALWAYS_OFF),
    ParentBased(ALWAYS_ON),
    ALWAYS_OFF,
    Picky(),
    ParentBased(Picky()),
    # Parent-based, but not with the default samplers for parents.
    ParentBased(ALWAYS_ON, remote_parent_sampled=Picky()),
    ParentBased(ALWAYS_ON, local_parent_not_sampled=ALWAYS_ON),
]


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda sampler: sampler.get_description())
@pytest.mark.parametrize("random_ids", [True, False])
@pytest.mark.parametrize("name", ["replica.fetch", "keep"])
def test_a_new_trace_is_sampled_as_its_sampler_decides(
    sampler: Sampler, random_ids: bool, name: str
) -> None:
    """start_span decides a new trace by trace id ratio itself where the sampler would;
    the outcome and the context written are the sampler's for every id."""
    provider = TracerProvider(sampler=sampler, id_generator=Ids(EDGE_IDS, random_ids))
    tracer = provider.get_tracer("test")
    for trace_id in EDGE_IDS:
        expected = sampler.should_sample(None, trace_id, name).decision.is_sampled()
        carrier: dict[str, str] = {}
        span = tracing.start_span(name, trace.SpanKind.CLIENT, Context(), {}, carrier, tracer)
        assert (span is not None) is expected, hex(trace_id)
        carried = tracing.carried_span_context(carrier)
        assert carried.trace_id == trace_id
        assert carried.trace_flags.sampled is expected
        assert carried.trace_flags.random_trace_id is random_ids
        if span is not None:
            assert span.get_span_context().span_id == carried.span_id


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda sampler: sampler.get_description())
def test_a_new_traces_attributes_are_made_only_for_its_span_or_a_sampler_that_asks(
    sampler: Sampler,
) -> None:
    """Attributes given as a function (the producer's `send`) are made for a span recorded
    or a sampler asked, and are then what the SDK would record; a trace decided sampled out
    by its ratio makes none."""
    provider = TracerProvider(sampler=sampler, id_generator=Ids(EDGE_IDS, True))
    tracer = provider.get_tracer("test")
    asked = tracing._facts(tracer).new_trace_bound is None
    made = []

    def attributes() -> dict[str, Any]:
        made.append(True)
        return {"a": 1}

    for trace_id in EDGE_IDS:
        made.clear()
        expected = sampler.should_sample(None, trace_id, "keep", None, {"a": 1})
        span = tracing.start_span("keep", trace.SpanKind.CLIENT, Context(), attributes, {}, tracer)
        assert (span is not None) is expected.decision.is_recording()
        assert made == ([True] if asked or span is not None else [])
        if span is not None:
            assert span.attributes == dict(expected.attributes)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda sampler: sampler.get_description())
@pytest.mark.parametrize("remote", [True, False])
@pytest.mark.parametrize("flags", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["Produce", "keep"])
@pytest.mark.parametrize("alone", [False, True], ids=["in a context", "alone"])
def test_a_child_is_sampled_as_its_sampler_decides(
    sampler: Sampler, remote: bool, flags: int, name: str, alone: bool
) -> None:
    """start_span follows a parent's sampled flag itself where the sampler would: the outcome,
    the context written and the trace state are the sampler's; for a parent in a Context
    and for a SpanContext alone, as extract() reads a traceparent alone (the sampler, when
    asked, gets it in a Context)."""
    provider = TracerProvider(sampler=sampler)
    tracer = provider.get_tracer("test")
    state = TraceState([("vendor", "x1")])
    parent = SpanContext(EDGE_IDS[1], 0xB7AD6B7169203331, remote, TraceFlags(flags), state)
    context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
    expected = sampler.should_sample(context, parent.trace_id, name, None, {"a": 1})
    carrier: dict[str, str] = {}
    span = tracing.start_span(
        name, trace.SpanKind.SERVER, parent if alone else context, {"a": 1}, carrier, tracer
    )
    assert (span is not None) is expected.decision.is_recording()
    carried = tracing.carried_span_context(carrier)
    assert carried.trace_id == parent.trace_id
    assert carried.trace_flags.sampled is expected.decision.is_sampled()
    assert carried.trace_flags.random_trace_id is bool(flags & 2)
    expected_state = expected.trace_state or TraceState()
    assert carried.trace_state == expected_state
    if span is not None:
        assert span.get_span_context().trace_state == expected_state
        assert span.parent == parent
        assert span.attributes == dict(expected.attributes)


@pytest.mark.parametrize(
    "headers",
    [
        {"traceparent": TRACEPARENT},
        {"traceparent": TRACEPARENT[:-2] + "03"},
        {"traceparent": TRACEPARENT[:-2] + "ff"},
        {"traceparent": TRACEPARENT.upper()},
        {"traceparent": "00-" + "0" * 32 + TRACEPARENT[35:]},
        {"traceparent": TRACEPARENT[:36] + "0" * 16 + TRACEPARENT[52:]},
        {"traceparent": "ff" + TRACEPARENT[2:]},
        {"traceparent": "01" + TRACEPARENT[2:] + "-future"},
        {"traceparent": TRACEPARENT + "-"},
        {"traceparent": " " + TRACEPARENT},
        {"traceparent": TRACEPARENT, "tracestate": "vendor=x1"},
        {"traceparent": TRACEPARENT, "baggage": "user=alice"},
    ],
)
def test_a_parent_is_read_as_the_propagators_read_it(headers: dict[str, str]) -> None:
    ours, theirs = tracing.extract(headers), propagate.extract(headers)
    assert ours is not None
    assert parent_of(ours) == parent_of(theirs)
    assert baggage.get_all(tracing.context_of(ours)) == baggage.get_all(theirs)


def test_the_last_tracer_asked_about_is_not_kept_alive_by_the_cache() -> None:
    """A tracer (and its provider) no longer used goes: the cache of the last tracer's facts
    holds it weakly, as the table of every tracer's does. Before, it held it strongly."""
    provider = TracerProvider()
    tracer = provider.get_tracer("short-lived")
    tracing._facts(tracer)
    gone = weakref.ref(tracer)
    provider.shutdown()
    del tracer, provider
    gc.collect()
    assert gone() is None


async def test_a_detached_task_starts_outside_its_creators_trace() -> None:
    """Review 25 M1: the controller's per-broker sender, a follower's fetcher and the SDK's
    sender were created inside a span (the heartbeat that unfenced the broker, a LeaderAndIsr,
    the first send()) and kept it: every UpdateMetadata the controller sent that broker for
    the rest of its life was a child of that long-ended heartbeat."""
    tracer = TracerProvider().get_tracer("test")
    seen: dict[str, trace.Span] = {}

    async def current(name: str) -> None:
        seen[name] = trace.get_current_span()

    with tracer.start_as_current_span("heartbeat") as heartbeat:
        await asyncio.create_task(current("inherited"))
        await tracing.detached_task(current("detached"))
    assert seen["inherited"] is heartbeat
    assert not seen["detached"].get_span_context().is_valid
