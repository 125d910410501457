"""Trace context between the producer and real brokers: a batch the producer sends twice (the
first leader moved away) stays one trace, each attempt's Produce a child of the batch's `send`
span; a batch sampled out is recorded nowhere and carries nothing, its stream having declared
the producer's not sampled constant once; other clients' streams, which declare nothing, are
traced as any message without context."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, ParentBasedTraceIdRatio

from tidewater.client.producer import Producer
from tidewater.records.batch import Record, build_batch
from tidewater.telemetry import tracing
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """Brokers and client of this process trace into memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield provider, exporter
    tracing.shutdown()


async def test_a_batch_retried_at_a_new_leader_stays_in_one_trace(cluster, spans) -> None:
    provider, exporter = spans
    await cluster.create_topic("moving")  # leader 1
    # Leadership moves while the metadata service still names broker 1: the first attempt
    # gets NOT_LEADER_OR_FOLLOWER, the retry goes to broker 2.
    await cluster.controller.elect("moving", 0, leader=2)
    async with Producer(
        cluster.bootstrap, acks=-1, linger_ms=0, retry_backoff_ms=10, tracer_provider=provider
    ) as producer:
        record = await producer.send_and_wait("moving", b"v", partition=0)

    finished = exporter.get_finished_spans()
    [send] = [s for s in finished if s.name == "send moving"]
    produces = [s for s in finished if s.name == "Produce"]
    assert len(produces) == 2
    for produce in produces:
        assert produce.context.trace_id == send.context.trace_id
        assert produce.parent is not None and produce.parent.span_id == send.context.span_id
    first, retry = sorted(produces, key=lambda s: s.start_time)
    assert first.attributes["tidewater.error_code"] == "NOT_LEADER_OR_FOLLOWER"
    assert retry.attributes["tidewater.base_offset"] == record.offset
    assert send.attributes["tidewater.base_offset"] == record.offset
    [wait] = [s for s in finished if s.name == "batch.wait"]
    assert wait.parent is not None and wait.parent.span_id == send.context.span_id
    # The trace is this batch's alone: every span in it descends from `send`.
    in_trace = [s for s in finished if s.context.trace_id == send.context.trace_id]
    ids = {s.context.span_id for s in in_trace}
    assert all(s is send or (s.parent is not None and s.parent.span_id in ids) for s in in_trace)


async def test_the_parts_of_a_split_batch_stay_in_its_trace(cluster, spans) -> None:
    """Review 25 M2: the halves of a batch refused MESSAGE_TOO_LARGE went in no trace, and
    `send` ended with no offset. Every attempt, the refused one and each part's, is a child
    of the batch's `send`, which ends with the first record's offset once all parts are in."""
    provider, exporter = spans
    cluster.controller.configs["small"] = {"max.message.bytes": "2000"}
    await cluster.create_topic("small")
    async with Producer(cluster.bootstrap, linger_ms=50, tracer_provider=provider) as producer:
        futures = [await producer.send("small", bytes(300), partition=0) for _ in range(12)]
        await producer.flush()
    finished = exporter.get_finished_spans()
    [send] = [s for s in finished if s.name == "send small"]
    produces = [s for s in finished if s.name == "Produce"]
    assert all(p.parent is not None and p.parent.span_id == send.context.span_id for p in produces)
    errors = [p.attributes.get("tidewater.error_code") for p in produces]
    assert errors.count("MESSAGE_TOO_LARGE") >= 1 and errors.count(None) >= 2
    assert send.attributes["tidewater.base_offset"] == futures[0].result().offset == 0
    assert send.attributes["messaging.batch.message_count"] == 12


async def test_a_batch_the_sampler_drops_is_delivered_and_recorded_nowhere(cluster) -> None:
    """Sampled out at the client (a ratio sampler's usual case): the decision travels with the
    batch, so the tracing broker records nothing of it either."""
    exporter = InMemorySpanExporter()
    services = TracerProvider()
    services.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(services)
    try:
        await cluster.create_topic("unsampled")
        client = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
        client.add_span_processor(SimpleSpanProcessor(exporter))
        async with Producer(cluster.bootstrap, acks=-1, tracer_provider=client) as producer:
            record = await asyncio.wait_for(producer.send_and_wait("unsampled", b"v"), 30)
    finally:
        tracing.shutdown()
    assert record.offset == 0
    finished = exporter.get_finished_spans()
    assert not {s.name for s in finished} & {"send unsampled", "batch.wait", "Produce"}
    assert "replication.wait" not in {s.name for s in finished}
    # The only appends recorded are the followers', in their own fetches' traces.
    fetches = {s.context.span_id for s in finished if s.name == "replica.fetch"}
    for append in (s for s in finished if s.name == "log.append"):
        assert append.parent is not None and append.parent.span_id in fetches


