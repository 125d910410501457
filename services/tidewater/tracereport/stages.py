"""Produce traces taken apart into the stages between `send()` and the ack (pure: spans in,
report out).

Per trace (TRACE_CONTRACT.md; durations of spans, so clocks of different hosts never mix):
    queueing    = batch.wait
    network     = send - batch.wait - Produce   (the last attempt's Produce; both directions,
                                                 plus earlier attempts and their backoff)
    append      = log.append
    replication = replication.wait              (0 for acks 0 and 1)
    response    = Produce - log.append - replication.wait
    total       = send
The five stages add up to the total by construction.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from tidewater.stats import percentile
from tidewater.tracereport.otlp_json import AttributeValue, Span

STAGES = ("queueing", "network", "append", "replication", "response")
TOTAL = "total"
TITLES = {
    "queueing": "client queueing",
    "network": "network",
    "append": "leader append",
    "replication": "replication wait",
    "response": "leader response",
    TOTAL: "total (send to ack)",
}
QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99), ("max", 1.0))
# Traces ranked by total latency: which stages make the slow ones slow.
BANDS = (
    ("fastest 50%", 0.0, 0.5),
    ("p50-p90", 0.5, 0.9),
    ("p90-p99", 0.9, 0.99),
    ("slowest 1%", 0.99, 1.0),
)

PRODUCER, SERVER = 4, 2  # OTLP SpanKind
STATUS_ERROR = 2


class Skip(StrEnum):
    """Why a produce trace is left out: a process's file is absent, or a span was not sampled."""

    NO_SEND = "no client send span (the client's trace file missing?)"
    NO_BATCH_WAIT = "no batch.wait span under send"
    NO_PRODUCE = "no leader Produce span (the leader's trace file missing?)"
    NO_ACKED_PRODUCE = "only failed Produce attempts (the acking leader's trace file missing?)"
    NO_APPEND = "no log.append span under Produce"
    NO_REPLICATION_WAIT = "acks=all but no replication.wait span under Produce"


@dataclass(frozen=True, slots=True)
class ProduceTrace:
    trace_id: str
    topic: str
    partition: str
    acks: int | None
    attempts: int  # Produce spans under send: more than one when the batch was retried
    stages_ns: Mapping[str, int]  # every stage, and TOTAL
    last_follower_id: int | None  # acks=all: the follower whose fetch completed the wait


@dataclass(frozen=True, slots=True)
class FailedSend:
    """A send that ended in an error: it has no produce-to-ack latency."""

    trace_id: str


@dataclass(frozen=True, slots=True)
class Band:
    label: str
    count: int
    mean_ns: Mapping[str, float]  # every stage, and TOTAL


@dataclass(frozen=True, slots=True)
class LatencyReport:
    traces: tuple[ProduceTrace, ...]
    failed: int  # sends that ended in an error: no produce-to-ack latency
    skipped: Mapping[Skip, int]
    percentiles: Mapping[str, Mapping[str, int]]  # stage or TOTAL -> quantile name -> ns
    last_to_ack: Sequence[tuple[int, int]]  # (follower id, traces), most often first
    bands: tuple[Band, ...]

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


def latency_report(spans: Iterable[Span]) -> LatencyReport:
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span)
    traces: list[ProduceTrace] = []
    skipped: Counter[Skip] = Counter()
    failed = 0
    for trace_spans in by_trace.values():
        for outcome in produce_traces(trace_spans):
            if isinstance(outcome, ProduceTrace):
                traces.append(outcome)
            elif isinstance(outcome, Skip):
                skipped[outcome] += 1
            else:
                failed += 1
    traces.sort(key=lambda t: t.stages_ns[TOTAL])
    followers = Counter(t.last_follower_id for t in traces if t.last_follower_id is not None)
    return LatencyReport(
        traces=tuple(traces),
        failed=failed,
        skipped=dict(skipped),
        percentiles=_percentiles(traces),
        last_to_ack=sorted(followers.items(), key=lambda item: (-item[1], item[0])),
        bands=_bands(traces),
    )


