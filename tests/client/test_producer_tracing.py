"""Trace context through retries: a batch the producer sends twice (the first leader moved
away) stays one trace, each attempt's Produce a child of the batch's `send` span."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, ParentBasedTraceIdRatio

from tidewater.client.producer import Producer
from tidewater.telemetry import tracing


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
    fetch by the constant context its fetcher sends for every sampled-out fetch."""
    exporter = InMemorySpanExporter()
    services = TracerProvider(sampler=ParentBasedTraceIdRatio(0.0))
    services.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(services)
    try:
        await cluster.create_topic("linked")  # leader 1
        client = TracerProvider()
        client.add_span_processor(SimpleSpanProcessor(exporter))
        async with Producer(cluster.bootstrap, acks=-1, tracer_provider=client) as producer:
            await asyncio.wait_for(producer.send_and_wait("linked", b"v", partition=0), 30)
    finally:
        tracing.shutdown()
    finished = exporter.get_finished_spans()
    assert not {s.name for s in finished} & {"replica.fetch", "Fetch"}
    [wait] = [s for s in finished if s.name == "replication.wait"]
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