async def test_a_traced_batch_links_sampled_out_fetches_by_their_fetchers_constant(
    cluster,
) -> None:
    """The brokers sample their own traces by ratio and keep none (a follower's fetches among
    them); the client records everything. The batch's replication.wait links each follower's
    fetch by the constant context its fetcher's stream declared for every sampled-out fetch."""
    with brokers_tracing(0.0) as exporter:
        await cluster.create_topic("linked")  # leader 1
        client = client_tracing(1.0, exporter)
        async with Producer(cluster.bootstrap, acks=-1, tracer_provider=client) as producer:
            await asyncio.wait_for(producer.send_and_wait("linked", b"v", partition=0), 30)
    finished = exporter.get_finished_spans()
    assert not {s.name for s in finished} & {"replica.fetch", "Fetch"}
    [wait] = [s for s in finished if s.name == "replication.wait"]
    assert_links_fetchers_constants(cluster, wait)


def assert_links_fetchers_constants(cluster: Any, wait: Any) -> None:
    """`wait` (a replication.wait on leader 1) links each follower's fetch by its fetcher's
    constant context: the followers' fetches were sampled out."""
    constants = {}
    for follower in (2, 3):
        fetchers = cluster.brokers[follower].replica_manager.fetcher_manager.fetchers.values()
        [fetcher] = [f for f in fetchers if f.source.broker_id == 1]
        constants[follower] = (fetcher.new_traces.trace_id, fetcher.new_traces.span_id)
    linked = {
        link.attributes["tidewater.follower_id"]: (link.context.trace_id, link.context.span_id)
        for link in wait.links
    }
    assert linked == constants


@contextlib.contextmanager
def brokers_tracing(ratio: float) -> Iterator[InMemorySpanExporter]:
    """The brokers (of this process) trace into memory, parentbased_traceidratio `ratio`."""
    exporter = InMemorySpanExporter()
    services = TracerProvider(sampler=ParentBasedTraceIdRatio(ratio))
    services.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(services)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def client_tracing(ratio: float, exporter: InMemorySpanExporter) -> TracerProvider:
    """A producer's tracer provider, parentbased_traceidratio `ratio`, into `exporter`."""
    client = TracerProvider(sampler=ParentBasedTraceIdRatio(ratio))
    client.add_span_processor(SimpleSpanProcessor(exporter))
    return client


@pytest.fixture
def brokers_at_ratio_1() -> Iterator[InMemorySpanExporter]:
    """The brokers keep every trace they start themselves: only a parent's decision keeps
    them from a span."""
    with brokers_tracing(1.0) as exporter:
        yield exporter


def arriving(
    cluster: Any, monkeypatch: pytest.MonkeyPatch, leader: int, method: str
) -> list[dict[str, str]]:
    """The trace_context of each partition batch (`method` "produce") or fetch ("fetch") the
    leader is sent, as it arrives."""
    replica_manager = cluster.brokers[leader].replica_manager
    handler = getattr(replica_manager, method)
    contexts: list[dict[str, str]] = []

    def recording(request: Any, *args: Any) -> Any:
        messages = request.partitions if method == "produce" else [request]
        contexts.extend(dict(message.trace_context) for message in messages)
        return handler(request, *args)

    monkeypatch.setattr(replica_manager, method, recording)
    return contexts


async def test_a_sampled_out_batch_carries_nothing_and_no_broker_starts_a_trace_for_it(
    cluster, monkeypatch, brokers_at_ratio_1
) -> None:
    """The producer's stream declared its not sampled constant: the batch carries no
    traceparent, and the leader, whose sampler keeps every trace it starts, starts none."""
    await cluster.create_topic("bare")  # leader 1
    contexts = arriving(cluster, monkeypatch, 1, "produce")
    client = client_tracing(0.0, brokers_at_ratio_1)
    async with Producer(cluster.bootstrap, acks=-1, tracer_provider=client) as producer:
        for _ in range(3):
            await asyncio.wait_for(producer.send_and_wait("bare", b"v", partition=0), 30)
    assert contexts == [{}, {}, {}]
    finished = brokers_at_ratio_1.get_finished_spans()
    assert not {s.name for s in finished} & {"send bare", "Produce", "replication.wait"}
    # The only appends recorded are the followers', in their own fetches' traces.
    fetches = {s.context.span_id for s in finished if s.name == "replica.fetch"}
    assert fetches
    for append in (s for s in finished if s.name == "log.append"):
        assert append.parent is not None and append.parent.span_id in fetches