def produce_traces(spans: Sequence[Span]) -> list[ProduceTrace | FailedSend | Skip]:
    """The stages of each batch sent in one trace (one, unless the application sent several
    batches inside one span of its own: review 25 M3, all but the first were dropped); a
    Skip when spans are missing; none for a trace without produces (fetches, the
    controller)."""
    children: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        children[span.parent_span_id].append(span)
    sends = [s for s in spans if s.kind == PRODUCER and s.name.startswith("send ")]
    if not sends:
        return [Skip.NO_SEND] if any(_is_produce(s) for s in spans) else []
    return [_produce_trace(send, children) for send in sends]


def produce_trace(spans: Sequence[Span]) -> ProduceTrace | FailedSend | Skip | None:
    """The stages of a trace holding one batch's send (or None: no produce in it)."""
    outcomes = produce_traces(spans)
    return outcomes[0] if outcomes else None


def _produce_trace(
    send: Span, children: Mapping[str, list[Span]]
) -> ProduceTrace | FailedSend | Skip:
    if send.status_code == STATUS_ERROR:
        return FailedSend(send.trace_id)
    batch_wait = _child(children, send, "batch.wait")
    if batch_wait is None:
        return Skip.NO_BATCH_WAIT
    attempts = [s for s in children[send.span_id] if _is_produce(s)]
    if not attempts:
        return Skip.NO_PRODUCE
    produce = _acked_attempt(send, attempts)
    if produce is None:  # the send succeeded: its acked attempt is elsewhere
        return Skip.NO_ACKED_PRODUCE
    append = _child(children, produce, "log.append")
    if append is None:
        return Skip.NO_APPEND
    acks = _acks(send.attributes.get("tidewater.acks", produce.attributes.get("tidewater.acks")))
    wait = _child(children, produce, "replication.wait")
    if wait is None and acks == -1:
        return Skip.NO_REPLICATION_WAIT
    replication = wait.duration_ns if wait is not None else 0
    stages = {
        "queueing": batch_wait.duration_ns,
        "network": send.duration_ns - batch_wait.duration_ns - produce.duration_ns,
        "append": append.duration_ns,
        "replication": replication,
        "response": produce.duration_ns - append.duration_ns - replication,
        TOTAL: send.duration_ns,
    }
    last_follower = wait.attributes.get("tidewater.last_follower_id") if wait else None
    return ProduceTrace(
        trace_id=send.trace_id,
        topic=str(send.attributes.get("messaging.destination.name", send.name[len("send ") :])),
        partition=str(send.attributes.get("messaging.destination.partition.id", "")),
        acks=acks,
        attempts=len(attempts),
        stages_ns=stages,
        last_follower_id=last_follower if isinstance(last_follower, int) else None,
    )


def _acked_attempt(send: Span, attempts: Sequence[Span]) -> Span | None:
    """The attempt that acked the batch: one without an error at the offset `send` ended
    with (the first part's, for a batch split after MESSAGE_TOO_LARGE), else the latest
    without an error. Not simply the latest: a retry went to another leader, whose clock may
    be behind the first's (review 25 M4)."""
    acked = [s for s in attempts if s.status_code != STATUS_ERROR]
    offset = send.attributes.get("tidewater.base_offset")
    at_offset = [s for s in acked if s.attributes.get("tidewater.base_offset") == offset]
    return max(at_offset or acked, key=lambda s: s.start_ns, default=None)


def _is_produce(span: Span) -> bool:
    return span.kind == SERVER and span.name == "Produce"


def _child(children: Mapping[str, list[Span]], parent: Span, name: str) -> Span | None:
    return next((s for s in children.get(parent.span_id, ()) if s.name == name), None)


def _acks(value: AttributeValue) -> int | None:
    if value == "all":
        return -1
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _percentiles(traces: Sequence[ProduceTrace]) -> dict[str, dict[str, int]]:
    if not traces:
        return {}
    result = {}
    for stage in (*STAGES, TOTAL):
        values = sorted(t.stages_ns[stage] for t in traces)
        result[stage] = {name: percentile(values, q) for name, q in QUANTILES}
    return result


def _bands(traces: Sequence[ProduceTrace]) -> tuple[Band, ...]:
    """Mean stages of the traces in each band of total latency (traces sorted by total)."""
    n = len(traces)
    bands = []
    for label, low, high in BANDS:
        members = traces[math.floor(low * n) : math.floor(high * n)]
        if members:
            mean = {
                stage: sum(t.stages_ns[stage] for t in members) / len(members)
                for stage in (*STAGES, TOTAL)
            }
            bands.append(Band(label, len(members), mean))
    return tuple(bands)
