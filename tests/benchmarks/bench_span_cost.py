"""What tracing one producer batch costs in CPU at 100% sampling, per process role, without a
cluster: the spans Tidewater makes for one acks=all batch on RF=3 (client `send` and
`batch.wait`; the leader's `Produce`, `log.append`, `replication.wait` with two links, and two
follower fetches, each `Fetch`, `log.read`, `fetch.wait`; each follower's `replica.fetch` and
`log.append`), made through the real span classes, then their encoding to an OTLP/JSON trace
file in lines of 512 spans, with Tidewater's encoder (which the trace file's processor runs on
each span as it ends; a tracer whose provider's only processor is the trace file's encodes
its own spans straight from their fields, for less) and with OpenTelemetry's
FileSpanExporter; then made and written as a cluster does, into the trace file processor of
each role. Compare with the CPU per batch of the processes with tracing off (bench_tracing.py's
cluster: client ~1 ms, leader ~1.3-1.7 ms, each follower ~0.5-0.7 ms per batch of 135
records).

At 1%, what a batch sampled out costs each role, wire included (sampled_out_cost). And what a
follower's fetch costs to start its trace, over making the request alone: with the SDK's ids,
as a broker has them (sampled out, the fetch carries nothing: its stream declared its
fetcher's constant context, tracing.NewTraces),
and with another id generator drawing the same ids, which has each fetch asked and given a
context of its own (as every fetch was before NewTraces); rounds interleaved, medians.

Run: .venv/bin/python tests/benchmarks/bench_span_cost.py [--batches N] [--fetches N]"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

from tidewater.broker import spans
from tidewater.client.spans import BatchTrace
from tidewater.records.batch import Record, build_batch
from tidewater.telemetry import tracing
from tidewater.telemetry.otlp_file import OtlpJsonFileSpanExporter, OtlpJsonFileSpanProcessor
from tidewater.v1 import broker_pb2 as pb

ROLES = ("client", "leader", "follower")
RECORDS = 135  # a 16 KiB batch of 100-byte values
EXPORT_BATCH = 512
TP = ("bench", 0)


class Kept(SpanProcessor):
    """Keeps each span as it ends, for the export timed after: the least a processor does
    (the SDK's SimpleSpanProcessor would add its own ~8 us per span to the making)."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


class Roles:
    """A tracer provider per role (as each process has its own), and CPU seconds per role.
    With `trace_files` (a directory), each role's provider has the trace file's processor
    alone, as setup() installs it in a broker, and every role's spans go straight into it."""

    def __init__(self, trace_files: Path | None = None) -> None:
        self.kept = {role: Kept() for role in ROLES}
        self.files: dict[str, OtlpJsonFileSpanProcessor] = {}
        self.providers = {}
        for role in ROLES:
            provider = TracerProvider(resource=Resource.create({"service.name": role}))
            if trace_files is None:
                provider.add_span_processor(self.kept[role])
            else:
                path = trace_files / f"{role}.jsonl"
                self.files[role] = OtlpJsonFileSpanProcessor(OtlpJsonFileSpanExporter(path))
                provider.add_span_processor(self.files[role])
            self.providers[role] = provider
        self.tracers = {role: p.get_tracer(tracing.SCOPE) for role, p in self.providers.items()}
        self.fetchers = {follower: tracing.NewTraces() for follower in (2, 3)}
        self.batches = tracing.NewTraces()  # the producer's
        tracing.install(self.providers["leader"])
        self.cpu = dict.fromkeys(ROLES, 0.0)
        self._role = "client"
        self._since = time.process_time()

    def now(self, role: str) -> None:
        """From here on the CPU counts for `role` (whose tracer the broker spans use)."""
        now = time.process_time()
        self.cpu[self._role] += now - self._since
        self._role, self._since = role, now
        if role != "client":
            tracing.TRACER = self.tracers[role]

    def run(self, batches: int) -> dict[str, float]:
        """CPU us per batch and role (per follower) of `batches` batches after a warm-up."""
        client_tracer = tracing.client_tracer(self.providers["client"])
        assert client_tracer is not None
        waits = spans.ReplicationWaits()
        for warm_up in (True, False):
            self.cpu = dict.fromkeys(ROLES, 0.0)
            for kept in self.kept.values():
                kept.spans.clear()
            for i in range(200 if warm_up else batches):
                self.now("client")
                one_batch(self, BatchTrace(client_tracer, self.batches, TP[0], TP[1], -1), waits, i)
            self.now("client")
        per_batch = {role: 1e6 * cpu / batches for role, cpu in self.cpu.items()}
        per_batch["follower"] /= 2  # two followers
        return per_batch

    def shutdown(self) -> None:
        for processor in self.files.values():
            processor.shutdown()
        tracing.shutdown()


def one_batch(roles: Roles, client: BatchTrace, waits: spans.ReplicationWaits, i: int) -> None:
    batch = BATCH
    end = (i + 1) * RECORDS
    roles.now("client")
    client.drained()
    data = pb.PartitionProduceData(topic=TP[0], partition=TP[1])
    data.trace_context.update(client.carrier)
    roles.now("leader")
    produce = spans.ProduceTrace.start(data, -1, None)
    assert produce is not None  # sampled: every span is, here
    produce.appended(batch, i * RECORDS, 1, time.time_ns())
    started = waits.start([data], [produce], {TP: end})
    for follower in (2, 3):
        request = pb.FetchRequest(replica_id=follower)
        request.partitions.add(topic=TP[0], partition=TP[1], fetch_offset=end)
        roles.now("follower")
        replica_fetch = spans.ReplicaFetchTrace.start(request, 1, roles.fetchers[follower])
        assert replica_fetch is not None
        roles.now("leader")
        fetch = spans.FetchTrace.start(request, None)
        assert fetch is not None
        waits.follower_fetched(TP, follower, end, end, spans.fetch_link(request, fetch))
        start_ns = time.time_ns()
        fetch.waited(start_ns)
        fetch.read(start_ns, len(batch))
        fetch.answered(len(batch))
        fetch.end(pb.FetchResponse())
        roles.now("follower")
        replica_fetch.appended(TP, len(batch), start_ns)
        replica_fetch.span.end()
    roles.now("leader")
    response = pb.ProduceResponse()
    result = response.partitions.add(topic=TP[0], partition=TP[1], base_offset=i * RECORDS)
    waits.finish(started, response, lambda tp: end)
    produce.end(result)
    roles.now("client")
    client.end(RECORDS, len(batch), i * RECORDS, None)


BATCH = bytearray(build_batch([Record(key=None, value=bytes(100))] * RECORDS))


class OtherIds(RandomIdGenerator):
    """The SDK's random ids, but not its generator: a fetch's trace is then asked for."""


def fetch_cost(fetches: int, rounds: int = 7) -> dict[str, float]:
    """CPU us per follower fetch at 1% of starting its trace (sampled ones ended, to no
    processor), over making its request alone (`request`), by the ids' generator."""
    ratio = ParentBasedTraceIdRatio(0.01)
    providers = {
        "constant": TracerProvider(sampler=ratio),
        "per fetch": TracerProvider(sampler=ratio, id_generator=OtherIds()),
    }
    new_traces = tracing.NewTraces()

    def run(provider: TracerProvider | None) -> float:
        if provider is not None:
            tracing.install(provider)
        start = time.process_time()
        for _ in range(fetches):
            request = pb.FetchRequest(replica_id=2)
            if provider is not None:
                fetch = spans.ReplicaFetchTrace.start(request, 1, new_traces)
                if fetch is not None:
                    fetch.span.end()
        return 1e6 * (time.process_time() - start) / fetches

    cpu: dict[str, list[float]] = {"request": [], **{name: [] for name in providers}}
    for _ in range(rounds):
        cpu["request"].append(run(None))
        for name, provider in providers.items():
            cpu[name].append(run(provider))
    tracing.shutdown()
    request = statistics.median(cpu["request"])
    return {name: statistics.median(cpu[name]) - request for name in providers}


def sampled_out_cost(batches: int, rounds: int = 7) -> dict[str, float]:
    """CPU us per batch and role (per follower fetch) of a batch sampled out, as 99% are at
    1% (here parentbased_traceidratio 0: all), over its messages untraced, wire included
    (made and serialized by the sender, parsed by the receiver): the client's BatchTrace and
    what its attempt carries (nothing: the producer's stream declared its constant); the
    leader's look at that produce and at two follower fetches, each on a stream that declared
    its fetcher's constant; a follower's fetch. Rounds interleaved, medians."""
    provider = TracerProvider(sampler=ParentBasedTraceIdRatio(0.0))
    tracing.install(provider)
    client_tracer = tracing.client_tracer(provider)
    assert client_tracer is not None
    producer, fetcher = tracing.NewTraces(), tracing.NewTraces()
    produce_stream = tracing.stream_parent(producer.metadata)
    fetch_stream = tracing.stream_parent(fetcher.metadata)

    def produce_request(batch: BatchTrace | None) -> bytes:
        request = pb.ProduceRequest(acks=-1)
        data = request.partitions.add(topic=TP[0], partition=TP[1], record_batch=bytes(BATCH))
        if batch is not None:
            batch.carry(data.trace_context)
        return request.SerializeToString()

    def fetch_request(traced: bool) -> bytes:
        request = pb.FetchRequest(replica_id=2, max_wait_ms=500)
        request.partitions.add(topic=TP[0], partition=TP[1], fetch_offset=1)
        if traced:
            assert spans.ReplicaFetchTrace.start(request, 1, fetcher) is None
        return request.SerializeToString()

    def client(traced: bool) -> None:
        for _ in range(batches):
            batch = BatchTrace(client_tracer, producer, TP[0], TP[1], -1) if traced else None
            produce_request(batch)
            if batch is not None:
                batch.drained()
                batch.end(RECORDS, len(BATCH), 0, None)

    sent = {
        traced: (
            produce_request(
                BatchTrace(client_tracer, producer, TP[0], TP[1], -1) if traced else None
            ),
            fetch_request(traced),
        )
        for traced in (False, True)
    }

    def leader(traced: bool) -> None:
        produced, fetched = sent[traced]
        for _ in range(batches):
            request = pb.ProduceRequest.FromString(produced)
            if traced:
                assert spans.ProduceTrace.start_all(request, None, produce_stream) is None
            # The handler reads the partitions, traced or not.
            assert all(data.topic for data in request.partitions)
            for _ in range(2):
                fetch = pb.FetchRequest.FromString(fetched)
                if traced:
                    assert spans.FetchTrace.start(fetch, None, fetch_stream) is None
                assert all(partition.topic for partition in fetch.partitions)

    def follower(traced: bool) -> None:
        for _ in range(batches):
            fetch_request(traced)

    roles = {"client": client, "leader": leader, "follower": follower}
    cpu: dict[tuple[str, bool], list[float]] = {(r, t): [] for r in roles for t in (False, True)}
    for _ in range(rounds):
        for (role, traced), times in cpu.items():
            start = time.process_time()
            roles[role](traced)
            times.append(1e6 * (time.process_time() - start) / batches)
    tracing.shutdown()
    return {
        role: statistics.median(cpu[role, True]) - statistics.median(cpu[role, False])
        for role in roles
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4096)
    parser.add_argument("--fetches", type=int, default=100_000)
    args = parser.parse_args()
    per_fetch = fetch_cost(args.fetches)
    print(
        "a follower fetch's trace at 1%, us of CPU per fetch over making its request: "
        + ", ".join(f"{name} {cpu:.2f}" for name, cpu in per_fetch.items())
    )
    sampled_out = sampled_out_cost(args.fetches // 4)
    print(
        "a batch sampled out, us of CPU per batch over its messages untraced: "
        + ", ".join(f"{role} {cpu:.2f}" for role, cpu in sampled_out.items())
        + " (per follower)"
    )
    roles = Roles()
    per_batch = roles.run(args.batches)
    count = sum(len(k.spans) for k in roles.kept.values()) / args.batches
    print(
        f"spans per batch: {count:.0f}; making them, us of CPU per batch: "
        + ", ".join(f"{role} {per_batch[role]:.0f}" for role in ROLES)
        + " (per follower)"
    )
    summary = []
    with tempfile.TemporaryDirectory(prefix="tidewater-span-cost-") as tmp:
        for exporter_type in (OtlpJsonFileSpanExporter, FileSpanExporter):
            exported = {}
            for role in ROLES:
                exporter = exporter_type(Path(tmp) / f"{exporter_type.__name__}-{role}.jsonl")
                done = roles.kept[role].spans
                start = time.process_time()
                for k in range(0, len(done), EXPORT_BATCH):
                    exporter.export(done[k : k + EXPORT_BATCH])
                exported[role] = 1e6 * (time.process_time() - start) / args.batches
                exporter.shutdown()
            exported["follower"] /= 2
            total = sum(per_batch.values()) + per_batch["follower"]
            total += sum(exported.values()) + exported["follower"]
            print(
                f"exporting them with {exporter_type.__name__}, us per batch: "
                + ", ".join(f"{role} {exported[role]:.0f}" for role in ROLES)
                + f"; all processes, spans and export: {total:.0f} us per batch"
            )
            summary.append(f"{exporter_type.__name__} {total:.0f} us")
        roles.shutdown()
        # As the cluster runs: brokers whose only exporter is the trace file, a client whose
        # provider (the application's) has its processor alone.
        straight = Roles(Path(tmp))
        made = straight.run(args.batches)
        straight.shutdown()
    total = sum(made.values()) + made["follower"]
    print(
        "made and written to trace files as a cluster does, us per batch: "
        + ", ".join(f"{role} {made[role]:.0f}" for role in ROLES)
        + f"; all processes: {total:.0f} us per batch"
    )
    summary.append(f"as a cluster writes trace files {total:.0f} us")
    print(
        f"tracing CPU per producer batch at 100% sampling: {'; '.join(summary)}; "
        "per follower fetch at 1%: "
        + ", ".join(f"{name} context {cpu:.2f} us" for name, cpu in per_fetch.items())
    )


if __name__ == "__main__":
    main()