async def test_a_stream_that_declares_nothing_has_its_bare_batches_traced_as_before(
    cluster, brokers_at_ratio_1
) -> None:
    """Other clients (grpcurl, other languages): on a stream that declared nothing, a batch
    without context starts the leader's own trace, as does a unary call without one, and a
    unary call's metadata is its parent. Only a stream that declared its sampled-out parent
    (tidewater-sampled-out-parent, as the SDK's producer does) has such batches untraced."""
    await cluster.create_topic("others")  # leader 1
    sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    sampled_out = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-02"

    def request(value: bytes) -> pb.ProduceRequest:
        batch = build_batch([Record(value=value)])
        return pb.ProduceRequest(
            acks=1, partitions=[pb.PartitionProduceData(topic="others", record_batch=batch)]
        )

    async def stream(value: bytes, metadata: Any) -> None:
        call = stub.ProduceStream(metadata=metadata)
        await call.write(request(value))
        response = await asyncio.wait_for(call.read(), 30)
        assert response.partitions[0].error_code == ErrorCode.NONE
        await call.done_writing()

    async with grpc.aio.insecure_channel(cluster.brokers[1].address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stream(b"undeclared", None)
        await stream(b"declared", (("tidewater-sampled-out-parent", sampled_out),))
        await stub.Produce(request(b"unary"), timeout=30)
        await stub.Produce(request(b"unary, in a trace"), metadata=(("traceparent", sampled),))

    produces = [s for s in brokers_at_ratio_1.get_finished_spans() if s.name == "Produce"]
    assert [s.attributes["tidewater.base_offset"] for s in produces] == [0, 2, 3]
    roots = [s for s in produces if s.parent is None]
    assert [s.attributes["tidewater.base_offset"] for s in roots] == [0, 2]
    [child] = [s for s in produces if s.parent is not None]
    assert child.parent.span_id == 0xB7AD6B7169203331 and child.parent.is_remote


async def test_a_sampled_batch_after_sampled_out_ones_on_a_stream_is_traced_in_full(
    cluster, monkeypatch
) -> None:
    """Client at 50%, brokers at 0%: the sampled-out batches carry nothing on the producer's
    stream, nor do the followers' fetches on theirs, and a sampled batch after them carries
    its traceparent: its trace is complete, replication.wait linking each follower's fetch by
    the constant its fetch stream declared."""
    with brokers_tracing(0.0) as exporter:
        fetches = arriving(cluster, monkeypatch, 1, "fetch")
        await cluster.create_topic("mixed")  # leader 1
        contexts = arriving(cluster, monkeypatch, 1, "produce")
        client = client_tracing(0.5, exporter)
        async with Producer(cluster.bootstrap, acks=-1, tracer_provider=client) as producer:
            # One batch at a time until one is sampled after at least two that are not (at
            # 50%, 64 batches miss that once in ~10^8 runs).
            for _ in range(64):
                await asyncio.wait_for(producer.send_and_wait("mixed", b"v", partition=0), 30)
                sends = [s for s in exporter.get_finished_spans() if s.name == "send mixed"]
                if not sends:
                    continue  # sampled out
                if len(contexts) > 2:
                    break
                exporter.clear()  # sampled too soon: again
                contexts.clear()
    [send] = sends
    # Every follower fetch is sampled out at 0%, and carries nothing either.
    assert fetches and all(context == {} for context in fetches)
    *bare, last = contexts
    assert len(bare) >= 2 and all(context == {} for context in bare)
    assert last["traceparent"].split("-")[1:3] == [
        f"{send.context.trace_id:032x}",
        f"{send.context.span_id:016x}",
    ]
    finished = exporter.get_finished_spans()
    [produce] = [s for s in finished if s.name == "Produce"]
    assert produce.parent is not None and produce.parent.span_id == send.context.span_id
    assert produce.context.trace_id == send.context.trace_id
    [wait] = [s for s in finished if s.name == "replication.wait"]
    [append] = [s for s in finished if s.name == "log.append"]
    for child in (wait, append):
        assert child.parent is not None and child.parent.span_id == produce.context.span_id
    assert_links_fetchers_constants(cluster, wait)
