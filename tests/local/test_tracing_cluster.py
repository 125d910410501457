"""Traces of a local cluster of real processes (`tidewater cluster up --trace`), asserted on the
trace files by structure (ids, parents, links, resources), never by timing: one acks=all
produce is one trace (the client's `send` and `batch.wait`, the leader's `Produce`,
`log.append` and `replication.wait`, whose links lead to both followers' fetches), a killed
leader's fencing is one controller trace down to the surviving brokers, a leader's AlterIsr
is one trace from the broker's call to the controller's `alter_isr`, and a consumer's `poll`
is the parent of the leader's `Fetch`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.local.cluster_cli import kill_recorded
from tests.local.traced_cluster import (
    TOPIC,
    Spans,
    admin,
    attributes,
    read_spans_of,
    record_produce,
    run_traced,
)
from tidewater.client.admin import Admin
from tidewater.client.consumer import Consumer
from tidewater.client.producer import Producer
from tidewater.local.cluster import ClusterFile
from tidewater.local.wait import eventually
from tidewater.telemetry.otlp_file import OtlpJsonFileSpanExporter

pytestmark = pytest.mark.timeout(300)


def test_one_acks_all_produce_is_one_trace_across_client_leader_and_followers(
    data_dir: Path,
) -> None:
    traces = record_produce(data_dir)
    spans = Spans(traces)
    assert {p.name for p in traces.glob("*.jsonl")} >= {
        "client.jsonl",
        "metadata-1.jsonl",
        "controller-1.jsonl",
        "controller-2.jsonl",
        "broker-1.jsonl",
        "broker-2.jsonl",
        "broker-3.jsonl",
    }
    by_id, children, child = spans.by_id, spans.children, spans.child

    # The client: one batch, one `send` span (kind PRODUCER) with `batch.wait` under it.
    [send] = [s for s in spans.all if s["name"] == f"send {TOPIC}"]
    assert send["kind"] == 4 and not send.get("parentSpanId")
    assert send["resource"]["service.name"] == "tidewater-client"
    assert send["attrs"]["messaging.destination.name"] == TOPIC
    assert send["attrs"]["messaging.batch.message_count"] == 1
    assert send["attrs"]["tidewater.base_offset"] == 0
    child(send, "batch.wait")

    # The leader: `Produce` (SERVER) under `send`, `log.append` and `replication.wait` under it.
    [produce] = [c for c in children[send["spanId"]] if c["name"] == "Produce"]
    assert produce["kind"] == 2
    assert produce["resource"]["service.name"] == "tidewater-broker"
    leader = produce["resource"]["tidewater.broker.id"]
    assert produce["attrs"]["tidewater.acks"] == -1
    assert produce["attrs"]["tidewater.base_offset"] == 0
    child(produce, "log.append")
    wait = child(produce, "replication.wait")
    assert wait["attrs"]["tidewater.hw"] >= 1

    # Every span of the trace is the client's or the leader's, and descends from `send`.
    trace = [s for s in spans.all if s["traceId"] == send["traceId"]]
    assert {s["resource"].get("tidewater.broker.id", "client") for s in trace} == {
        "client",
        leader,
    }
    for s in trace:
        assert s is send or s["parentSpanId"] in {t["spanId"] for t in trace}

    # Links: one per follower, each to the leader's `Fetch` of that follower, itself the child
    # of the follower's `replica.fetch`; the last one names the follower the ack waited for.
    followers = {1, 2, 3} - {leader}
    linked = [link["spanId"] for link in wait["links"]]
    link_followers = [attributes(link)["tidewater.follower_id"] for link in wait["links"]]
    assert sorted(link_followers) == sorted(followers)
    assert wait["attrs"]["tidewater.last_follower_id"] == link_followers[-1]
    for span_id, follower in zip(linked, link_followers, strict=True):
        fetch = by_id[span_id]
        assert fetch["name"] == "Fetch" and fetch["kind"] == 2
        assert fetch["resource"]["tidewater.broker.id"] == leader
        assert fetch["attrs"]["tidewater.follower_id"] == follower
        replica_fetch = by_id[fetch["parentSpanId"]]
        assert replica_fetch["name"] == "replica.fetch" and replica_fetch["kind"] == 3
        assert replica_fetch["resource"]["tidewater.broker.id"] == follower
        assert replica_fetch["traceId"] == fetch["traceId"] != send["traceId"]
        assert (
            attributes(next(a for a in wait["links"] if a["spanId"] == span_id))[
                "tidewater.fetch_offset"
            ]
            >= 1
        )
    # Each follower appended the batch under one of its `replica.fetch` spans.
    for follower in followers:
        appends = [
            s
            for s in spans.all
            if s["name"] == "log.append"
            and s["resource"].get("tidewater.broker.id") == follower
            and s["attrs"].get("messaging.destination.name") == TOPIC
        ]
        assert appends
        assert all(by_id[a["parentSpanId"]]["name"] == "replica.fetch" for a in appends)

    # The controller: its election, and the topic's creation electing leaders, whose
    # LeaderAndIsr fan-out reaches every broker through the RPC's trace context.
    # (The standby wins too, once `cluster down` stops the active controller.)
    elections = [s for s in spans.all if s["name"] == "controller.election"]
    assert elections
    for election in elections:
        assert election["resource"]["service.name"] == "tidewater-controller"
        assert election["attrs"]["tidewater.controller_epoch"] >= 1
    [create] = [
        s
        for s in spans.all
        if s["name"] == "leader.election"
        and by_id[s["parentSpanId"]]["name"].endswith("ControllerService/CreateTopics")
    ]
    assert create["attrs"]["tidewater.partitions"] == 1
    fan_out = child(create, "leader_and_isr.send")
    assert fan_out["attrs"]["tidewater.brokers"] == 3
    assert spans.served_by(fan_out) == {1, 2, 3}


def test_a_killed_leaders_fencing_is_one_controller_trace_down_to_the_surviving_brokers(
    data_dir: Path,
) -> None:
    killed: list[int] = []

    async def leader_other_than(client: Admin, old: int) -> int:
        """The partition's leader once the metadata service names one other than `old`."""

        async def new_leader() -> int | None:
            topics = (await client.describe_topics([TOPIC])).topics
            leaders = [p.leader for t in topics for p in t.partitions]
            return leaders[0] if leaders and leaders[0] not in (old, -1) else None

        return await eventually(new_leader, 60, 0.1)

    async def kill_the_leader(state: ClusterFile, traces: Path) -> None:
        async with admin(state) as client:
            await client.create_topic(TOPIC, partitions=1, replication_factor=3)
            leader = await leader_other_than(client, -1)
            [process] = [m for m in state.find("broker") if m.id == leader]
            os.kill(process.pid, signal.SIGKILL)
            killed.append(leader)
            await leader_other_than(client, leader)
        # The CLI's producer traces too, to the new leader.
        command = [sys.executable, "-m", "tidewater", "produce", "--topic", TOPIC]
        command += ["--bootstrap", state.find("metadata")[0].address]
        command += ["--trace-file", str(traces / "cli.jsonl")]
        produced = subprocess.run(
            command,
            input="after the failover\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert produced.returncode == 0, produced.stderr

    traces = run_traced(data_dir, kill_the_leader)
    spans = Spans(traces)
    [fence] = [
        s
        for s in spans.all
        if s["name"] == "broker.fence" and s["attrs"]["tidewater.broker.id"] == killed[0]
    ]
    assert fence["resource"]["service.name"] == "tidewater-controller"
    election = spans.child(fence, "leader.election")
    assert election["attrs"]["tidewater.partitions"] == 1
    assert election["attrs"]["tidewater.unclean"] == 0
    fan_out = spans.child(election, "leader_and_isr.send")
    assert spans.served_by(fan_out) == {1, 2, 3} - {killed[0]}

    [send] = [s for s in spans.all if s["name"] == f"send {TOPIC}"]
    assert send["resource"]["service.name"] == "tidewater-client"
    assert send["spanId"] in {s["spanId"] for s in read_spans_of(traces / "cli.jsonl")}
    [produce] = [s for s in spans.children[send["spanId"]] if s["name"] == "Produce"]
    assert produce["resource"]["tidewater.broker.id"] != killed[0]


GROWN = "grown"


async def grow_and_consume(state: ClusterFile, traces: Path) -> None:
    """A partition on brokers 1 and 2 reassigned to 1, 2 and 3: broker 3 catches up and its
    leader's AlterIsr takes it into the ISR. Then a traced consumer polls a record from it."""
    async with admin(state) as client:
        await client.create_topic(GROWN, assignments=[[1, 2]])

        async def isr() -> list[int] | None:
            """The partition's ISR, once the metadata service knows a leader for it."""
            topics = (await client.describe_topics([GROWN])).topics
            led = [p for t in topics for p in t.partitions if p.leader != -1]
            return sorted(led[0].isr) if led else None

        assert await eventually(isr, 60, 0.1) == [1, 2]
        await client.reassign({(GROWN, 0): [1, 2, 3]})
        await eventually(lambda: _is(isr, [1, 2, 3]), 60, 0.1)
    bootstrap = [m.address for m in state.find("metadata")]
    async with Producer(bootstrap, acks=-1) as producer:
        await asyncio.wait_for(producer.send_and_wait(GROWN, b"polled"), 60)
    provider = TracerProvider(resource=Resource.create({"service.name": "tidewater-client"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OtlpJsonFileSpanExporter(traces / "consumer.jsonl"))
    )
    try:
        async with Consumer(bootstrap, tracer_provider=provider) as consumer:
            consumer.assign([(GROWN, 0)])
            await consumer.seek_to_beginning((GROWN, 0))
            await eventually(consumer.poll, 60)
    finally:
        provider.shutdown()


async def _is(value: Callable[[], Awaitable[Any]], expected: Any) -> bool:
    return await value() == expected


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spans]:
    """The spans of every process of one traced cluster run of `grow_and_consume`."""
    root = tmp_path_factory.mktemp("traced") / "cluster"
    try:
        yield Spans(run_traced(root, grow_and_consume))
    finally:
        kill_recorded(root)


def test_a_leaders_alter_isr_is_one_trace_from_the_broker_to_the_controllers_batch(
    grown: Spans,
) -> None:
    alters = sorted(
        (
            s
            for s in grown.all
            if s["name"] == "alter_isr" and s["resource"]["service.name"] == "tidewater-controller"
        ),
        key=lambda s: int(s["startTimeUnixNano"]),
    )
    # The first: the batch that took broker 3 into the ISR, from the partition's leader: one
    # partition, at least one etcd transaction. (More may follow while `cluster down` stops
    # the brokers one by one.)
    assert alters
    assert alters[0]["attrs"]["tidewater.partitions"] == 1
    assert alters[0]["attrs"]["tidewater.txns"] >= 1
    assert alters[0]["attrs"]["tidewater.broker.id"] in (1, 2)
    for alter in alters:
        # Its parent is the controller's server span of the RPC, whose parent is the sending
        # broker's client span of the call: one trace across the two processes.
        server = grown.by_id[alter["parentSpanId"]]
        assert server["name"] == "/tidewater.v1.ControllerService/AlterIsr"
        assert server["kind"] == 2 and server["resource"] == alter["resource"]
        client = grown.by_id[server["parentSpanId"]]
        assert client["name"] == server["name"] and client["kind"] == 3
        assert client["resource"]["service.name"] == "tidewater-broker"
        assert client["resource"]["tidewater.broker.id"] == alter["attrs"]["tidewater.broker.id"]
        assert alter["traceId"] == server["traceId"] == client["traceId"]


def test_a_consumers_poll_is_the_parent_of_the_leaders_fetch(grown: Spans) -> None:
    [poll] = [
        s
        for s in grown.all
        if s["name"] == "poll" and s["attrs"].get("messaging.batch.message_count", 0) >= 1
    ]
    assert poll["kind"] == 5 and not poll.get("parentSpanId")
    assert poll["resource"]["service.name"] == "tidewater-client"
    # The leader's `Fetch` server span, in the consumer's trace, reading the partition.
    [fetch] = [c for c in grown.children[poll["spanId"]] if c["name"] == "Fetch"]
    assert fetch["kind"] == 2 and fetch["traceId"] == poll["traceId"]
    assert fetch["resource"]["service.name"] == "tidewater-broker"
    assert fetch["attrs"]["messaging.destination.name"] == GROWN
    assert "tidewater.follower_id" not in fetch["attrs"]
    read = grown.child(fetch, "log.read")
    assert read["resource"] == fetch["resource"]
